package sim

import (
	"errors"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/fail"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/keys"
	"github.com/limitmesh/limitmesh/mesh/internal/lease"
	"github.com/limitmesh/limitmesh/policies"
)

// Leased mode (docs/protocol.md, "Leased mode"): the "leased" policy's
// keys are spent by holders on every node. A holder is the production
// accounting, one lease.Pool per key and node incarnation on the node's
// clock, driven as leasing.Holder drives it: a plain decide request is
// spent from the pool (Spend) or, when no grant holds it, decided by the
// key's owner like a strict one; the pool asks for grants (WantAcquire),
// and every holderTick reports, returns and asks (Due, WantAcquire). Its
// requests to the key's owner cross the simulated network (lost, delayed,
// cut) and are applied by the owner's key core as keys.Calls with a
// LeaseOp in the owner's epoch, as leasing.Owner submits them: the grants
// live in the key's journalled record, so a new owner reads them back.
// What the wire and the gateways add (JSON, sub-grants) is not modelled.

// The leased policy: a token bucket whose grants hold at most
// leasedSize units, at most leasedMaxOut outstanding, for leasedTTL.
const (
	leasedPolicy = `{"match":{"kind":"leased"},"key":["k"],"limits":[{"algorithm":"token_bucket","rate":"20/s","burst":10}],` +
		`"mode":"leased","lease":{"size":4,"max_outstanding":12,"ttl":"2s"}}`
	leasedRate   = 20
	leasedBurst  = 10
	leasedMaxOut = 12
	leasedKeys   = 2
	// leasedLoad is the leased clients' decide requests per simulated
	// second, over the leased keys: half as much again as the keys'
	// rate, so the grants and max_outstanding bind.
	leasedLoad = 48
	// holderTick is how often a holder's pools are looked at, on its
	// clock (leasing's tick).
	holderTick = 20 * time.Millisecond
)

// leasedClients issue decide requests of the leased keys until end
// (global ns), as clients does for the others.
func (s *Sim) leasedClients(end int64) {
	var next func()
	next = func() {
		if s.s.now >= end {
			return
		}
		k := s.leased[s.s.rng.IntN(len(s.leased))]
		n := s.nodes[s.s.rng.IntN(len(s.nodes))]
		s.decide(k, n)
		gap := int64(s.s.rng.ExpFloat64() / leasedLoad * 1e9)
		s.s.after(max(gap, 1), nil, next)
	}
	s.s.after(int64(s.cfg.Lease), nil, next)
}

// pool returns n's pool of k (this incarnation's), made when missing.
func (n *node) pool(k *simKey) *lease.Pool {
	if n.pools == nil {
		n.pools = map[*simKey]*lease.Pool{}
	}
	pl := n.pools[k]
	if pl == nil {
		pl = lease.NewPool(lease.ParamsOf(k.p.Lease), func() uint64 { return 0 }) // no sub-grants are carved
		n.pools[k] = pl
	}
	return pl
}

// mono is n's monotonic clock now: the instants of its pools.
func (n *node) mono() int64 { return n.local(n.sim.s.now) + 1 }

// simLeaser is a node's service.Leaser: it spends the node's pools as
// leasing.Holder.Spend does: from the pool when a grant holds the cost
// (or the owner said the key is exhausted), else not (the service has
// the key's owner decide); the pool asks for a grant meanwhile.
type simLeaser struct{ n *node }

func (l simLeaser) Spend(p *policies.Policy, key string, _ int, cost int64, _ time.Time) (keyrec.Decision, bool) {
	n := l.n
	s := n.sim
	k := s.byName[key]
	if n.holderStopped || k == nil {
		return keyrec.Decision{}, false
	}
	pl := n.pool(k)
	now := n.mono()
	r, left, retry := pl.Spend(now, cost)
	if want, ask := pl.WantAcquire(now); ask {
		s.acquire(n, k, pl, want, min(cost, want))
	}
	d := keyrec.Decision{Policy: p.Name, Revision: p.Revision}
	switch r {
	case lease.Spent:
		d.Allowed, d.Remaining = true, left
		return d, true
	case lease.Denied:
		d.RetryAfter = retry
		return d, true
	}
	return keyrec.Decision{}, false
}

// acquire asks k's owner for a grant of want units (at least least) for
// n's pool pl, and puts the answer in the pool as leasing's applyAcquire
// does: a grant is spent until its deadline counted from n's instant of
// asking, less the skew margin (L4).
func (s *Sim) acquire(n *node, k *simKey, pl *lease.Pool, want, least int64) {
	sent := n.mono()
	op := keys.LeaseOp{Acquire: &lease.AcquireReq{Holder: n.id, Want: want, Min: least}}
	s.askOwner(n, k, op, func(kc *keys.Call, op *keys.LeaseOp) {
		now := n.mono()
		switch {
		case kc == nil || kc.Err != nil || op.Refused != nil: // no answer, unavailable, not_leased
			pl.Refused(now, 0, 0)
		case op.Acquired.Outcome == lease.Granted:
			g := op.Acquired.Grant
			if g.Units > 0 && g.Expires > g.At {
				pl.Granted(sent, g.ID, g.Epoch, g.Units, g.Expires-g.At)
			} else {
				pl.Refused(now, 0, 0)
			}
		default: // exhausted, full
			pl.Refused(now, op.Acquired.Outcome, op.Acquired.RetryAfter)
		}
	})
}

// report sends held's use to its owner, or returns it (ret); a refused
// report marks the grant stale (spent to its deadline, not reported
// again), as leasing's sendReport does.
func (s *Sim) report(n *node, k *simKey, pl *lease.Pool, held lease.Held, ret bool) {
	op := keys.LeaseOp{Report: &lease.ReportReq{ID: held.ID, Epoch: held.Epoch, Spent: held.Used, Return: ret}}
	s.askOwner(n, k, op, func(kc *keys.Call, op *keys.LeaseOp) {
		if kc != nil && kc.Err == nil && op.Refused != nil && !ret {
			pl.MarkStale(held.ID, held.Epoch)
		}
	})
}

// holderTicks does each pool's chores every holderTick of n's clock, as
// leasing.Holder.Run does: grants past their deadline or unused are
// returned, changed ones reported, and a pool in use under half a grant
// asks for the next.
func (s *Sim) holderTicks(n *node) {
	var loop func()
	loop = func() {
		now := n.mono()
		for _, k := range s.leased {
			pl := n.pools[k]
			if pl == nil {
				continue
			}
			returns, reports, _ := pl.Due(now)
			if want, ask := pl.WantAcquire(now); ask {
				s.acquire(n, k, pl, want, min(want, kvstate.Unit))
			}
			for _, h := range returns {
				s.report(n, k, pl, h, true)
			}
			for _, h := range reports {
				s.report(n, k, pl, h, false)
			}
		}
		nodeRT{n}.AfterFunc(holderTick, loop)
	}
	nodeRT{n}.AfterFunc(holderTick, loop)
}

// returnAll returns every grant n holds, as leasing.Holder.Stop does
// when the node stops (before it hands its partitions over).
func (s *Sim) returnAll(n *node) {
	for _, k := range s.leased {
		pl := n.pools[k]
		if pl == nil {
			continue
		}
		for _, h := range pl.Drain() {
			s.report(n, k, pl, h, true)
		}
	}
	n.pools = nil
	n.holderStopped = true
}

// askOwner sends a grant operation of k from holder n to the key's owner
// and calls done with the owner core's call and operation once the answer
// is back (kc nil: none within the decision timeout of n's clock). As
// leasing's ask does, a request finding no owner of the partition, or one
// no longer serving it, is sent again every 3 ms until the timeout.
// Requests and answers cross the network: delayed, lost, or cut with
// either node. done runs as a callback of n.
func (s *Sim) askOwner(n *node, k *simKey, tmpl keys.LeaseOp, done func(*keys.Call, *keys.LeaseOp)) {
	deadline := s.s.now + n.global(int64(s.cfg.Timeout))
	finished := false
	finish := func(kc *keys.Call, op *keys.LeaseOp) {
		if !finished {
			finished = true
			done(kc, op)
		}
	}
	s.s.at(deadline, n, func() { finish(nil, nil) })
	var try func()
	again := func() { s.s.after(int64(3*time.Millisecond), n, try) }
	try = func() {
		if finished || s.s.now >= deadline || n.cut {
			return
		}
		var owner *node
		for _, o := range s.nodes {
			if o.up && !o.cut && o.m.Route.Serving(k.part) {
				owner = o
			}
		}
		if owner == nil {
			again() // no responders
			return
		}
		if s.s.chance(s.cfg.Loss) {
			return
		}
		s.s.after(s.netDelay(), owner, func() {
			if owner.cut {
				return
			}
			answer := func(f func()) {
				if owner.cut || s.s.chance(s.cfg.Loss) {
					return
				}
				s.s.after(s.netDelay(), n, f)
			}
			m := owner.m
			if !m.Route.Serving(k.part) {
				answer(try) // not_owner
				return
			}
			op := tmpl
			op.Epoch = m.Route.EpochOf(k.part)
			slot := m.Route.Slot(k.part)
			slot.Inflight.Add(1)
			now := nodeRT{owner}.Now().UnixNano()
			call := &keys.Call{Policy: k.p, Cost: 1, Deadline: now + int64(s.cfg.Timeout), Lease: &op}
			call.Done = finisher(func(kc *keys.Call) {
				slot.Inflight.Add(-1)
				s.check.leaseOp(k, owner, kc, &op)
				if errors.Is(kc.Err, fail.ErrFenced) {
					answer(try) // not_owner
					return
				}
				answer(func() { finish(kc, &op) })
			})
			m.Keys.Submit(k.name, call, now, nil)
		})
	}
	try()
}

// finisher is a keys.Finisher of a function.
type finisher func(*keys.Call)

func (f finisher) Finish(c *keys.Call) { f(c) }
