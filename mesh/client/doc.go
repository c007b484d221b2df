// Package client is the Go SDK that gateways and services embed to ask a
// limitmesh deployment for rate-limit decisions and reservations over NATS,
// plus net/http middlewares that answer 429 Too Many Requests.
//
// It speaks the wire contract of CONTRACT.md §2 and §10: a JSON request on
// the subject "<prefix>.v1.decide" (default prefix "rl"; reservations on
// "<prefix>.v1.reserve", ".settle", ".release" and ".renew"), a JSON reply,
// and NATS micro errors (headers Nats-Service-Error-Code and
// Nats-Service-Error, body {"error": symbol, "message": text}). It imports no other limitmesh
// package and depends only on nats.go, so that gateways stay light.
//
// # Usage
//
//	nc, _ := nats.Connect(url)
//	c, err := client.New(nc,
//		client.Timeout(250*time.Millisecond), // when ctx has no deadline
//		client.OnUnavailable(func(policy string, d map[string]string) client.Failure {
//			if policy == "acme-search" {
//				return client.FailOpenBucket(10, 40) // local: 10/s, burst 40
//			}
//			return client.FailClosed()
//		}))
//	res, err := c.Decide(ctx, map[string]string{"tenant": "acme", "operation": "search"}, 3)
//	switch {
//	case err != nil: // invalid request, internal error, or unavailable without a failure behaviour
//	case !res.Allowed: // denied: res.RetryAfter (or res.Never), res.Policy
//	default: // admitted
//	}
//
// # Outcomes
//
// Callers tell outcomes apart with result fields and errors.Is:
//
//	admitted or denied by the service  Result (Source SourceService), nil error
//	400 / 413 or rejected locally      ErrInvalidRequest (*ServiceError when answered)
//	404 (settle, release, renew)       ErrNotFound (*ServiceError): unknown or expired reservation
//	500 or unknown code                ErrInternal (*ServiceError)
//	undecodable reply                  ErrBadReply
//	503 or closed connection           ErrUnavailable   \
//	no responders                      ErrNoResponders   } failure behaviour, if configured
//	no reply before the deadline       ErrTimeout       /
//	ctx cancelled                      the context's error
//
// # Failure behaviour (§26)
//
// [OnUnavailable] chooses, per policy (the one that last decided the
// descriptor, remembered by the client) or per descriptor, what happens
// when no decision can be obtained: [FailClosed] denies; [FailOpenBucket]
// admits from a local emergency token bucket per descriptor key with its
// own rate and burst, so fail-open is bounded and never unlimited. At most
// [MaxEmergencyBuckets] keys (default 10,000, least recently used evicted)
// are remembered. Failure results carry Source and the cause in Result.Err.
// Errors that are not unavailability are never masked.
//
// # Leased mode (CONTRACT §8)
//
// With [Leasing], the client holds grants of leased policies: units the
// nodes of its region hand it (carved from grants the limit key's owner
// made them) that it spends locally until they expire:
//
//	c, _ := client.New(nc, client.Leasing("gw-eu-1"))
//	defer c.Close() // returns what was not spent
//	res, err := c.Decide(ctx, d, 1) // Source SourceLease when spent locally
//	l, _ := c.Lease(d)
//	if l.Spend(1) { /* admitted: no allocation, no round trip */ }
//
// A grant is spent until the client's clock, counted from when it asked,
// passes the grant's ttl less a tenth (the skew margin the nodes
// document), and never beyond its units. The client reports its cumulative
// spend per grant, asks for the next grant when half of the current one is
// spent (or a quarter ttl before it ends), returns a grant unused for a
// quarter ttl (so busier holders get the units), and returns everything on
// [Client.Close]. When the nodes have no grant to give, the client decides
// remotely (strict), or denies locally while they say the key's limits
// lack the units; when no node answers, the failure behaviour applies.
// The wire protocol is in docs/protocol.md, "Leased mode".
//
// # HTTP
//
// [Middleware] maps each HTTP request to a descriptor and cost (or passes
// it through), answers denials with 429, Retry-After (whole seconds rounded
// up, at least 1; omitted when the cost can never be admitted),
// Cache-Control "no-store, private", the RateLimit and RateLimit-Policy
// headers of draft-ietf-httpapi-ratelimit-headers-10, and the body
// {"error":"rate_limit_exceeded","policy":"<name>"}.
//
// # Reservations and concurrency (CONTRACT §10)
//
// When a request's true cost is known only afterwards, reserve a
// conservative maximum, do the work, then settle what it cost; the rest is
// given back. A reservation not settled by its ttl expires: it counts as
// spent at its reserved cost in rate, window and quota limits and gives its
// units back in concurrency limits.
//
//	r, err := c.Reserve(ctx, map[string]string{"tenant": "acme", "operation": "export"}, 100,
//		time.Minute, client.RequestID(jobID)) // ttl 0: the service's default, 30s
//	switch {
//	case err != nil: // as for Decide, but unavailability is never masked
//	case !r.Allowed: // denied: r.RetryAfter, r.Never, r.Policy
//	default:
//		cost := export() // the work
//		st, err := c.Settle(ctx, r.ID, cost) // or client.Cost("12.5"), or SettleReserved
//		// st.Settled, st.Returned; errors.Is(err, client.ErrNotFound): it expired
//	}
//
// [Client.Release] is a settle of 0; [Client.Renew] extends an open
// reservation. Settling, releasing or renewing a reservation that already
// ended returns its first ending outcome ([Settlement].Outcome), so all
// three are safe to retry. There is no failure behaviour for reservations:
// when no answer comes they return the unavailability error
// ([ErrTimeout], [ErrNoResponders], [ErrUnavailable]).
//
// A policy with a concurrency limit counts work in flight, and is only
// reserved (Decide on it is a 400 naming rl.v1.reserve). [Client.Acquire]
// holds a slot and renews it in the background every third of its ttl
// until [Slot.Release] (idempotent); the slot is nil when none is free:
//
//	slot, res, err := c.Acquire(ctx, d, 1, 10*time.Second)
//	if err != nil { /* no answer: fail */ }
//	if slot == nil { /* full: res.RetryAfter */ }
//	defer slot.Release(context.WithoutCancel(ctx))
//
// [ConcurrencyMiddleware] does that around a net/http handler: 429 (with
// Retry-After and the RateLimit headers, as [Middleware]) when no slot is
// free, the slot released when the handler returns or panics:
//
//	h := client.ConcurrencyMiddleware(c, func(r *http.Request) (client.Request, bool) {
//		return client.Request{Descriptor: map[string]string{"tenant": tenantOf(r), "destination": "search"}}, true
//	}, search, client.SlotTTL(30*time.Second))
//
// A [Meter] meters a stream whose units are produced as it runs (the
// tokens of a streamed answer): it reserves a chunk of units ahead, counts
// the stream's units against it, reserves the next chunk when one runs out
// (settling the full one), and settles what the last chunk used on Close.
// When a chunk is denied the stream stops cleanly: Add returns a
// *[ChunkDeniedError] (errors.Is [ErrChunkDenied]) and what was used is
// settled, exactly.
//
//	m, _ := client.NewMeter(c, d, 500, time.Minute) // chunks of 500 tokens
//	defer m.Close(context.WithoutCancel(ctx))
//	if err := m.Start(ctx); err != nil { /* denied before the first token */ }
//	for tok := range tokens {
//		if err := m.Add(ctx, 1); err != nil {
//			break // errors.Is(err, client.ErrChunkDenied): the budget is exhausted
//		}
//		send(tok)
//	}
//
// # Stability
//
// The API of this package (New, the Options, Decide, the DecideOptions,
// Result, the errors, Failure and Middleware; Reserve, Settle, Release,
// Renew, Acquire and Slot, ConcurrencyMiddleware and Meter) is stable: the
// node's integration tests and gateways use it. Additions are compatible.
package client
