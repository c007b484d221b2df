package service

import (
	"context"
	"slices"
	"sync"
	"time"

	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/keys"
	"github.com/limitmesh/limitmesh/mesh/internal/ownership"
)

// Expiry sweeps. A reservation not settled by its expiry ends as expired
// (its units stay spent; a concurrency hold ends by itself at the same
// instant), and its end is a write of its key's record with the usage
// record of its end (CONTRACT §10). The node remembers which keys it owns
// have open reservations, and when the first of them expires, from the
// replies of their reservation calls; every SweepInterval it submits a
// sweep call (keys.ResSweep) for each key whose first expiry has passed.
// A key whose partition this node no longer serves is forgotten here: its
// new owner ends its reservations when it handles the key (any
// reservation call, or a sweep once it knows the key).

// SweepInterval is how often a node looks for expired reservations: an
// expired reservation ends (and its usage is recorded) within about this
// much of its expiry on a node that knows of it.
const SweepInterval = 250 * time.Millisecond

// openKeys is the set of keys with open reservations. Its methods are
// safe for concurrent use.
type openKeys struct {
	mu       sync.Mutex
	keys     map[string]*openKey
	byPolicy map[string]int // open reservations per policy
}

type openKey struct {
	policy string
	part   int
	open   int
	next   int64 // ns: the first expiry
	busy   bool  // a sweep call is out
}

// track records that key (of policy, in partition part) has open
// reservations, the first expiring at next.
func (o *openKeys) track(m *Metrics, policy, key string, part, open int, next int64) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.keys == nil {
		o.keys, o.byPolicy = map[string]*openKey{}, map[string]int{}
	}
	k := o.keys[key]
	if k == nil {
		if open == 0 {
			return
		}
		k = &openKey{policy: policy, part: part}
		o.keys[key] = k
	}
	o.setLocked(m, key, k, open, next)
}

// setLocked updates k's count (dropping it at 0) and the gauge.
func (o *openKeys) setLocked(m *Metrics, key string, k *openKey, open int, next int64) {
	o.byPolicy[k.policy] += open - k.open
	m.reservationsOpen.WithLabelValues(k.policy).Set(float64(o.byPolicy[k.policy]))
	k.open, k.next = open, next
	if open == 0 {
		delete(o.keys, key)
	}
}

// due returns the keys whose first expiry is at or before now and that no
// sweep call is out for, in key order (a simulated schedule replays
// exactly), marking them busy, and forgets the keys of partitions not
// served here (serving).
func (o *openKeys) due(m *Metrics, now int64, serving func(part int) bool) (out []string, parts []int, policies []string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	for key, k := range o.keys {
		if k.part >= 0 && !serving(k.part) {
			o.setLocked(m, key, k, 0, 0)
			continue
		}
		if !k.busy && k.next <= now {
			k.busy = true
			out = append(out, key)
		}
	}
	slices.Sort(out)
	for _, key := range out {
		k := o.keys[key]
		parts, policies = append(parts, k.part), append(policies, k.policy)
	}
	return out, parts, policies
}

// done clears key's busy mark after its sweep call.
func (o *openKeys) done(key string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if k := o.keys[key]; k != nil {
		k.busy = false
	}
}

// StartSweeps runs the expiry sweeps every SweepInterval of the
// Runtime's clock until ctx ends. It returns at once.
func (s *Service) StartSweeps(ctx context.Context) {
	var next func()
	next = func() {
		if ctx.Err() != nil {
			return
		}
		s.sweepOnce()
		s.cfg.Runtime.AfterFunc(SweepInterval, next)
	}
	s.cfg.Runtime.AfterFunc(SweepInterval, next)
}

// sweepOnce submits a sweep call for every key with a reservation due.
func (s *Service) sweepOnce() {
	now := s.cfg.Runtime.Now()
	serving := func(part int) bool { return s.cfg.Route == nil || s.cfg.Route.Serving(part) }
	due, parts, names := s.open.due(s.m, now.UnixNano(), serving)
	for i, key := range due {
		p := s.cfg.Policies.Current(names[i])
		if p == nil {
			s.open.track(s.m, names[i], key, parts[i], 0, 0)
			continue
		}
		sc := &sweepCall{s: s, key: key, part: parts[i]}
		sc.op = keys.ResOp{Kind: keys.ResSweep, Key: key}
		sc.c = keys.Call{Policy: p, Cost: 1, Deadline: now.UnixNano() + int64(s.cfg.DecisionTimeout), Done: sc, Res: &sc.op}
		s.cfg.Keys.Submit(key, &sc.c, now.UnixNano(), nil)
	}
}

// sweepCall is one key's sweep in its owner core.
type sweepCall struct {
	s    *Service
	key  string
	part int
	c    keys.Call
	op   keys.ResOp
}

// Finish implements keys.Finisher.
func (sc *sweepCall) Finish(c *keys.Call) {
	s := sc.s
	s.open.done(sc.key)
	if c.Err != nil || c.Overflowed {
		if c.Overflowed {
			s.open.track(s.m, c.Policy.Name, sc.key, sc.part, 0, 0) // stored nowhere
		}
		return // tried again at the next sweep
	}
	s.m.reservationsEnded(c.Policy.Name, sc.op.Ended)
	s.open.track(s.m, c.Policy.Name, sc.key, sc.part, sc.op.Open, sc.op.Next)
}

// NoteReservations tracks key (of policy) for the expiry sweeps: a record
// of it, loaded or adopted by this node, holds open reservations, the
// first expiring at next. A node that takes a key over thus ends what its
// old owner left open, once it has read the key's record.
func (s *Service) NoteReservations(policy, key string, open int, next int64) {
	part := -1
	if s.cfg.Route != nil {
		part = ownership.PartitionOf(key, s.cfg.Route.Parts())
	}
	s.open.track(s.m, policy, key, part, open, next)
}

// NoteRecord is NoteReservations for a stored record (an adopted one).
func (s *Service) NoteRecord(key string, record []byte) {
	rec, err := keyrec.Decode(record)
	if err != nil || len(rec.Reservations) == 0 {
		return
	}
	if open, next := rec.OpenReservations(); open > 0 {
		s.NoteReservations(rec.Policy, key, open, next)
	}
}
