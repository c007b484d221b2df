// Package sim is a deterministic simulation of several limitmesh nodes:
// their members (ownership runner, state journal, key owners, routing),
// the production code itself, over a simulated JetStream (world.go) on one
// seeded scheduler. Time is simulated; every callback runs on the
// scheduler's goroutine, one at a time, in an order drawn from the seed,
// so a schedule replays exactly from its seed.
//
// The scheduler injects what a real deployment suffers: message delays,
// reordering and loss, replicas that lag, watch lag and stalls, node
// crashes, restarts and leaves, process pauses, network cuts, clocks that
// drift and disagree within bounds, stream leader elections and cut-off
// leaders answering stale reads. It checks the protocol's invariants
// (docs/protocol.md, "Invariants") and each key's contract where
// docs/protocol.md, "How they are checked", says (check.go): M1 and M2
// after every step, M3 and M4 at every answer (M6 at every admission of a
// leased key, L2 at every report an owner applies), M5 after every step once
// the mesh converged and at the end.
package sim

import (
	"container/heap"
	"math/rand/v2"
)

// event is one callback at a simulated instant.
type event struct {
	at   int64 // global ns
	seq  uint64
	f    func()
	node *node // nil: the world's; else dropped if the node's life changed
	life int
}

type eventHeap []*event

func (h eventHeap) Len() int { return len(h) }
func (h eventHeap) Less(i, j int) bool {
	if h[i].at != h[j].at {
		return h[i].at < h[j].at
	}
	return h[i].seq < h[j].seq
}
func (h eventHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *eventHeap) Push(x any)   { *h = append(*h, x.(*event)) }
func (h *eventHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	*h = old[:len(old)-1]
	return e
}

// sched is the scheduler: a simulated clock, an event queue and the
// seeded source of every random choice.
type sched struct {
	now    int64 // global ns since the start
	seq    uint64
	q      eventHeap
	rng    *rand.Rand
	steps  int
	onStep func() // checks, after every event
}

func newSched(seed uint64) *sched {
	return &sched{rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))}
}

// at schedules f at global instant t (not before now) for n (nil: the
// world).
func (s *sched) at(t int64, n *node, f func()) {
	s.seq++
	e := &event{at: max(t, s.now), seq: s.seq, f: f, node: n}
	if n != nil {
		e.life = n.life
	}
	heap.Push(&s.q, e)
}

// after schedules f d ns from now.
func (s *sched) after(d int64, n *node, f func()) { s.at(s.now+d, n, f) }

// runUntil runs events up to global instant t.
func (s *sched) runUntil(t int64) {
	for len(s.q) > 0 && s.q[0].at <= t {
		e := heap.Pop(&s.q).(*event)
		s.now = e.at
		if e.node != nil && (e.life != e.node.life || !e.node.up) {
			continue // the node crashed since: its callbacks are gone
		}
		if e.node != nil && e.node.pausedUntil > e.at {
			// The node's process is paused: its callbacks run, in their
			// order, when it resumes.
			e.at = e.node.pausedUntil
			heap.Push(&s.q, e)
			continue
		}
		e.f()
		s.steps++
		if s.onStep != nil {
			s.onStep()
		}
	}
	s.now = max(s.now, t)
}

// between draws a duration in [lo, hi].
func (s *sched) between(lo, hi int64) int64 {
	if hi <= lo {
		return lo
	}
	return lo + s.rng.Int64N(hi-lo+1)
}

// chance reports true with probability p.
func (s *sched) chance(p float64) bool { return s.rng.Float64() < p }
