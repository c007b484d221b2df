package client

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/jstest"
)

// middlewareFixture serves a handler limited by a Client whose test
// responder answers per the request's query: ?allowed=0&retry=MS&remaining=R&reset=MS&code=N.
type middlewareFixture struct {
	handler http.Handler
	served  int
}

func newMiddlewareFixture(t *testing.T, opts ...Option) *middlewareFixture {
	t.Helper()
	s := startServer(t)
	nc := jstest.Connect(t, s)
	startResponder(t, jstest.Connect(t, s), "rl", func(r seenRequest) answer {
		d := r.Descriptor
		if code, _ := strconv.Atoi(d["code"]); code != 0 {
			return answer{Code: code, Symbol: "bad_request", Message: "secret detail"}
		}
		retry, _ := strconv.ParseInt(d["retry"], 10, 64)
		reset, _ := strconv.ParseInt(d["reset"], 10, 64)
		remaining := d["remaining"]
		if remaining == "" {
			remaining = "0"
		}
		return reply(d["allowed"] != "0", d["policy"], 1, remaining, retry, reset)
	})
	f := &middlewareFixture{}
	// A generous timeout: the responder answers every request, so a 503
	// here would only say the machine was busy.
	c := newClient(t, nc, append([]Option{Timeout(30 * time.Second)}, opts...)...)
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.served++
		w.WriteHeader(http.StatusOK)
	})
	mapping := func(r *http.Request) (Request, bool) {
		q := r.URL.Query()
		if q.Get("unlimited") != "" {
			return Request{}, false
		}
		d := map[string]string{"policy": "acme-search"}
		for k := range q {
			d[k] = q.Get(k)
		}
		return Request{Descriptor: d}, true
	}
	f.handler = Middleware(c, mapping, next, PolicyQuotas(func(policy string) (Quota, bool) {
		if policy == "acme-search" {
			return Quota{Quota: 40, Window: 4 * time.Second}, true
		}
		return Quota{}, false
	}))
	return f
}

func (f *middlewareFixture) get(query string) *httptest.ResponseRecorder {
	w := httptest.NewRecorder()
	f.handler.ServeHTTP(w, httptest.NewRequest(http.MethodGet, "/search?"+query, nil))
	return w
}

func TestMiddlewareRetryAfter(t *testing.T) {
	f := newMiddlewareFixture(t)
	tests := []struct {
		retryMs int64
		want    string // "" = absent
	}{
		{1, "1"}, {999, "1"}, {1000, "1"}, {1001, "2"}, {1999, "2"}, {2000, "2"}, {61_001, "62"},
		{0, "1"}, // a denial without wait still gets 1, never 0
		{-1, ""}, // never: waiting does not help
	}
	for _, tt := range tests {
		w := f.get("allowed=0&retry=" + strconv.FormatInt(tt.retryMs, 10))
		got, present := w.Header()["Retry-After"]
		if w.Code != http.StatusTooManyRequests {
			t.Fatalf("retry %d ms: status %d, want 429", tt.retryMs, w.Code)
		}
		if tt.want == "" && present || tt.want != "" && (len(got) != 1 || got[0] != tt.want) {
			t.Errorf("retry %d ms: Retry-After %q, want %q", tt.retryMs, got, tt.want)
		}
	}
	if f.served != 0 {
		t.Fatalf("next served %d denied requests", f.served)
	}
}

func TestMiddlewareDenied(t *testing.T) {
	f := newMiddlewareFixture(t)
	w := f.get("allowed=0&retry=1500&remaining=0.5&reset=3500")
	if w.Code != http.StatusTooManyRequests {
		t.Fatalf("status %d, want 429", w.Code)
	}
	wantHeaders := map[string]string{
		"Retry-After":      "2",
		"Cache-Control":    "no-store, private",
		"Content-Type":     "application/json",
		"Ratelimit":        `"acme-search";r=0;t=4`,
		"Ratelimit-Policy": `"acme-search";q=40;w=4`,
	}
	for k, v := range wantHeaders {
		if got := w.Header().Get(k); got != v {
			t.Errorf("%s: %q, want %q", k, got, v)
		}
	}
	var body map[string]string
	if err := json.Unmarshal(w.Body.Bytes(), &body); err != nil {
		t.Fatalf("body %q: %v", w.Body, err)
	}
	if len(body) != 2 || body["error"] != "rate_limit_exceeded" || body["policy"] != "acme-search" {
		t.Fatalf("body %q", w.Body)
	}
}

func TestMiddlewareAdmitted(t *testing.T) {
	f := newMiddlewareFixture(t)
	w := f.get("remaining=12.75&reset=2001")
	if w.Code != http.StatusOK || f.served != 1 {
		t.Fatalf("status %d, served %d; want 200 from next", w.Code, f.served)
	}
	if got, want := w.Header().Get("RateLimit"), `"acme-search";r=12;t=3`; got != want {
		t.Errorf("RateLimit %q, want %q", got, want)
	}
	if got, want := w.Header().Get("RateLimit-Policy"), `"acme-search";q=40;w=4`; got != want {
		t.Errorf("RateLimit-Policy %q, want %q", got, want)
	}
	if got := w.Header().Get("Retry-After"); got != "" {
		t.Errorf("Retry-After %q on an admitted request", got)
	}

	// A policy without a known quota: RateLimit only. Unmatched: neither.
	w = f.get("policy=other&remaining=3&reset=0")
	if got, want := w.Header().Get("RateLimit"), `"other";r=3;t=0`; got != want || w.Header().Get("RateLimit-Policy") != "" {
		t.Errorf("other policy: RateLimit %q (want %q), RateLimit-Policy %q", got, want, w.Header().Get("RateLimit-Policy"))
	}
	w = f.get("policy=")
	if w.Code != http.StatusOK || w.Header().Get("RateLimit") != "" || w.Header().Get("RateLimit-Policy") != "" {
		t.Errorf("unmatched: status %d, headers %v", w.Code, w.Header())
	}
}

func TestMiddlewarePassThrough(t *testing.T) {
	// No responder at all: a limited request would fail, so passing
	// proves that the middleware did not ask.
	s := startServer(t)
	c := newClient(t, jstest.Connect(t, s))
	served := 0
	h := Middleware(c, func(*http.Request) (Request, bool) { return Request{}, false },
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { served++ }))
	w := httptest.NewRecorder()
	h.ServeHTTP(w, httptest.NewRequest(http.MethodGet, "/", nil))
	if w.Code != http.StatusOK || served != 1 || len(w.Header()) != 0 {
		t.Fatalf("status %d, served %d, headers %v; want a plain pass-through", w.Code, served, w.Header())
	}
}

func TestMiddlewareErrors(t *testing.T) {
	f := newMiddlewareFixture(t)
	for _, code := range []string{"400", "413", "500"} {
		w := f.get("code=" + code)
		if w.Code != http.StatusInternalServerError || w.Body.String() != `{"error":"internal_error"}` {
			t.Errorf("service %s: status %d body %q; want 500 without details", code, w.Code, w.Body)
		}
	}
	if f.served != 0 {
		t.Fatalf("next served %d requests without a decision", f.served)
	}
}

func TestMiddlewareUnavailable(t *testing.T) {
	s := startServer(t)
	nc := jstest.Connect(t, s)
	limited := func(*http.Request) (Request, bool) {
		return Request{Descriptor: map[string]string{"tenant": "acme"}}, true
	}
	served := 0
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { served++ })
	serve := func(c *Client) *httptest.ResponseRecorder {
		w := httptest.NewRecorder()
		var logged error
		Middleware(c, limited, next, OnError(func(_ *http.Request, err error) { logged = err })).
			ServeHTTP(w, httptest.NewRequest(http.MethodGet, "/", nil))
		if w.Code >= 500 && !IsUnavailable(logged) {
			t.Errorf("OnError got %v, want the unavailability error", logged)
		}
		return w
	}

	w := serve(newClient(t, nc))
	if w.Code != http.StatusServiceUnavailable || w.Header().Get("Retry-After") != "1" || w.Header().Get("Cache-Control") != "no-store, private" {
		t.Errorf("no failure behaviour: status %d headers %v; want 503", w.Code, w.Header())
	}
	w = serve(newClient(t, nc, OnUnavailable(func(string, map[string]string) Failure { return FailClosed() })))
	if w.Code != http.StatusTooManyRequests || w.Header().Get("Retry-After") != "1" || w.Header().Get("RateLimit") != "" {
		t.Errorf("fail closed: status %d headers %v; want 429, Retry-After 1, no RateLimit", w.Code, w.Header())
	}
	open := newClient(t, nc, Clock(newFakeClock().Now), OnUnavailable(func(string, map[string]string) Failure { return FailOpenBucket(1, 1) }))
	if w = serve(open); w.Code != http.StatusOK || served != 1 {
		t.Errorf("emergency bucket, first: status %d served %d; want 200", w.Code, served)
	}
	if w = serve(open); w.Code != http.StatusTooManyRequests || w.Header().Get("Retry-After") != "1" {
		t.Errorf("emergency bucket, second: status %d headers %v; want 429", w.Code, w.Header())
	}
}

func TestMiddlewareClientGone(t *testing.T) {
	s := startServer(t)
	c := newClient(t, jstest.Connect(t, s), OnUnavailable(func(string, map[string]string) Failure { return FailClosed() }))
	h := Middleware(c, func(*http.Request) (Request, bool) {
		return Request{Descriptor: map[string]string{"tenant": "acme"}}, true
	}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { t.Error("next served") }))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	w := httptest.NewRecorder()
	h.ServeHTTP(w, httptest.NewRequest(http.MethodGet, "/", nil).WithContext(ctx))
	if w.Body.Len() != 0 || len(w.Header()) != 0 {
		t.Fatalf("wrote %d %v %q for a gone client", w.Code, w.Header(), w.Body)
	}
}

func TestRetryAfterSeconds(t *testing.T) {
	for d, want := range map[time.Duration]int64{
		0: 1, time.Nanosecond: 1, time.Millisecond: 1, time.Second: 1, time.Second + time.Millisecond: 2, 90 * time.Second: 90,
	} {
		if got := retryAfterSeconds(d); got != want {
			t.Errorf("retryAfterSeconds(%v) = %d, want %d", d, got, want)
		}
	}
}

func TestAppendSFString(t *testing.T) {
	for in, want := range map[string]string{"acme-search": `"acme-search"`, `a"b\c`: `"a\"b\\c"`, "x\ny\u00e9": `"xy"`} {
		if got := string(appendSFString(nil, in)); got != want {
			t.Errorf("appendSFString(%q) = %s, want %s", in, got, want)
		}
	}
}
