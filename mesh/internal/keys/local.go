package keys

import (
	"fmt"
	"sync"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/fail"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/policies"
)

// Local mode: each node decides alone, from memory. A local-mode key's
// state never leaves the node that received the request: no KV read or
// write, no forwarding. Every node enforces the whole limit, so N nodes
// admit at most N × burst (windows: N × limit per window) where the
// contract allows burst: the overshoot bound is (N − 1) × burst (mesh.OvershootBound).
//
// The table is bounded: at most max keys. A key is evicted only once it
// is at rest, i.e. idle long enough that a fresh state decides exactly
// like its own (bucket refilled, windows rolled over) and its request_ids
// are past keyrec.DedupeWindow, so eviction never adds admissions. When the
// table is full of keys that are not at rest, a new key is answered 503
// (unavailable) rather than admitted without a limit.
//
// Each policy keeps at most its max_keys keys here (CONTRACT.md §9): a new
// key of a policy that has them finishes with Call.Overflowed set,
// nothing decided, and the caller decides it against the policy's
// overflow key (Call.Overflow), which takes no place. Since a key leaves
// only at rest, the keys held are exactly the live ones, and a key held
// is never moved to overflow.

// DefaultLocalMaxKeys is the most local-mode keys one node holds.
const DefaultLocalMaxKeys = 100_000

// localSweepEvery is the least time between two sweeps forced by a full
// table (ns).
const localSweepEvery = kvstate.Second

// localTable holds the local-mode keys of one node.
type localTable struct {
	mu        sync.Mutex
	m         map[string]*localEntry
	max       int
	lastSweep int64 // ns
	// perPolicy counts the keys held of each policy (the overflow keys
	// not counted).
	perPolicy map[string]int64
}

// localEntry is one local-mode key: an owner core that is always loaded
// and never writes (only its decide is used).
type localEntry struct {
	mu       sync.Mutex
	o        *owner
	lastUsed int64  // ns
	policy   string // the policy it is counted for; "" for an overflow key
}

func newLocalTable(max int) *localTable {
	return &localTable{m: make(map[string]*localEntry), max: max, perPolicy: make(map[string]int64)}
}

func (t *localTable) len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.m)
}

// decide decides c for key at now and finishes it (c.Out, c.Err or
// c.Overflowed); the caller replies.
func (t *localTable) decide(env Env, key string, c *Call, now int64) {
	t.mu.Lock()
	e := t.m[key]
	if e == nil {
		capped := !c.Overflow && t.perPolicy[c.Policy.Name] >= c.Policy.MaxKeys
		if (capped || len(t.m) >= t.max) && now-t.lastSweep >= localSweepEvery {
			t.sweepLocked(env, now)
			capped = capped && t.perPolicy[c.Policy.Name] >= c.Policy.MaxKeys
		}
		if capped {
			t.mu.Unlock()
			c.Overflowed = true
			return
		}
		if len(t.m) >= t.max {
			t.mu.Unlock()
			c.Err = fmt.Errorf("%w: local key table full (%d keys)", fail.ErrUnavailable, t.max)
			return
		}
		o := newOwner(env, 1, 0)
		o.loaded = true
		e = &localEntry{o: o}
		if !c.Overflow {
			e.policy = c.Policy.Name
			t.perPolicy[e.policy]++
		}
		t.m[key] = e
	}
	e.mu.Lock()
	t.mu.Unlock()
	defer e.mu.Unlock()
	e.lastUsed = max(e.lastUsed, now)
	e.o.decide(&e.o.rec, c, now)
}

// sweep evicts the keys at rest at now.
func (t *localTable) sweep(now int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.sweepLocked(nil, now)
}

func (t *localTable) sweepLocked(env Env, now int64) {
	t.lastSweep = now
	for k, e := range t.m {
		e.mu.Lock()
		if env == nil {
			env = e.o.env
		}
		if atRest(env, &e.o.rec, now-e.lastUsed) {
			delete(t.m, k)
			if e.policy != "" {
				if t.perPolicy[e.policy]--; t.perPolicy[e.policy] <= 0 {
					delete(t.perPolicy, e.policy)
				}
			}
		}
		e.mu.Unlock()
	}
}

// atRest reports whether a key whose record is rec and that has been idle
// for idle ns decides exactly like a key never seen: each limit of the
// policy in force is refilled or rolled over, and no request_id is
// remembered any more. A record whose policy is gone is at rest.
func atRest(env Env, rec *keyrec.Record, idle int64) bool {
	if len(rec.Dedupe) > 0 && idle < keyrec.DedupeWindow {
		return false
	}
	p := env.Current(rec.Policy)
	if p == nil {
		return true
	}
	return idle >= restSpan(p)
}

// restSpan is how long (ns) an idle key of p takes to come to rest: the
// longest kvstate.RestSpan of its limits (a bucket's time to refill from
// empty, a window or hold expiry, two windows for a sliding window, a
// quota's longest period).
func restSpan(p *policies.Policy) int64 {
	var span int64
	for _, l := range p.Limits {
		span = max(span, kvstate.RestSpan(l.Limit))
	}
	return span
}
