package leasing

import (
	"errors"
	"strings"
	"time"

	"github.com/limitmesh/limitmesh/mesh/internal/fail"
	"github.com/limitmesh/limitmesh/mesh/internal/keys"
	"github.com/limitmesh/limitmesh/mesh/internal/lease"
	"github.com/limitmesh/limitmesh/mesh/internal/ownership"
	"github.com/limitmesh/limitmesh/mesh/internal/policyset"
	"github.com/limitmesh/limitmesh/mesh/internal/route"
	"github.com/limitmesh/limitmesh/mesh/internal/rt"
	"github.com/limitmesh/limitmesh/policies"
	"github.com/nats-io/nats.go"
)

// Owner is a node's owner side of leased mode: a holder node's acquire,
// report or return of a key's grant arrives on the owner subject of the
// key's partition, which only the partition's owner subscribes to. It
// becomes a Call with a LeaseOp submitted to the key's owner core,
// answered once the record is written (the rules, L1-L4 of
// docs/protocol.md, are package lease's, applied by the owner core). Its
// methods are safe for concurrent use.
type Owner struct {
	policies *policyset.Set
	keys     *keys.Table
	route    *route.Table
	rt       rt.Runtime
	timeout  time.Duration
	m        *metrics
}

func newOwner(cfg Config, m *metrics) *Owner {
	return &Owner{policies: cfg.Policies, keys: cfg.Keys, route: cfg.Route, rt: cfg.Runtime, timeout: cfg.Timeout,
		m: m}
}

// ownerCall is one request from a holder node in the key's owner core.
type ownerCall struct {
	o    *Owner
	r    Request
	key  string
	op   string
	c    keys.Call
	lop  keys.LeaseOp
	part int
}

// HandleOwner answers a request on an owner subject (ServeOwner).
func (o *Owner) HandleOwner(m *nats.Msg) { o.ServeOwner(msgRequest{m}) }

// ServeOwner answers a holder node's request r to this node as the
// owner of the key it names: at once when it cannot be applied here (a
// bad request, a key of no leased policy, a partition this node does not
// serve: not_owner), else once the key's owner core has applied it and
// written the record (Finish). It never blocks.
func (o *Owner) ServeOwner(r Request) {
	var req ownerRequest
	if err := decode(r.Data(), &req); err != nil {
		respond(r, reply{Result: resBadRequest, Message: err.Error()})
		return
	}
	p := o.policies.Current(req.Policy)
	if !policyKey(p, req.Key) {
		if req.Op == opAcquire {
			o.m.grants.WithLabelValues(resNotLeased).Inc()
		}
		respond(r, reply{Result: resNotLeased})
		return
	}
	part := ownership.PartitionOf(req.Key, o.route.Parts())
	slot := o.route.Slot(part)
	slot.Inflight.Add(1)
	now := o.rt.Now()
	if !o.route.ServingAt(part, o.route.MonoAt(now)) {
		slot.Inflight.Add(-1)
		respond(r, reply{Result: resNotOwner})
		return
	}
	oc := &ownerCall{o: o, r: r, key: req.Key, op: req.Op, part: part, lop: leaseOpOf(req, o.route.EpochOf(part))}
	oc.c = keys.Call{Policy: p, Cost: 1, Deadline: now.UnixNano() + int64(o.timeout), Done: oc, Lease: &oc.lop}
	o.keys.Submit(req.Key, &oc.c, now.UnixNano(), nil)
}

// policyKey reports whether key is a limit key of policy p (p nil: no
// such policy in force): "p.<name>" or "p.<name>.<dimensions>".
func policyKey(p *policies.Policy, key string) bool {
	return p != nil && (key == "p."+p.Name || strings.HasPrefix(key, "p."+p.Name+"."))
}

// leaseOpOf is the owner core's operation for a holder's request, in the
// owner's epoch of the key's partition.
func leaseOpOf(req ownerRequest, epoch uint64) keys.LeaseOp {
	lop := keys.LeaseOp{Epoch: epoch}
	if req.Op == opAcquire {
		lop.Acquire = &lease.AcquireReq{Holder: req.Holder, Want: req.Want, Min: req.Min}
	} else {
		lop.Report = &lease.ReportReq{ID: req.Grant, Epoch: req.Epoch, Spent: req.Spent, Return: req.Op == opReturn}
	}
	return lop
}

// Finish implements keys.Finisher: the record is written (or the call
// failed); answer the holder.
func (oc *ownerCall) Finish(c *keys.Call) {
	defer oc.o.route.Slot(oc.part).Inflight.Add(-1)
	r := ownerReply(c, &oc.lop)
	switch {
	case c.Err != nil:
	case oc.lop.Acquire != nil:
		oc.o.m.grants.WithLabelValues(r.Result).Inc()
	default:
		oc.o.m.reports.WithLabelValues(oc.op, r.Result).Inc()
	}
	respond(oc.r, r)
}

// ownerReply is the reply to a holder's request decided as c by the owner
// core, with the outcome in op: not_owner when the write was fenced (the
// partition moved: the holder asks the new owner), unavailable when it
// failed otherwise; for an acquire, the grant (its ttl is what the owner
// counts from its own instant of granting, expiry less grant time) or why
// not; for a report or return, ok with what was refunded, or why it was
// refused (L2).
func ownerReply(c *keys.Call, op *keys.LeaseOp) reply {
	switch {
	case errors.Is(c.Err, fail.ErrFenced):
		return reply{Result: resNotOwner}
	case c.Err != nil:
		return reply{Result: resUnavail, Message: c.Err.Error()}
	}
	r := reply{Policy: c.Out.Policy, Revision: c.Out.Revision}
	if op.Acquire != nil {
		if op.Refused != nil {
			r.Result = resNotLeased
			return r
		}
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
		return r
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
	return r
}

// respond answers r with rep; a reply that cannot be sent is the
// requester's timeout.
func respond(r Request, rep reply) {
	_ = r.Respond(encode(rep))
}
