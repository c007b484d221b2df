package service

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/limitmesh/limitmesh/internal/wire"
	"github.com/limitmesh/limitmesh/mesh/internal/fail"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/keys"
	"github.com/limitmesh/limitmesh/mesh/internal/ownership"
	"github.com/limitmesh/limitmesh/policies"
	"github.com/nats-io/nats.go/micro"
)

// The reservation endpoints (CONTRACT §10): reserve, settle, release and
// renew. A reservation call travels like a decide call (routed: decided by
// the owner of its key's partition, forwarded there otherwise, with
// OpHeader naming the endpoint on the shard subject) and is a keys.Call
// with a keys.ResOp, which the key's owner writes before the reply
// whatever the policy's mode. A settle, release or renew finds the key in
// the reservation id (keyrec.ParseReservationID).

// resKind is the endpoint of a routed call; 0 is decide.
type resKind uint8

const (
	opDecide resKind = iota
	opReserve
	opSettle
	opRelease
	opRenew
	// opHold is one layer's hold of a multi-layer decision (layers.go):
	// a reservation of the decide request's cost in the layer's policy
	// (PolicyHeader), short-lived, recorded as an admission when it is
	// committed and not at all when it is released.
	opHold
)

// PolicyHeader names, on a hold forwarded to a shard subject, the layer's
// policy the hold is for.
const PolicyHeader = "Limitmesh-Policy"

// ends reports whether k settles, releases or renews a reservation.
func (k resKind) ends() bool { return k == opSettle || k == opRelease || k == opRenew }

// OpHeader names, on a request forwarded to a shard subject, the
// reservation endpoint it came to ("reserve", "settle", "release",
// "renew"); absent for decide.
const OpHeader = "Limitmesh-Op"

var resKindNames = [...]string{"decide", "reserve", "settle", "release", "renew", "hold"}

func (k resKind) String() string { return resKindNames[k] }

func resKindOf(name string) resKind {
	for i, n := range resKindNames {
		if n == name {
			return resKind(i)
		}
	}
	return opDecide
}

// randomNonce draws a reservation's nonce from crypto/rand.
func randomNonce() uint64 {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return binary.LittleEndian.Uint64(b[:])
}

// errNotFound is the 404 of a settle, release or renew naming no open or
// remembered reservation.
var errNotFound = errors.New("not found")

// HandleReserve is the handler of the reserve endpoint.
func (s *Service) HandleReserve(r micro.Request) { s.handleRes(r, opReserve) }

// HandleSettle is the handler of the settle endpoint.
func (s *Service) HandleSettle(r micro.Request) { s.handleRes(r, opSettle) }

// HandleRelease is the handler of the release endpoint.
func (s *Service) HandleRelease(r micro.Request) { s.handleRes(r, opRelease) }

// HandleRenew is the handler of the renew endpoint.
func (s *Service) HandleRenew(r micro.Request) { s.handleRes(r, opRenew) }

// handleRes decodes a reservation request, resolves its policy and key and
// routes it like a decide request.
func (s *Service) handleRes(r micro.Request, kind resKind) {
	start := s.cfg.Runtime.Now()
	s.inflight.Add(1)
	handed := false
	defer func() {
		if v := recover(); v != nil {
			s.log.Error("panic in "+kind.String()+" handler", "panic", fmt.Sprint(v))
			if !handed {
				s.replyError(r, "", start, fmt.Errorf("%w: %v", fail.ErrInternal, v))
			}
		}
	}()
	caller, ok := s.callerOf(r, start)
	if !ok {
		return
	}
	rq := &routed{s: s, r: r, op: kind, start: start, deadline: start.Add(s.cfg.DecisionTimeout), noHint: caller != ""}
	var err error
	switch kind {
	case opReserve:
		err = s.resolveReserve(rq, caller)
	case opHold:
		err = s.resolveHold(rq, caller)
	default:
		err = s.resolveEnd(rq, caller)
	}
	if err != nil {
		policy := ""
		if rq.p != nil {
			policy = rq.p.Name
		}
		s.replyError(r, policy, start, err)
		return
	}
	if rq.p == nil {
		// A reserve no policy matches: not limited, nothing to hold.
		s.replyOK(r, start, keyrec.Decision{Allowed: true}, -1, nil)
		return
	}
	if s.cfg.Route != nil {
		rq.part = ownership.PartitionOf(rq.key, s.cfg.Route.Parts())
		rq.keyPart = rq.part
	}
	if h := r.Headers(); h != nil {
		rq.hopped = h.Get(HopHeader) != ""
		if ns, err := strconv.ParseInt(h.Get(TimeoutHeader), 10, 64); err == nil && ns > 0 && time.Duration(ns) < s.cfg.DecisionTimeout {
			rq.deadline = start.Add(time.Duration(ns))
		}
	}
	handed = true
	s.route(rq, start)
}

// resolveReserve decodes a reserve body into rq: its request, policy,
// limit key and ResOp. rq.p stays nil when no policy matches.
func (s *Service) resolveReserve(rq *routed, caller string) error {
	req, ttl, err := decodeReserve(rq.r.Data())
	if err != nil {
		return err
	}
	own, _ := req.desc.Get("tenant")
	if caller != "" {
		if req.desc, err = bindTenant(req.desc, caller, own); err != nil {
			return err
		}
	}
	rq.req = req
	snap := s.cfg.Policies.Snapshot()
	if snap.Layered() {
		if ps := snap.MatchLayers(req.desc, nil); len(ps) > 1 {
			return fmt.Errorf("%w: the descriptor meets %d layers (policies %s and more): a reservation across layers is not implemented yet", fail.ErrBadRequest, len(ps), ps[0].Name)
		}
	}
	p := snap.Match(req.desc)
	if p == nil {
		return nil
	}
	rq.p = p
	if p.Mode == policies.ModeLocal {
		return fmt.Errorf("%w: policy %q is local: reservations need a policy its keys' owners decide (strict, async or leased)", fail.ErrBadRequest, p.Name)
	}
	if rq.key, err = p.LimitKey(req.desc); err != nil {
		return fmt.Errorf("%w: %v", fail.ErrBadRequest, err)
	}
	if len(rq.key) > keyrec.MaxReservedKey {
		return fmt.Errorf("%w: the limit key is %d bytes; a reservation id names its key, so reserved keys are at most %d bytes (fewer or shorter key dimensions)",
			fail.ErrBadRequest, len(rq.key), keyrec.MaxReservedKey)
	}
	rq.res = keys.ResOp{Kind: keys.ResReserve, TTL: ttl, Nonce: s.cfg.Nonce() & (1<<keyrec.NonceBits - 1)}
	return nil
}

// resolveEnd decodes a settle, release or renew body into rq.
func (s *Service) resolveEnd(rq *routed, caller string) error {
	b, err := decodeResBody(rq.r.Data(), rq.op)
	if err != nil {
		return err
	}
	key, seq, nonce, ok := keyrec.ParseReservationID(b.id)
	if !ok {
		return fmt.Errorf("%w: reservation %q is not a reservation id", errNotFound, b.id)
	}
	name := keyrec.PolicyOfKey(key)
	p := s.cfg.Policies.Current(name)
	if p == nil || p.Shadow {
		return fmt.Errorf("%w: reservation %q: its policy %q is not in force", errNotFound, b.id, name)
	}
	rq.p, rq.key = p, key
	if caller != "" {
		// A tenant settles only its own keys' reservations.
		if d, ok := policies.DescriptorOfKey(key, p.Name); ok {
			if t, ok := d.Get("tenant"); ok && t != caller {
				return fmt.Errorf("%w: reservation of another tenant", fail.ErrForbidden)
			}
		}
	}
	kinds := map[resKind]keys.ResKind{opSettle: keys.ResSettle, opRelease: keys.ResRelease, opRenew: keys.ResRenew}
	rq.res = keys.ResOp{Kind: kinds[rq.op], Seq: seq, Nonce: nonce, Units: b.units, TTL: b.ttl}
	return nil
}

// finishRes sends the reply of reservation call c of rq.
func (s *Service) finishRes(c *keys.Call, rq *routed) {
	r := rq.r
	op := &rq.res
	name := rq.p.Name
	if c.Err == nil && op.NotFound {
		c.Err = fmt.Errorf("%w: reservation %s: unknown, or it expired", errNotFound, rq.idOf())
	}
	if c.Err != nil {
		if rq.op == opReserve && !c.DryRun {
			s.m.decision(name, resError)
		}
		s.replyError(r, name, rq.start, c.Err)
		return
	}
	s.m.reservationsEnded(name, op.Ended)
	s.open.track(s.m, name, rq.key, rq.part, op.Open, op.Next)
	if rq.op == opHold {
		// The coordinator counts the decision (layers.go); a layer
		// that denied records its denial under its own policy.
		if !c.Out.Allowed && !c.DryRun && !c.Deduped {
			s.record(rq, c)
		}
		s.replyRaw(r, rq.start, appendHoldReply(rq.buf[:0], c.Out, rq.idOf()))
		return
	}
	if rq.op != opReserve {
		s.replyRaw(r, rq.start, appendResReply(rq.buf[:0], rq.idOf(), &op.Res, c.Out, c.At, op.Again))
		return
	}
	switch {
	case c.Deduped:
		s.m.deduped.Inc()
	case c.DryRun:
	case c.Out.Allowed:
		s.m.decision(name, resAllowed)
	default:
		s.m.decision(name, resDenied)
		s.record(rq, c)
	}
	part := rq.keyPart
	if rq.noHint {
		part = -1
	}
	b := appendReply(rq.buf[:0], c.Out, part)
	if c.Out.Allowed && !c.DryRun && op.Res.Seq != 0 {
		b = b[:len(b)-1]
		b = append(b, `,"reservation":`...)
		b = wire.AppendString(b, rq.idOf())
		b = append(b, `,"expires_in_ms":`...)
		b = strconv.AppendInt(b, max(durationMillis(op.Res.Expires-c.At), 0), 10)
		b = append(b, '}')
	}
	s.replyRaw(r, rq.start, b)
}

// idOf returns the id of rq's reservation: a reserve's once admitted (or
// found again by its request_id), else the one the request names.
func (rq *routed) idOf() string {
	if rq.op == opReserve || rq.op == opHold {
		return keyrec.ReservationID(rq.key, rq.res.Res.Seq, rq.res.Res.Nonce)
	}
	return keyrec.ReservationID(rq.key, rq.res.Seq, rq.res.Nonce)
}

// appendResReply appends the reply of a settle, release or renew: the
// reservation as the call left it (its first ending when again), and the
// key's remaining units after it.
func appendResReply(b []byte, id string, v *keyrec.Reservation, d keyrec.Decision, now int64, again bool) []byte {
	outcome := v.Outcome.String()
	if v.Outcome == keyrec.Open {
		outcome = "renewed"
	}
	b = append(b, `{"reservation":`...)
	b = wire.AppendString(b, id)
	b = append(b, `,"outcome":`...)
	b = wire.AppendString(b, outcome)
	b = append(b, `,"settled":`...)
	b = AppendMicro(b, v.Settled)
	b = append(b, `,"returned":`...)
	b = AppendMicro(b, v.Returned)
	b = append(b, `,"remaining":`...)
	b = AppendMicro(b, max(d.Remaining, 0))
	b = append(b, `,"policy":`...)
	b = wire.AppendString(b, d.Policy)
	b = append(b, `,"revision":`...)
	b = strconv.AppendUint(b, d.Revision, 10)
	if v.Outcome == keyrec.Open {
		b = append(b, `,"expires_in_ms":`...)
		b = strconv.AppendInt(b, max(durationMillis(v.Expires-now), 0), 10)
	}
	if again {
		b = append(b, `,"again":true`...)
	}
	return append(b, '}')
}
