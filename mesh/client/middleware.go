package client

import (
	"context"
	"net/http"
	"strconv"
	"time"

	"github.com/limitmesh/limitmesh/internal/wire"
)

// Request is what the mapping function of a [Middleware] or
// [ConcurrencyMiddleware] extracts from an HTTP request: the descriptor,
// the cost in whole units (0 means 1) and any further DecideOptions (e.g.
// Cost("2.5") or RequestID).
type Request struct {
	Descriptor map[string]string
	Cost       int64
	Options    []DecideOption
}

// Quota describes a policy for the RateLimit-Policy header: Quota units
// per Window.
type Quota struct {
	Quota  int64
	Window time.Duration
}

type middlewareOptions struct {
	quota   func(policy string) (Quota, bool)
	onError func(r *http.Request, err error)
	ttl     time.Duration // ConcurrencyMiddleware's slots
}

// A MiddlewareOption configures [Middleware] and [ConcurrencyMiddleware].
type MiddlewareOption func(*middlewareOptions)

// PolicyQuotas gives the quota of a policy for the RateLimit-Policy header
// (the decide reply does not carry it). Without it, or when fn returns
// false, only the RateLimit header is sent.
func PolicyQuotas(fn func(policy string) (Quota, bool)) MiddlewareOption {
	return func(o *middlewareOptions) { o.quota = fn }
}

// OnError is called with every error that left the request without a
// decision (for logging); the middleware then answers 503 or 500.
func OnError(fn func(r *http.Request, err error)) MiddlewareOption {
	return func(o *middlewareOptions) { o.onError = fn }
}

// Middleware limits the requests of next with c. For each request, fn
// returns the Request to decide, or false to pass the request through
// without limiting.
//
// Responses:
//   - admitted: next serves; when the service decided under a policy, the
//     RateLimit (and, with [PolicyQuotas], RateLimit-Policy) headers are set
//     first;
//   - denied (by the service or by the failure behaviour): 429 with
//     Content-Type application/json, body
//     {"error":"rate_limit_exceeded","policy":"<name>"},
//     Cache-Control "no-store, private" (shared caches must never serve a
//     tenant's 429 to another), the RateLimit headers when the service
//     decided, and Retry-After in whole seconds rounded up from RetryAfter,
//     at least 1 (a zero wait is sent as 1 so that clients never retry in a
//     tight loop); Retry-After is omitted when Result.Never is set: the
//     request cannot succeed by waiting;
//   - no decision and no failure behaviour configured ([OnUnavailable]): 503,
//     Retry-After 1, body {"error":"rate_limiter_unavailable"};
//   - invalid request, internal error or malformed reply: 500, body
//     {"error":"internal_error"} without details: the gateway built a
//     request the service rejects, which is a server bug, not the caller's;
//   - the HTTP request's context cancelled: nothing is written.
//
// The RateLimit headers follow the structured-field form of
// draft-ietf-httpapi-ratelimit-headers-10 (RFC 8941 lists of named items):
//
//	RateLimit-Policy: "acme-search";q=40;w=4
//	RateLimit: "acme-search";r=12;t=3
//
// where r is the remaining units rounded down, t the seconds until the
// limit is full again (rounded up), q and w the [Quota] in units and
// seconds (rounded up).
func Middleware(c *Client, fn func(*http.Request) (Request, bool), next http.Handler, opts ...MiddlewareOption) http.Handler {
	var o middlewareOptions
	for _, opt := range opts {
		opt(&o)
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		req, limited := fn(r)
		if !limited {
			next.ServeHTTP(w, r)
			return
		}
		cost := req.Cost
		if cost == 0 {
			cost = 1
		}
		res, err := c.Decide(r.Context(), req.Descriptor, cost, req.Options...)
		if err != nil {
			writeUndecided(w, r, err, &o)
			return
		}
		if res.Source == SourceService && res.Policy != "" {
			setRateLimitHeaders(w.Header(), res, o.quota)
		}
		if res.Allowed {
			next.ServeHTTP(w, r)
			return
		}
		writeDenied(w, res)
	})
}

// SlotTTL sets the ttl of the slots [ConcurrencyMiddleware] holds (default
// 0: the service's, [DefaultTTL]); a slot is renewed every third of it
// while its handler runs. It must be between 0 and [MaxTTL]; a ttl outside
// makes every acquisition an invalid request (500).
func SlotTTL(d time.Duration) MiddlewareOption {
	return func(o *middlewareOptions) { o.ttl = d }
}

// ConcurrencyMiddleware limits the requests in flight in next with c: for
// each request fn returns the Request to acquire a slot for (its cost in
// units of a concurrency limit, CONTRACT.md §10), or false to pass it
// through. The handler runs while the request holds a slot ([Client.Acquire],
// renewed in the background); the slot is released when the handler
// returns or panics (the panic then goes on, after the release).
//
// The responses when no handler runs are [Middleware]'s: 429 with
// Retry-After and the RateLimit headers when no slot is free, 503 when the
// service is unavailable (reservations have no failure behaviour), 500 for
// an invalid request, internal error or malformed reply. [OnError] also
// receives the errors of releasing a slot (the slot then ends at its
// expiry).
func ConcurrencyMiddleware(c *Client, fn func(*http.Request) (Request, bool), next http.Handler, opts ...MiddlewareOption) http.Handler {
	var o middlewareOptions
	for _, opt := range opts {
		opt(&o)
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		req, limited := fn(r)
		if !limited {
			next.ServeHTTP(w, r)
			return
		}
		cost := req.Cost
		if cost == 0 {
			cost = 1
		}
		slot, res, err := c.Acquire(r.Context(), req.Descriptor, cost, o.ttl, req.Options...)
		if err != nil {
			writeUndecided(w, r, err, &o)
			return
		}
		if res.Policy != "" {
			setRateLimitHeaders(w.Header(), res, o.quota)
		}
		if slot == nil {
			writeDenied(w, res)
			return
		}
		// A deferred release runs also while a panic unwinds, which then
		// continues. The release outlives the request's cancellation (a
		// client gone away still frees its slot) under the client's timeout.
		defer func() {
			if err := slot.Release(context.WithoutCancel(r.Context())); err != nil && o.onError != nil {
				o.onError(r, err)
			}
		}()
		next.ServeHTTP(w, r)
	})
}

// writeUndecided answers a request that got no decision (err): 503 when
// the service was unavailable, else 500; nothing when the request's
// context was cancelled.
func writeUndecided(w http.ResponseWriter, r *http.Request, err error, o *middlewareOptions) {
	if r.Context().Err() != nil {
		return
	}
	if o.onError != nil {
		o.onError(r, err)
	}
	h := w.Header()
	h.Set("Cache-Control", "no-store, private")
	h.Set("Content-Type", "application/json")
	if IsUnavailable(err) {
		h.Set("Retry-After", "1")
		w.WriteHeader(http.StatusServiceUnavailable)
		_, _ = w.Write([]byte(`{"error":"rate_limiter_unavailable"}`))
		return
	}
	w.WriteHeader(http.StatusInternalServerError)
	_, _ = w.Write([]byte(`{"error":"internal_error"}`))
}

// writeDenied answers a denied request: 429 (see [Middleware]).
func writeDenied(w http.ResponseWriter, res *Result) {
	h := w.Header()
	h.Set("Cache-Control", "no-store, private")
	h.Set("Content-Type", "application/json")
	if !res.Never {
		h.Set("Retry-After", strconv.FormatInt(retryAfterSeconds(res.RetryAfter), 10))
	}
	w.WriteHeader(http.StatusTooManyRequests)
	body := make([]byte, 0, 64+len(res.Policy))
	body = append(body, `{"error":"rate_limit_exceeded","policy":`...)
	body = wire.AppendString(body, res.Policy)
	body = append(body, '}')
	_, _ = w.Write(body)
}

// retryAfterSeconds is the Retry-After value for a wait d: whole seconds
// rounded up, at least 1.
func retryAfterSeconds(d time.Duration) int64 {
	s := int64((d + time.Second - 1) / time.Second)
	if s < 1 {
		s = 1
	}
	return s
}

// ceilSeconds rounds d up to whole seconds (0 for d <= 0).
func ceilSeconds(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	return int64((d + time.Second - 1) / time.Second)
}

// setRateLimitHeaders sets RateLimit and, when the quota is known,
// RateLimit-Policy for res.
func setRateLimitHeaders(h http.Header, res *Result, quota func(string) (Quota, bool)) {
	name := appendSFString(nil, res.Policy)
	if quota != nil {
		if q, ok := quota(res.Policy); ok && q.Quota >= 0 {
			v := append([]byte(nil), name...)
			v = append(v, ";q="...)
			v = strconv.AppendInt(v, q.Quota, 10)
			if w := ceilSeconds(q.Window); w > 0 {
				v = append(v, ";w="...)
				v = strconv.AppendInt(v, w, 10)
			}
			h.Set("RateLimit-Policy", string(v))
		}
	}
	v := name
	v = append(v, ";r="...)
	v = strconv.AppendInt(v, res.Remaining.Floor(), 10)
	v = append(v, ";t="...)
	v = strconv.AppendInt(v, ceilSeconds(res.ResetAfter), 10)
	h.Set("RateLimit", string(v))
}

// appendSFString appends s as an RFC 8941 sf-string: quotes and
// backslashes escaped, characters outside printable ASCII dropped.
func appendSFString(dst []byte, s string) []byte {
	dst = append(dst, '"')
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '"' || c == '\\':
			dst = append(dst, '\\', c)
		case c >= 0x20 && c < 0x7f:
			dst = append(dst, c)
		}
	}
	return append(dst, '"')
}
