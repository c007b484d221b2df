package service

import (
	"encoding/json"
	"errors"
	"strconv"
	"time"

	"github.com/limitmesh/limitmesh/auth"
	"github.com/limitmesh/limitmesh/mesh/internal/fail"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
)

// Forwarding: a decide request is decided by the owner of its limit key's
// partition. The node that receives it on <prefix>.v1.decide decides it
// itself when it serves the partition and otherwise forwards the request
// bytes to <prefix>.v1.shard.<n>, which only the owner subscribes to, and
// relays the reply verbatim (docs/protocol.md, "Routing").

// Headers of the routing protocol.
const (
	// HopHeader marks a forwarded request; a node never forwards it again.
	HopHeader = "Limitmesh-Hop"
	// TimeoutHeader carries the forwarder's remaining decision time (ns).
	TimeoutHeader = "Limitmesh-Timeout"
	// NotOwnerHeader is set (to the partition) on the 503 of a node that
	// got a forwarded request for a partition it does not serve; the
	// forwarder retries.
	NotOwnerHeader = "Limitmesh-Not-Owner"
	// OverflowHeader marks a forwarded request to be decided against its
	// policy's overflow key (its own key is new beyond max_keys at its
	// owner, which forwards it to the overflow key's owner). Only
	// honoured on shard subjects, with HopHeader.
	OverflowHeader = "Limitmesh-Overflow"
)

// forwardRetry is the pause between attempts while a partition has no
// reachable owner (handoff, dead owner before its lease ran out).
const forwardRetry = 3 * time.Millisecond

// forward hands a request for a partition this node does not serve to its
// owner, within the decision deadline, and relays the reply. hopped is
// true for a request that was already forwarded once: it is not forwarded
// again; the node waits for the partition to come to it, else answers 503
// with NotOwnerHeader so the first forwarder retries. It never blocks:
// each attempt continues in the Requester's callback or a timer of the
// Runtime, and rq.r is answered exactly once.
func (s *Service) forward(rq *routed) {
	now := s.cfg.Runtime.Now()
	if s.cfg.Route.Serving(rq.part) {
		s.route(rq, now)
		return
	}
	left := rq.deadline.Sub(now)
	if left <= 0 || s.requests == nil {
		s.unavailable(rq)
		return
	}
	if rq.hopped {
		// Wait briefly for a move to settle here; the forwarder
		// retries elsewhere after our 503.
		if now.Sub(rq.start) > 4*forwardRetry {
			s.m.forwarded.WithLabelValues("not_owner").Inc()
			s.replyError(rq.r, rq.p.Name, rq.start, errNotOwner, micro.WithHeaders(micro.Headers{NotOwnerHeader: []string{strconv.Itoa(rq.part)}}))
			return
		}
		s.forwardLater(rq)
		return
	}
	r := rq.r
	m := nats.NewMsg(s.cfg.Route.Subject(rq.part))
	m.Data = r.Data()
	m.Header.Set(HopHeader, "1")
	m.Header.Set(TimeoutHeader, strconv.FormatInt(int64(left), 10))
	if rq.overflow {
		m.Header.Set(OverflowHeader, "1")
	}
	if rq.op != opDecide {
		m.Header.Set(OpHeader, rq.op.String())
	}
	if rq.op == opHold {
		m.Header.Set(PolicyHeader, rq.p.Name)
	}
	if info := r.Headers()[auth.RequestInfoHeader]; len(info) > 0 {
		// The owner binds the tenant again: only nodes (the limiter
		// account) publish on shard subjects, so it trusts the header.
		m.Header[auth.RequestInfoHeader] = info
	}
	s.requests.Request(m, rq.deadline, func(resp *nats.Msg, err error) { s.forwarded(rq, resp, err) })
}

// forwarded handles the owner's reply resp (or the failure err) to a
// forward of rq: it relays the reply, or tries again within the deadline.
func (s *Service) forwarded(rq *routed, resp *nats.Msg, err error) {
	switch {
	case err == nil && resp.Header.Get(NotOwnerHeader) == "":
		s.m.forwarded.WithLabelValues("ok").Inc()
		if rerr := rq.r.Respond(resp.Data, micro.WithHeaders(micro.Headers(resp.Header))); rerr != nil {
			s.log.Debug("relaying a reply failed", "error", rerr.Error())
		}
		s.m.duration.Observe(s.cfg.Runtime.Now().Sub(rq.start).Seconds())
		s.inflight.Add(-1)
	case err == nil, errors.Is(err, nats.ErrNoResponders):
		// Not owned there (yet): retry within the deadline.
		s.m.forwarded.WithLabelValues("retry").Inc()
		s.forwardLater(rq)
	case rq.deadline.Sub(s.cfg.Runtime.Now()) > forwardRetry:
		// Timed out or the connection failed, with time left.
		s.forwardLater(rq)
	default:
		s.unavailable(rq)
	}
}

// forwardLater forwards rq again after forwardRetry.
func (s *Service) forwardLater(rq *routed) {
	s.cfg.Runtime.AfterFunc(forwardRetry, func() { s.forward(rq) })
}

// unavailable answers rq 503: no owner of its partition answered in time.
func (s *Service) unavailable(rq *routed) {
	s.m.forwarded.WithLabelValues("unavailable").Inc()
	s.replyError(rq.r, rq.p.Name, rq.start, errNoOwner)
}

// errNoOwner and errNotOwner are the 503 causes of routing.
var (
	errNoOwner  = wrapUnavailable("no owner of the key's partition answered before the decision deadline")
	errNotOwner = wrapUnavailable("forwarded to a node that does not own the partition")
)

func wrapUnavailable(msg string) error { return &routeError{msg: msg} }

type routeError struct{ msg string }

func (e *routeError) Error() string { return "mesh: unavailable: " + e.msg }
func (e *routeError) Unwrap() error { return fail.ErrUnavailable }

// msgRequest is a micro.Request over a plain subscription's message (the
// shard subjects are plain subscriptions, not micro endpoints).
type msgRequest struct{ m *nats.Msg }

func (q msgRequest) Respond(b []byte, opts ...micro.RespondOpt) error {
	resp := &nats.Msg{Data: b}
	for _, o := range opts {
		o(resp)
	}
	return q.m.RespondMsg(resp)
}

func (q msgRequest) RespondJSON(v any, opts ...micro.RespondOpt) error {
	b, err := json.Marshal(v)
	if err != nil {
		return micro.ErrMarshalResponse
	}
	return q.Respond(b, opts...)
}

func (q msgRequest) Error(code, desc string, data []byte, opts ...micro.RespondOpt) error {
	resp := &nats.Msg{Header: nats.Header{micro.ErrorHeader: {desc}, micro.ErrorCodeHeader: {code}}}
	for _, o := range opts {
		o(resp)
	}
	resp.Data = data
	return q.m.RespondMsg(resp)
}

func (q msgRequest) Data() []byte           { return q.m.Data }
func (q msgRequest) Headers() micro.Headers { return micro.Headers(q.m.Header) }
func (q msgRequest) Subject() string        { return q.m.Subject }
func (q msgRequest) Reply() string          { return q.m.Reply }
