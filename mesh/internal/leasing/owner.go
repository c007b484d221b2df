package leasing

import (
	"errors"
	"strings"

	"github.com/limitmesh/limitmesh/mesh/internal/fail"
	"github.com/limitmesh/limitmesh/mesh/internal/keys"
	"github.com/limitmesh/limitmesh/mesh/internal/lease"
	"github.com/limitmesh/limitmesh/mesh/internal/ownership"
	"github.com/nats-io/nats.go"
)

// The owner side: a holder node's acquire, report or return of a key's
// grant arrives on the owner subject of the key's partition, which only
// the partition's owner subscribes to. It becomes a Call with a LeaseOp
// submitted to the key's owner core, answered once the record is written.

// ownerCall is one request from a holder node in the key's owner core.
type ownerCall struct {
	l    *Leasing
	m    *nats.Msg
	op   string
	c    keys.Call
	lop  keys.LeaseOp
	part int
}

// HandleOwner answers a request on an owner subject.
func (l *Leasing) HandleOwner(m *nats.Msg) {
	var req ownerRequest
	if err := decode(m.Data, &req); err != nil {
		respond(m, reply{Result: resBadRequest, Message: err.Error()})
		return
	}
	p := l.cfg.Policies.Current(req.Policy)
	if p == nil || (req.Key != "p."+p.Name && !strings.HasPrefix(req.Key, "p."+p.Name+".")) {
		if req.Op == opAcquire {
			l.m.grants.WithLabelValues(resNotLeased).Inc()
		}
		respond(m, reply{Result: resNotLeased})
		return
	}
	part := ownership.PartitionOf(req.Key, l.cfg.Route.Parts())
	slot := l.cfg.Route.Slot(part)
	slot.Inflight.Add(1)
	now := l.cfg.Runtime.Now()
	if !l.cfg.Route.ServingAt(part, l.cfg.Route.MonoAt(now)) {
		slot.Inflight.Add(-1)
		respond(m, reply{Result: resNotOwner})
		return
	}
	oc := &ownerCall{l: l, m: m, op: req.Op, part: part}
	oc.lop.Epoch = l.cfg.Route.EpochOf(part)
	switch req.Op {
	case opAcquire:
		oc.lop.Acquire = &lease.AcquireReq{Holder: req.Holder, Want: req.Want, Min: req.Min}
	default:
		oc.lop.Report = &lease.ReportReq{ID: req.Grant, Epoch: req.Epoch, Spent: req.Spent, Return: req.Op == opReturn}
	}
	oc.c = keys.Call{Policy: p, Cost: 1, Deadline: now.UnixNano() + int64(l.cfg.Timeout), Done: oc, Lease: &oc.lop}
	l.cfg.Keys.Submit(req.Key, &oc.c, now.UnixNano(), nil)
}

// Finish implements keys.Finisher: the record is written (or the call
// failed); answer the holder.
func (oc *ownerCall) Finish(c *keys.Call) {
	l := oc.l
	defer l.cfg.Route.Slot(oc.part).Inflight.Add(-1)
	switch {
	case errors.Is(c.Err, fail.ErrFenced):
		respond(oc.m, reply{Result: resNotOwner})
		return
	case c.Err != nil:
		respond(oc.m, reply{Result: resUnavail, Message: c.Err.Error()})
		return
	}
	r := reply{Policy: c.Out.Policy, Revision: c.Out.Revision}
	op := oc.lop
	if op.Acquire != nil {
		switch {
		case op.Refused != nil:
			r.Result = resNotLeased
		default:
			a := op.Acquired
			r.Remaining, r.RetryAfter = a.Remaining, a.RetryAfter
			switch a.Outcome {
			case lease.Granted:
				r.Result = resGranted
				r.Grant, r.Epoch, r.Units, r.TTL = a.Grant.ID, a.Grant.Epoch, a.Grant.Units, a.Grant.Expires-a.Grant.At
			case lease.Full:
				r.Result = resFull
			default:
				r.Result = resExhausted
			}
		}
		l.m.grants.WithLabelValues(r.Result).Inc()
		respond(oc.m, r)
		return
	}
	switch {
	case op.Refused == nil:
		r.Result, r.Refunded = resOK, op.Refunded
	case errors.Is(op.Refused, lease.ErrStaleEpoch):
		r.Result = resStale
	case errors.Is(op.Refused, lease.ErrBadSpend):
		r.Result = resBadSpend
	default:
		r.Result = resUnknown
	}
	l.m.reports.WithLabelValues(oc.op, r.Result).Inc()
	respond(oc.m, r)
}

func respond(m *nats.Msg, r reply) {
	if m.Reply == "" {
		return
	}
	_ = m.Respond(encode(r))
}
