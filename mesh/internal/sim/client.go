package sim

import (
	"errors"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/fail"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/keys"
	"github.com/limitmesh/limitmesh/policies"
)

// clients issue decide requests until end (global ns): to a random node,
// for a random key, as a Poisson process of cfg.Rate per second.
func (s *Sim) clients(end int64) {
	var next func()
	next = func() {
		if s.s.now >= end {
			return
		}
		k := s.keys[s.s.rng.IntN(len(s.keys))]
		n := s.nodes[s.s.rng.IntN(len(s.nodes))]
		s.check.calls++
		c := &clientCall{k: k, deadline: s.s.now + int64(s.cfg.Timeout), id: callID(s.check.calls)}
		s.route(c, n)
		gap := int64(s.s.rng.ExpFloat64() / s.cfg.Rate * 1e9)
		s.s.after(max(gap, 1), nil, next)
	}
	s.s.after(int64(s.cfg.Lease), nil, next)
}

// clientCall is one decide request, or one attempt of a reservation
// call (res set).
type clientCall struct {
	id       string // names the call in its usage record ("" for a probe)
	k        *simKey
	deadline int64 // global
	dryRun   bool
	done     func(keys.Call) // a final probe's
	// A reservation call's operation (the owner decides a copy), cost
	// (micro-units), request_id ("" none), and what the client does with
	// the answer (n: the node that decided it).
	res     *keys.ResOp
	cost    int64
	reqID   string
	resDone func(kc *keys.Call, op *keys.ResOp, n *node)
}

// route decides c on node n if n serves its key's partition, or forwards
// it to the node that does (as the decide service does), retrying until
// the deadline while no node serves it.
func (s *Sim) route(c *clientCall, n *node) {
	if s.s.now >= c.deadline {
		s.check.unavailable++
		return
	}
	if !n.up {
		s.check.lost++
		return
	}
	if n.pausedUntil > s.s.now {
		s.s.at(n.pausedUntil, n, func() { s.route(c, n) }) // received when the process resumes
		return
	}
	p := c.k.part
	if n.m.Route.Serving(p) {
		s.submit(c, n)
		return
	}
	var owner *node
	for _, o := range s.nodes {
		if o.up && o != n && o.m.Route.Serving(p) {
			owner = o
		}
	}
	if owner == nil || n.cut {
		s.s.after(int64(3*time.Millisecond), n, func() { s.route(c, n) })
		return
	}
	s.s.after(s.netDelay()+s.netDelay(), owner, func() { s.route(c, owner) })
}

// submit hands c to n's key owner.
func (s *Sim) submit(c *clientCall, n *node) {
	m := n.m
	slot := m.Route.Slot(c.k.part)
	slot.Inflight.Add(1)
	rtm := nodeRT{n}
	now := rtm.Now().UnixNano()
	call := &keys.Call{Policy: c.k.p, Cost: kvstate.Unit, DryRun: c.dryRun,
		Deadline: now + n.global(c.deadline-s.s.now)}
	if c.id != "" {
		call.Desc = policies.Descriptor{{Name: "call", Value: c.id}}
	}
	var op *keys.ResOp
	if c.res != nil {
		// As the service submits one (service/reserve.go): its key, the
		// cost and request_id of a reserve.
		o := *c.res
		o.Key = c.k.name
		op, call.Res = &o, &o
		if c.cost > 0 {
			call.Cost = c.cost
		}
		if c.reqID != "" {
			call.ID, call.HasID, call.RequestID = keyrec.IDHash(c.reqID), true, c.reqID
		}
	}
	call.Done = finisher(func(kc *keys.Call) {
		slot.Inflight.Add(-1)
		if errors.Is(kc.Err, fail.ErrFenced) && s.s.now < c.deadline {
			s.route(c, n) // the partition moved while deciding: the new owner decides
			return
		}
		if op != nil {
			if kc.Err == nil && !op.NotFound {
				n.track(c.k, op.Open, op.Next) // as the service's reply does (sweep.go)
			}
			c.resDone(kc, op, n)
			return
		}
		if c.done != nil {
			c.done(*kc)
			return
		}
		s.check.outcome(c, n, kc)
	})
	m.Keys.Submit(c.k.name, call, now, nil)
}

type finisher func(*keys.Call)

func (f finisher) Finish(c *keys.Call) { f(c) }
