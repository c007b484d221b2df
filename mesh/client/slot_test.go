package client

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/jstest"
	"github.com/nats-io/nats.go"
)

// closed reports whether ch is closed, without waiting.
func closed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// waitClosed waits up to 10 s for ch to be closed.
func waitClosed(t *testing.T, what string, ch <-chan struct{}) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(10 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
	}
}

func mustAcquire(t *testing.T, c *Client, ttl time.Duration) *Slot {
	t.Helper()
	slot, res, err := c.Acquire(context.Background(), acme, 1, ttl)
	if err != nil || slot == nil || !res.Allowed || slot.ID() == "" {
		t.Fatalf("Acquire = %v, %+v, %v; want a slot", slot, res, err)
	}
	return slot
}

// TestSlotRenewsInBackground: a slot renews its reservation (with its
// ttl) until Release, which stops the renewer before releasing; Release is
// idempotent.
func TestSlotRenewsInBackground(t *testing.T) {
	c, f := reserveFixture(t, 2, true)
	slot := mustAcquire(t, c, 300*time.Millisecond)
	waitUntil(t, "three renews", func() bool { return f.count("renew") >= 3 })
	for i, r := range f.requests("renew") {
		if str(r["reservation"]) != slot.ID() || str(r["ttl"]) != "300ms" {
			t.Errorf("renew %d: %v", i, r)
		}
	}
	if held, _, _, open := f.state(); held != 1_000_000 || open != 1 {
		t.Errorf("while held: %d micro-units in %d reservations", held, open)
	}

	if err := slot.Release(context.Background()); err != nil {
		t.Fatalf("Release: %v", err)
	}
	if !closed(slot.done) {
		t.Error("the renewer still runs after Release")
	}
	renews := f.count("renew")
	if held, _, _, open := f.state(); held != 0 || open != 0 || f.count("release") != 1 {
		t.Errorf("after Release: %d micro-units in %d reservations, %d releases", held, open, f.count("release"))
	}
	if err := slot.Release(context.Background()); err != nil || f.count("release") != 1 || f.count("renew") != renews {
		t.Errorf("second Release: %v, %d releases, renews %d -> %d", err, f.count("release"), renews, f.count("renew"))
	}
	if closed(slot.Lost()) || slot.Err() != nil {
		t.Errorf("a released slot reports lost: %v", slot.Err())
	}
}

// TestSlotLost: a slot whose reservation expired (renew answers 404) or
// was ended by another caller is lost: Lost is closed, Err says why, and
// Release returns nil.
func TestSlotLost(t *testing.T) {
	c, f := reserveFixture(t, 2, true)

	slot := mustAcquire(t, c, 300*time.Millisecond)
	f.expire(slot.ID())
	waitClosed(t, "the expired slot to be lost", slot.Lost())
	if !errors.Is(slot.Err(), ErrNotFound) {
		t.Errorf("Err = %v, want ErrNotFound", slot.Err())
	}
	if err := slot.Release(context.Background()); err != nil {
		t.Errorf("Release of an expired slot: %v", err)
	}

	slot = mustAcquire(t, c, 300*time.Millisecond)
	if _, err := c.Settle(context.Background(), slot.ID(), 1); err != nil {
		t.Fatal(err)
	}
	waitClosed(t, "the settled slot to be lost", slot.Lost())
	if err := slot.Err(); err == nil || errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), "settled") {
		t.Errorf("Err = %v, want the outcome that ended it", err)
	}
	if err := slot.Release(context.Background()); err != nil {
		t.Errorf("Release of a settled slot: %v", err)
	}
}

// TestSlotReleaseRetry: a release that gets no answer returns the error
// and can be called again; then it is done.
func TestSlotReleaseRetry(t *testing.T) {
	c, f := reserveFixture(t, 2, true)
	slot := mustAcquire(t, c, time.Minute)
	f.setFault(func(endpoint string, n int) *fault {
		if endpoint == "release" && n == 0 {
			return &fault{answer: answer{Code: 503, Symbol: "unavailable", Message: "busy"}}
		}
		return nil
	})
	if err := slot.Release(context.Background()); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Release: %v, want ErrUnavailable", err)
	}
	if err := slot.Release(context.Background()); err != nil {
		t.Fatalf("second Release: %v", err)
	}
	if err := slot.Release(context.Background()); err != nil || f.count("release") != 2 {
		t.Errorf("third Release: %v, %d releases sent, want 2", err, f.count("release"))
	}
	if _, _, _, open := f.state(); open != 0 {
		t.Errorf("%d reservations open", open)
	}
}

func TestAcquireDenied(t *testing.T) {
	c, _ := reserveFixture(t, 1, true)
	ctx := context.Background()
	first := mustAcquire(t, c, 0)
	slot, res, err := c.Acquire(ctx, acme, 1, 0)
	if slot != nil || err != nil || res == nil || res.Allowed || res.Policy != "p" || res.RetryAfter != 250*time.Millisecond {
		t.Fatalf("Acquire when full = %v, %+v, %v; want no slot and the denial", slot, res, err)
	}
	if err := first.Release(ctx); err != nil {
		t.Fatal(err)
	}
	second := mustAcquire(t, c, 0)
	defer second.Release(ctx)
	if _, _, err := c.Acquire(ctx, acme, 1, 0, DryRun()); !errors.Is(err, ErrInvalidRequest) {
		t.Errorf("Acquire with DryRun: %v, want ErrInvalidRequest", err)
	}
}

// TestAcquireWithoutReservation: an admission without a reservation (no
// policy matched) is a slot that holds and renews nothing.
func TestAcquireWithoutReservation(t *testing.T) {
	s := startServer(t)
	nc := jstest.Connect(t, s)
	svcNC := jstest.Connect(t, s)
	sub, err := svcNC.Subscribe("rl.v1.reserve", func(m *nats.Msg) {
		_ = m.Respond([]byte(`{"allowed":true,"policy":"","revision":0,"remaining":0,"retry_after_ms":0,"reset_after_ms":0}`))
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	if err := svcNC.Flush(); err != nil {
		t.Fatal(err)
	}
	c := newClient(t, nc, Timeout(30*time.Second))
	slot, res, err := c.Acquire(context.Background(), acme, 1, 0)
	if err != nil || slot == nil || !res.Allowed || slot.ID() != "" {
		t.Fatalf("Acquire = %v, %+v, %v", slot, res, err)
	}
	if !closed(slot.done) {
		t.Error("a slot without a reservation runs a renewer")
	}
	if err := slot.Release(context.Background()); err != nil {
		t.Errorf("Release: %v", err)
	}
}

// concurrencyFixture serves handlers limited by ConcurrencyMiddleware with
// a concurrency limit of limit slots. The handler blocks until its
// request's ?block channel is closed, and panics with ?panic.
type concurrencyFixture struct {
	f       *resService
	handler http.Handler
	entered chan string
	unblock sync.Map // name -> chan struct{}
	errs    chan error
}

type panicValue struct{ name string }

func newConcurrencyFixture(t *testing.T, limit int64, opts ...MiddlewareOption) *concurrencyFixture {
	t.Helper()
	c, f := reserveFixture(t, limit, true)
	cf := &concurrencyFixture{f: f, entered: make(chan string, 16), errs: make(chan error, 16)}
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		if name := q.Get("block"); name != "" {
			ch, _ := cf.unblock.LoadOrStore(name, make(chan struct{}))
			cf.entered <- name
			<-ch.(chan struct{})
		}
		if name := q.Get("panic"); name != "" {
			panic(panicValue{name})
		}
		w.WriteHeader(http.StatusOK)
	})
	mapping := func(r *http.Request) (Request, bool) {
		if r.URL.Query().Get("unlimited") != "" {
			return Request{}, false
		}
		return Request{Descriptor: acme}, true
	}
	opts = append([]MiddlewareOption{OnError(func(_ *http.Request, err error) { cf.errs <- err })}, opts...)
	cf.handler = ConcurrencyMiddleware(c, mapping, next, opts...)
	return cf
}

func (cf *concurrencyFixture) get(query string) *httptest.ResponseRecorder {
	w := httptest.NewRecorder()
	cf.handler.ServeHTTP(w, httptest.NewRequest(http.MethodGet, "/export?"+query, nil))
	return w
}

func (cf *concurrencyFixture) release(name string) {
	ch, _ := cf.unblock.LoadOrStore(name, make(chan struct{}))
	close(ch.(chan struct{}))
}

// TestConcurrencyMiddleware: a request holds a slot while its handler
// runs; with the limit's slots taken the next request gets 429 with
// Retry-After and the RateLimit headers; the slot comes back when the
// handler returns.
func TestConcurrencyMiddleware(t *testing.T) {
	cf := newConcurrencyFixture(t, 1, SlotTTL(time.Minute))
	done := make(chan *httptest.ResponseRecorder)
	go func() { done <- cf.get("block=a") }()
	if name := <-cf.entered; name != "a" {
		t.Fatalf("entered %q", name)
	}
	if held, _, _, open := cf.f.state(); held != 1_000_000 || open != 1 {
		t.Fatalf("while a runs: %d micro-units held in %d reservations", held, open)
	}
	if got := str(cf.f.requests("reserve")[0]["ttl"]); got != "1m0s" {
		t.Errorf("reserve ttl %q, want 1m0s", got)
	}

	w := cf.get("")
	h := w.Header()
	if w.Code != http.StatusTooManyRequests || h.Get("Retry-After") != "1" || h.Get("RateLimit") != `"p";r=0;t=1` ||
		h.Get("Cache-Control") != "no-store, private" || w.Body.String() != `{"error":"rate_limit_exceeded","policy":"p"}` {
		t.Errorf("when full: %d %v %s", w.Code, h, w.Body)
	}

	cf.release("a")
	if w := <-done; w.Code != http.StatusOK || w.Header().Get("RateLimit") != `"p";r=0;t=1` {
		t.Errorf("a: %d %v", w.Code, w.Header())
	}
	if held, _, _, open := cf.f.state(); held != 0 || open != 0 || cf.f.count("release") != 1 {
		t.Errorf("after a returned: %d micro-units held in %d reservations, %d releases", held, open, cf.f.count("release"))
	}
	if w := cf.get(""); w.Code != http.StatusOK {
		t.Errorf("after a returned: %d", w.Code)
	}
	if _, _, _, open := cf.f.state(); open != 0 {
		t.Errorf("%d reservations open after the handlers returned", open)
	}
	n := cf.f.count("reserve")
	if w := cf.get("unlimited=1"); w.Code != http.StatusOK || cf.f.count("reserve") != n {
		t.Errorf("unlimited: %d, %d reserves", w.Code, cf.f.count("reserve")-n)
	}
	select {
	case err := <-cf.errs:
		t.Errorf("OnError: %v", err)
	default:
	}
}

// TestConcurrencyMiddlewarePanic: a handler that panics gives its slot
// back, and the panic goes on with its value.
func TestConcurrencyMiddlewarePanic(t *testing.T) {
	cf := newConcurrencyFixture(t, 1)
	func() {
		defer func() {
			if v := recover(); v != (panicValue{"boom"}) {
				t.Errorf("recovered %v, want the handler's panic", v)
			}
		}()
		cf.get("panic=boom")
		t.Error("the panic did not go on")
	}()
	if held, _, _, open := cf.f.state(); held != 0 || open != 0 || cf.f.count("release") != 1 {
		t.Errorf("after the panic: %d micro-units held in %d reservations, %d releases", held, open, cf.f.count("release"))
	}
	if w := cf.get(""); w.Code != http.StatusOK {
		t.Errorf("after the panic: %d, want the slot back", w.Code)
	}
}

// TestConcurrencyMiddlewareCancelledRequest: a request whose context is
// cancelled while its handler runs (the client went away) still gives its
// slot back.
func TestConcurrencyMiddlewareCancelledRequest(t *testing.T) {
	cf := newConcurrencyFixture(t, 1)
	ctx, cancel := context.WithCancel(context.Background())
	inner := cf.handler
	cf.handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { inner.ServeHTTP(w, r.WithContext(ctx)) })
	done := make(chan struct{})
	go func() { cf.get("block=a"); close(done) }()
	<-cf.entered
	cancel()
	cf.release("a")
	<-done
	if _, _, _, open := cf.f.state(); open != 0 || cf.f.count("release") != 1 {
		t.Errorf("after a cancelled request: %d reservations open, %d releases", open, cf.f.count("release"))
	}
}

// TestConcurrencyMiddlewareUnavailable: without an answer the middleware
// answers 503 (reservations never fail open) and reports the error.
func TestConcurrencyMiddlewareUnavailable(t *testing.T) {
	cf := newConcurrencyFixture(t, 1)
	cf.f.setFault(func(string, int) *fault {
		return &fault{answer: answer{Code: 503, Symbol: "unavailable", Message: "busy"}}
	})
	w := cf.get("")
	if w.Code != http.StatusServiceUnavailable || w.Header().Get("Retry-After") != "1" || w.Body.String() != `{"error":"rate_limiter_unavailable"}` {
		t.Errorf("unavailable: %d %v %s", w.Code, w.Header(), w.Body)
	}
	if err := <-cf.errs; !errors.Is(err, ErrUnavailable) {
		t.Errorf("OnError: %v", err)
	}
}
