// Package service is the decide endpoint: it decodes a decide request,
// finds the policy in force and the limit key, and routes the call to the
// key's owner on this node (keys) when this node serves the key's
// partition, or forwards it to the partition's owner (forward.go); it
// sends the reply. It also remembers recent request bodies (memo.go).
//
// service imports policies, kvstate, keyrec, keys, route, policyset, fail
// and rt; the node (package mesh) wires it to the micro service and the
// shard subjects.
package service

import (
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/limitmesh/limitmesh/auth"
	"github.com/limitmesh/limitmesh/mesh/internal/fail"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/keys"
	"github.com/limitmesh/limitmesh/mesh/internal/ownership"
	"github.com/limitmesh/limitmesh/mesh/internal/policyset"
	"github.com/limitmesh/limitmesh/mesh/internal/route"
	"github.com/limitmesh/limitmesh/mesh/internal/rt"
	"github.com/limitmesh/limitmesh/policies"
	"github.com/limitmesh/limitmesh/usage"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
)

// Config configures a Service.
type Config struct {
	// Conn sends replies; nil: through the request's Respond (offline
	// tests, the simulation).
	Conn *nats.Conn
	// Requests forwards requests to partition owners; nil: over Conn
	// (nothing is forwarded without either).
	Requests rt.Requester
	// Nonce draws a reservation's nonce; nil: crypto/rand. (The
	// simulation draws from its seed.)
	Nonce    func() uint64
	Policies *policyset.Set
	Keys     *keys.Table
	// Route is the routing table; nil: every key is decided here.
	Route           *route.Table
	Runtime         rt.Runtime
	DecisionTimeout time.Duration
	// Binder binds a request's tenant to its calling account (CONTRACT
	// §9); nil: unsecured, the Nats-Request-Info header is ignored.
	Binder *auth.Binder
	// Usage publishes the usage records (CONTRACT §6) of the decisions the
	// key owners' store does not (denials, local and unmatched decisions);
	// nil: none, and the calls carry no descriptor for the store's.
	Usage UsageSink
	// Leases decides requests of leased policies from this node's grants
	// (CONTRACT §8); nil: their owners decide them all (strict).
	Leases Leaser
	// Prefix is the subject prefix (error messages name the reserve
	// subject); "" is "rl".
	Prefix  string
	Log     *slog.Logger
	Metrics *Metrics
}

// UsageSink takes the usage records the service publishes
// (usage.Publisher).
type UsageSink interface {
	Add(policy string, r usage.Record) bool
}

// Leaser spends a node's grants of leased keys (package leasing).
type Leaser interface {
	// Spend decides a request of cost micro-units of leased policy p for
	// key (in partition part) at now from this node's grants; false when
	// it cannot (the key's owner decides).
	Spend(p *policies.Policy, key string, part int, cost int64, now time.Time) (keyrec.Decision, bool)
}

// Service answers decide requests. Its methods are safe for concurrent use.
type Service struct {
	cfg      Config
	requests rt.Requester // nil: nothing is forwarded
	log      *slog.Logger
	m        *Metrics
	memo     reqMemo
	routed   sync.Pool // *routed values, recycled once answered
	inflight atomic.Int64
	// open tracks the keys with open reservations this node owns
	// (reserve_sweep.go).
	open openKeys
}

// New returns a service.
func New(cfg Config) *Service {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Nonce == nil {
		cfg.Nonce = randomNonce
	}
	s := &Service{cfg: cfg, requests: cfg.Requests, log: cfg.Log, m: cfg.Metrics}
	if s.requests == nil && cfg.Conn != nil {
		s.requests = rt.NATS(cfg.Conn)
	}
	return s
}

// Inflight returns the number of requests received and not yet answered.
func (s *Service) Inflight() int64 { return s.inflight.Load() }

// HandleMsg handles a request that came on a plain subscription (a shard
// subject).
func (s *Service) HandleMsg(m *nats.Msg) { s.HandleShard(msgRequest{m}) }

// HandleShard handles a request another node forwarded to this one (on
// a shard subject): a decide request, or the reservation call OpHeader
// names.
func (s *Service) HandleShard(r micro.Request) {
	if op := r.Headers().Get(OpHeader); op != "" {
		if k := resKindOf(op); k != opDecide {
			s.handleRes(r, k)
			return
		}
	}
	s.handle(r, true)
}

// routed is a decide request on its way to the owner of its key. It
// carries the call the owner decides, the partition slot that counts it in
// flight and the reply's buffer, and is recycled once answered (one per
// decision, they were the largest part of a node's garbage).
type routed struct {
	s        *Service
	r        micro.Request
	req      request
	p        *policies.Policy
	key      string
	hint     *atomic.Pointer[keys.Entry] // the key's entry, cached (keys.Table.Submit)
	part     int
	start    time.Time // when this node received it
	deadline time.Time // decision deadline on this node
	hopped   bool      // it was forwarded to this node (never forward again)
	noHint   bool      // the reply carries no partition hint (a tenant caller may not use shard subjects)
	// overflow: the call is decided against its policy's overflow key
	// (key and part are that key's); keyPart is the partition of the
	// request's own limit key, the reply's partition hint.
	overflow bool
	keyPart  int
	// op is the endpoint the request came to (opDecide or a reservation
	// endpoint), and res a reservation call's operation (reserve.go).
	op  resKind
	res keys.ResOp

	c    keys.Call   // the call being decided (submit)
	slot *route.Slot // counts c in flight in its partition; nil: not counted
	buf  [replyBufSize]byte
}

// replyBufSize holds a usual decision reply without allocating.
const replyBufSize = 208

// Handle is the handler of the decide endpoint. It validates the request,
// resolves the policy and the limit key, and routes the call. The reply is
// sent when the call finishes. It never blocks on I/O and never panics: a
// panic is answered with a 500.
func (s *Service) Handle(r micro.Request) { s.handle(r, false) }

// handle is Handle; shard: r came on a shard subject, from another node.
func (s *Service) handle(r micro.Request, shard bool) {
	start := s.cfg.Runtime.Now()
	s.inflight.Add(1)
	handed := false
	defer func() {
		if v := recover(); v != nil {
			s.log.Error("panic in decide handler", "panic", fmt.Sprint(v))
			if !handed {
				s.replyError(r, "", start, fmt.Errorf("%w: %v", fail.ErrInternal, v))
			}
		}
	}()
	caller, ok := s.callerOf(r, start)
	if !ok {
		return
	}
	snap := s.cfg.Policies.Snapshot()
	var (
		req  request
		p    *policies.Policy
		key  string
		part = -1
		hint *atomic.Pointer[keys.Entry]
	)
	var layered []*policies.Policy // several layers matched (layers.go)
	if m := s.memo.get(r.Data(), snap); m != nil && (caller == "" || m.tenant == caller) {
		req, p, key, part, hint = m.req, m.p, m.key, m.part, &m.ent
	} else {
		var err error
		if req, err = decodeRequest(r.Data()); err != nil {
			s.replyError(r, "", start, err)
			return
		}
		own, _ := req.desc.Get("tenant")
		if caller != "" {
			if req.desc, err = bindTenant(req.desc, caller, own); err != nil {
				s.replyError(r, "", start, err)
				return
			}
		}
		if snap.Layered() {
			if ps := snap.MatchLayers(req.desc, nil); len(ps) > 1 {
				layered = ps
			}
		}
		if layered != nil {
			p = nil
		} else if p = snap.Match(req.desc); p == nil {
			if !req.dryRun {
				s.m.decision("", resAllowed)
				if u := s.cfg.Usage; u != nil {
					u.Add("", usage.Record{TimeUs: start.UnixMicro(), Descriptor: req.desc, Cost: req.cost,
						Allowed: true, RequestID: req.id})
				}
			}
			s.replyOK(r, start, keyrec.Decision{Allowed: true}, -1, nil)
			return
		}
		if layered != nil {
			handed = true
			s.decideLayers(r, req, layered, start, caller)
			return
		}
		if key, err = p.LimitKey(req.desc); err != nil {
			if !req.dryRun {
				s.m.decision(p.Name, resError)
			}
			s.replyError(r, p.Name, start, fmt.Errorf("%w: %v", fail.ErrBadRequest, err))
			return
		}
		if s.cfg.Route != nil {
			part = ownership.PartitionOf(key, s.cfg.Route.Parts())
		}
		// A body is remembered only as it decoded: not with a tenant the
		// binding added (another caller may send the same body).
		if own == caller || caller == "" {
			if m := s.memo.put(r.Data(), snap, req, p, key, part, own); m != nil {
				hint = &m.ent
			}
		}
	}
	if p.ReservedOnly() {
		if !req.dryRun {
			s.m.decision(p.Name, resError)
		}
		s.replyError(r, p.Name, start, fmt.Errorf("%w: policy %q has a concurrency limit: its units are held until released, so it is reserved with %s.v1.reserve, not decided",
			fail.ErrBadRequest, p.Name, s.prefix()))
		return
	}
	rq, _ := s.routed.Get().(*routed)
	if rq == nil {
		rq = new(routed)
	}
	*rq = routed{s: s, r: r, req: req, p: p, key: key, part: part, keyPart: part, hint: hint, start: start,
		deadline: start.Add(s.cfg.DecisionTimeout), noHint: caller != ""}
	if h := r.Headers(); h != nil {
		rq.hopped = h.Get(HopHeader) != ""
		if ns, err := strconv.ParseInt(h.Get(TimeoutHeader), 10, 64); err == nil && ns > 0 && time.Duration(ns) < s.cfg.DecisionTimeout {
			rq.deadline = start.Add(time.Duration(ns))
		}
		if shard && rq.hopped && h.Get(OverflowHeader) != "" {
			// The owner of the request's key sent it to the overflow
			// key's owner (only nodes publish on shard subjects).
			s.toOverflow(rq)
		}
	}
	handed = true
	s.route(rq, start)
}

// callerOf returns, in a secured deployment, the tenant of the account r
// came from ("" when unsecured). When that cannot be told it answers r
// with the error and reports false.
func (s *Service) callerOf(r micro.Request, start time.Time) (string, bool) {
	if s.cfg.Binder == nil {
		return "", true
	}
	c, err := s.cfg.Binder.Caller(r.Headers()[auth.RequestInfoHeader])
	if err != nil {
		s.replyError(r, "", start, err)
		return "", false
	}
	return c, true
}

// route decides rq here when this node serves its partition (or the
// policy is local), and forwards it otherwise. now is the current time
// (one clock read serves the whole path).
func (s *Service) route(rq *routed, now time.Time) {
	// A leased key's request is spent from this node's grant when it
	// can be: not a dry run, no request_id (dedupe is the owner's), not
	// already forwarded (a forwarded one is the strict fallback).
	if rq.p.Mode == policies.ModeLeased && rq.op == opDecide && s.cfg.Leases != nil && !rq.hopped && !rq.req.dryRun && rq.req.id == "" {
		if d, ok := s.cfg.Leases.Spend(rq.p, rq.key, rq.part, rq.req.cost, now); ok {
			s.leased(rq, d, now)
			return
		}
	}
	rt := s.cfg.Route
	if rt == nil || rq.part < 0 || rq.p.Mode == policies.ModeLocal {
		s.submit(rq, nil, now)
		return
	}
	slot := rt.Slot(rq.part)
	slot.Inflight.Add(1)
	if rt.ServingAt(rq.part, rt.MonoAt(now)) {
		s.submit(rq, slot, now)
		return
	}
	slot.Inflight.Add(-1)
	s.forward(rq)
}

// submit hands rq to its key's owner on this node. slot, when not nil,
// counts the call as in flight in its partition until it finishes.
func (s *Service) submit(rq *routed, slot *route.Slot, at time.Time) {
	now := at.UnixNano()
	// A call is submitted again only after its previous submission
	// finished (fenced: Finish forwards it), so rq.c is free.
	rq.c = keys.Call{
		Policy:   rq.p,
		Cost:     rq.req.cost,
		DryRun:   rq.req.dryRun,
		Deadline: now + int64(rq.deadline.Sub(at)),
		Done:     rq,
	}
	if s.cfg.Usage != nil {
		rq.c.Desc, rq.c.RequestID = rq.req.desc, rq.req.id
	}
	if rq.req.id != "" {
		rq.c.ID, rq.c.HasID = keyrec.IDHash(rq.req.id), true
	}
	rq.c.Overflow = rq.overflow
	if rq.op != opDecide {
		rq.res.Key = rq.key
		rq.c.Res = &rq.res
		rq.c.Desc, rq.c.RequestID = rq.req.desc, rq.req.id // kept with a reservation, for its usage
	}
	rq.slot = slot
	s.cfg.Keys.Submit(rq.key, &rq.c, now, rq.hint)
}

// Finish implements keys.Finisher: it sends the reply, or forwards rq when
// this node lost the partition while deciding.
func (rq *routed) Finish(c *keys.Call) {
	s := rq.s
	if rq.slot != nil {
		rq.slot.Inflight.Add(-1)
	}
	if errors.Is(c.Err, fail.ErrFenced) && rq.slot != nil && rq.deadline.Sub(s.cfg.Runtime.Now()) > 0 {
		// Nothing was written: this node lost the partition while
		// deciding. The new owner decides (not under the owner's
		// locks, which may hold this call).
		s.cfg.Runtime.Go(func() { s.forward(rq) })
		return
	}
	if c.Overflowed && rq.op.ends() {
		// A settle, release or renew of a key stored nowhere (its
		// record expired): nothing to end.
		c.Overflowed, c.Err = false, fmt.Errorf("%w: reservation %s: unknown, or it expired", errNotFound, rq.idOf())
	}
	if c.Overflowed && !rq.overflow {
		// The key is new beyond its policy's max_keys here: the
		// policy's overflow key decides, wherever it is owned.
		if !c.DryRun {
			s.m.overflowed(rq.p.Name)
		}
		s.toOverflow(rq)
		rq.hopped = false // this node forwards it, if it must
		s.route(rq, s.cfg.Runtime.Now())
		return
	}
	if rq.op != opDecide {
		s.finishRes(c, rq)
		return // not pooled: reservation calls are not from the pool
	}
	s.finish(c, rq)
	// Answered: nothing refers to rq any more (the owner handed c out,
	// the reply was copied out), so the next request may reuse it. A
	// forwarded rq is left to the garbage collector.
	*rq = routed{}
	s.routed.Put(rq)
}

// finish sends the reply of rq's call c, which the owner finished.
func (s *Service) finish(c *keys.Call, rq *routed) {
	r := rq.r
	if c.Err != nil {
		if !c.DryRun {
			s.m.decision(c.Policy.Name, resError)
		}
		s.replyError(r, c.Policy.Name, rq.start, c.Err)
		return
	}
	switch {
	case c.Deduped:
		s.m.deduped.Inc()
	case c.DryRun:
	case c.Out.Allowed:
		s.m.decision(c.Out.Policy, resAllowed)
		if c.Mode() == policies.ModeLocal {
			s.record(rq, c)
		}
		// Otherwise the store publishes it, durably, with the record
		// write that spends it.
	default:
		s.m.decision(c.Out.Policy, resDenied)
		s.record(rq, c)
	}
	part := rq.keyPart
	if rq.p.Mode == policies.ModeLocal || rq.p.Mode == policies.ModeLeased || rq.noHint {
		// Any node decides a local key, and a leased one first from its
		// own grants; a tenant may not use shard subjects.
		part = -1
	}
	s.replyOK(r, rq.start, c.Out, part, rq.buf[:0])
}

// replyOK sends a decision, encoded into buf (the reply is copied out
// before it returns); part is the limit key's partition (the reply's
// "partition" hint), or -1.
func (s *Service) replyOK(r micro.Request, start time.Time, d keyrec.Decision, part int, buf []byte) {
	s.replyRaw(r, start, appendReply(buf, d, part))
}

// replyRaw sends the reply body b of a request received at start.
func (s *Service) replyRaw(r micro.Request, start time.Time, b []byte) {
	if err := s.respond(r, b); err != nil {
		s.log.Debug("reply failed", "error", err.Error())
	}
	s.m.duration.Observe(s.cfg.Runtime.Now().Sub(start).Seconds())
	s.inflight.Add(-1)
}

// respond publishes a decision reply to r's reply subject. It is
// r.Respond without the message value Respond allocates for every reply:
// a decision reply has no headers, and the micro endpoint counts a request
// whether or not its handler used Respond. Without a connection (offline
// tests) it uses r.Respond.
func (s *Service) respond(r micro.Request, data []byte) error {
	if s.cfg.Conn == nil {
		return r.Respond(data)
	}
	reply := r.Reply()
	if reply == "" {
		// A layer's sub-call (layers.go) answers in process; a request
		// without a reply subject gets nats.ErrMsgNoReply there.
		return r.Respond(data)
	}
	return s.cfg.Conn.Publish(reply, data)
}

// replyError answers with a micro error: code, description and the JSON
// body {"error": symbol, "message": text} (CONTRACT.md §2).
func (s *Service) replyError(r micro.Request, policy string, start time.Time, err error, opts ...micro.RespondOpt) {
	code, symbol, sentinel := classify(err)
	// The symbol already says what the sentinel says: the message is the
	// rest ("descriptor.plan: missing; …", not "mesh: bad request: …").
	msg := strings.TrimPrefix(err.Error(), sentinel.Error()+": ")
	if rerr := r.Error(code, msg, errorBody(symbol, msg), opts...); rerr != nil {
		s.log.Debug("error reply failed", "error", rerr.Error())
	}
	s.m.errors.WithLabelValues(code).Inc()
	if code == "500" {
		s.log.Error("decide failed", "policy", policy, "error", msg)
	}
	s.m.duration.Observe(s.cfg.Runtime.Now().Sub(start).Seconds())
	s.inflight.Add(-1)
}

// prefix returns the subject prefix.
func (s *Service) prefix() string {
	if s.cfg.Prefix == "" {
		return "rl"
	}
	return s.cfg.Prefix
}

// classify returns the micro error code, symbol and sentinel of err
// (CONTRACT.md §2, §10): the one mapping of errors to answers.
func classify(err error) (code, symbol string, sentinel error) {
	switch {
	case errors.Is(err, fail.ErrTooLarge):
		return "413", "too_large", fail.ErrTooLarge
	case errors.Is(err, fail.ErrBadRequest), errors.Is(err, policies.ErrInvalid):
		return "400", "bad_request", fail.ErrBadRequest
	case errors.Is(err, fail.ErrForbidden):
		return "403", "forbidden", fail.ErrForbidden
	case errors.Is(err, auth.ErrForbidden):
		return "403", "forbidden", auth.ErrForbidden
	case errors.Is(err, auth.ErrLookup):
		return "503", "unavailable", auth.ErrLookup
	case errors.Is(err, fail.ErrUnavailable), errors.Is(err, fail.ErrFenced):
		return "503", "unavailable", fail.ErrUnavailable
	case errors.Is(err, errNotFound):
		return "404", "not_found", errNotFound
	}
	return "500", "internal", fail.ErrInternal
}

// toOverflow makes rq a call for its policy's overflow key (CONTRACT.md
// §9): the key, its partition, and no entry hint (the memo's is the
// request's own key's).
func (s *Service) toOverflow(rq *routed) {
	rq.overflow = true
	rq.key = rq.p.OverflowKey()
	rq.hint = nil
	if s.cfg.Route != nil {
		rq.part = ownership.PartitionOf(rq.key, s.cfg.Route.Parts())
	}
}

// bindTenant applies the binding of a tenant caller's request (own: the
// descriptor's tenant, "" when it has none): a descriptor naming another
// tenant is refused (auth.ErrForbidden, a 403), one without a tenant gets
// the caller's.
func bindTenant(d policies.Descriptor, caller, own string) (policies.Descriptor, error) {
	t, err := auth.BindTenant(caller, own)
	if err != nil || own != "" {
		return d, err
	}
	dims := append(make([]policies.Dim, 0, len(d)+1), d...)
	dims = append(dims, policies.Dim{Name: "tenant", Value: t})
	nd, err := policies.NewDescriptor(dims)
	if err != nil {
		return d, fmt.Errorf("%w: %v", fail.ErrBadRequest, err)
	}
	return nd, nil
}

// leased answers rq with d, decided from this node's grants at now.
func (s *Service) leased(rq *routed, d keyrec.Decision, now time.Time) {
	res := resDenied
	if d.Allowed {
		res = resAllowed
	}
	s.m.decision(d.Policy, res)
	if u := s.cfg.Usage; u != nil {
		u.Add(d.Policy, usage.Record{TimeUs: now.UnixMicro(), Revision: d.Revision, Key: rq.key,
			Descriptor: rq.req.desc, Cost: rq.req.cost, Allowed: d.Allowed})
	}
	s.replyOK(rq.r, rq.start, d, -1, rq.buf[:0])
	*rq = routed{}
	s.routed.Put(rq)
}

// record publishes the usage record of call c of rq.
func (s *Service) record(rq *routed, c *keys.Call) {
	u := s.cfg.Usage
	if u == nil {
		return
	}
	u.Add(c.Out.Policy, usage.Record{TimeUs: c.At / 1000, Revision: c.Out.Revision, Key: rq.key,
		Descriptor: rq.req.desc, Cost: c.Cost, Allowed: c.Out.Allowed, RequestID: rq.req.id})
}
