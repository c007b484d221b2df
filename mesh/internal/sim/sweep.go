package sim

import (
	"slices"

	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/keys"
	"github.com/limitmesh/limitmesh/mesh/internal/service"
)

// Expiry sweeps, as the service runs them (service/reserve_sweep.go): a
// node incarnation remembers the keys it owns with open reservations and
// the first expiry among them, from the results of the reservation calls
// its key owners decide (and of its sweeps); every service.SweepInterval
// of its clock it forgets the keys of partitions it no longer serves and
// submits a sweep call (keys.ResSweep) for each key whose first expiry has
// passed and that no sweep call is out for. The simulation drives the key
// owners directly, so it runs these sweeps itself.

// openKey is one key with open reservations on a node.
type openKey struct {
	k    *simKey
	open int
	next int64 // the first expiry, ns of the owner's clock
	busy bool  // a sweep call is out
}

// track records that k has open reservations on n, the first expiring at
// next (open 0: none), as the service does with each reply.
func (n *node) track(k *simKey, open int, next int64) {
	o := n.open[k.name]
	if o == nil {
		if open == 0 {
			return
		}
		if n.open == nil {
			n.open = map[string]*openKey{}
		}
		o = &openKey{k: k}
		n.open[k.name] = o
	}
	o.open, o.next = open, next
	if open == 0 {
		delete(n.open, k.name)
	}
}

// startSweeps runs the node's sweeps every service.SweepInterval of its
// clock, for the incarnation that calls it.
func (n *node) startSweeps() {
	rtm := nodeRT{n}
	var loop func()
	loop = func() {
		n.sweepOnce()
		rtm.AfterFunc(service.SweepInterval, loop)
	}
	rtm.AfterFunc(service.SweepInterval, loop)
}

// sweepOnce is the service's sweepOnce: in key order (the service's map
// order does not matter; a schedule must replay exactly).
func (n *node) sweepOnce() {
	s := n.sim
	m := n.m
	now := nodeRT{n}.Now().UnixNano()
	names := make([]string, 0, len(n.open))
	for name := range n.open {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		o := n.open[name]
		if !m.Route.Serving(o.k.part) {
			delete(n.open, name)
			continue
		}
		if o.busy || o.next > now {
			continue
		}
		o.busy = true
		op := &keys.ResOp{Kind: keys.ResSweep, Key: name}
		c := &keys.Call{Policy: s.policies.Current(o.k.p.Name), Cost: 1,
			Deadline: now + int64(s.cfg.Timeout), Res: op}
		c.Done = finisher(func(c *keys.Call) {
			if cur := n.open[name]; cur != nil {
				cur.busy = false
			}
			if c.Err != nil || c.Overflowed {
				return // tried again at the next sweep
			}
			if s.cfg.Debug {
				s.logf("%s sweeps %s: %d open, ended %v", n.id, name, op.Open, op.Ended)
			}
			n.track(o.k, op.Open, op.Next)
		})
		m.Keys.Submit(name, c, now, nil)
	}
}

// sweepLag bounds, in global ns, how long after a reservation's expiry a
// node that knows of it has swept it: two intervals of a clock that runs
// up to maxDrift slow.
var sweepLag = int64(2*service.SweepInterval) * (1_000_000 + maxDrift) / 1_000_000

// noteOpen tracks key as the service's NoteReservations does (a record
// loaded with open reservations), for any key (the decided keys and the
// reserved ones: the conc keys are reserved only).
func (n *node) noteOpen(key string, open int, next int64) {
	for _, k := range append(n.sim.keys, n.sim.resKeys...) {
		if k.name == key {
			n.track(k, open, next)
			return
		}
	}
}

// noteRecord is the service's NoteRecord (an adopted record).
func (n *node) noteRecord(key string, record []byte) {
	rec, err := keyrec.Decode(record)
	if err != nil {
		return
	}
	if n.sim.cfg.Debug {
		for _, r := range rec.Reservations {
			n.sim.logf("%s adopted %s with reservation %d (expires %d, outcome %v) version %d", n.id, key, r.Seq, r.Expires, r.Outcome, rec.Version)
		}
	}
	if open, next := rec.OpenReservations(); open > 0 {
		n.noteOpen(key, open, next)
	}
}
