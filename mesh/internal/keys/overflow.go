package keys

import (
	"errors"
	"math"
	"sync"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
)

// Cardinality (CONTRACT.md §9, max_keys; docs/protocol.md "max_keys and
// the overflow key").
//
// A policy's live keys on this node are its limit keys that this node
// decides and whose state can still change a decision: the keys held in
// the table, and the keys swept from it (idle) that are not at rest yet
// (resting: remembered as the key and the instant it comes to rest, a few
// dozen bytes instead of a whole owner). A policy keeps at most MaxKeys
// live keys per node. A key that is not live here asks for a place when
// it arrives:
//
//   - below MaxKeys it takes one (a resting key takes its own back);
//   - at MaxKeys the key is a probe: its owner loads it first (no blind
//     create). A stored record means the key is live already (decided
//     by this partition's previous owner, or before a restart): it takes a
//     place beyond MaxKeys, so a key already live is never moved to
//     overflow (invariant K4). No stored record means a new key: its calls finish with
//     Call.Overflowed set, nothing decided, and the probe leaves the
//     table; the caller decides them against the policy's overflow key
//     (Call.Overflow, exempt from the cap), which may be another
//     partition's. The key is remembered as absent (a bounded set), so
//     its next calls overflow without a read while the policy has
//     MaxKeys live keys here; a place that frees up goes to whichever
//     key asks first, and the partition moving away forgets the keys of
//     it (the next owner may store them).
//
// A live key leaves the set when it is swept at rest, when a resting key
// comes to rest (Sweep), or when its partition moves away
// (DropPartition). Keys beyond MaxKeys are only ever ones that were
// stored when they came: they were admitted under some node's MaxKeys.
//
// Local-mode keys are counted by the local table (local.go), where a key
// is only ever evicted at rest, so the keys it holds are the live ones.

// liveKeys counts the live keys of every policy on this node and
// remembers the keys a probe found absent. Its methods are safe for
// concurrent use; lock order: Table.mu, then an Entry's mu, then
// liveKeys.mu.
type liveKeys struct {
	env Env // the policies in force, for the instant a swept key rests

	mu   sync.Mutex
	sets map[string]*liveSet // by policy
	// absent holds keys (with their partition) that a probe found absent
	// from the store: they overflow again without a read.
	absent map[string]int
}

// liveSet counts one policy's live keys on this node. Its fields are
// guarded by liveKeys.mu.
type liveSet struct {
	policy string
	n      int64 // keys in the table counted here, plus resting keys
	// resting holds the counted keys swept from the table before they
	// came to rest.
	resting map[string]restingKey
}

// restingKey is a live key that is not in the table: at is the instant
// (Unix ns) its state is at rest; part its partition.
type restingKey struct {
	at   int64
	part int
}

func newLiveKeys(env Env) *liveKeys {
	return &liveKeys{env: env, sets: make(map[string]*liveSet), absent: make(map[string]int)}
}

// setLocked returns policy's live set, creating it; the caller holds l.mu.
func (l *liveKeys) setLocked(policy string) *liveSet {
	ls := l.sets[policy]
	if ls == nil {
		ls = &liveSet{policy: policy}
		l.sets[policy] = ls
	}
	return ls
}

// place finds key, new in the table, a place among c's policy's live
// keys when it has one (resting) or one is free: it returns the set that
// counts it. Otherwise the key is a probe (probe: its policy has MaxKeys
// live keys here), or, when a probe of key found it absent since this
// node serves its partition, ok is false: key overflows again, without a
// read. An overflow key takes no place and is no probe.
func (l *liveKeys) place(key string, c *Call) (ls *liveSet, probe, ok bool) {
	if c.Overflow {
		return nil, false, true
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	ls = l.setLocked(c.Policy.Name)
	if _, ok := ls.resting[key]; ok {
		delete(ls.resting, key)
		return ls, false, true
	}
	if ls.n < c.Policy.MaxKeys {
		ls.n++
		delete(l.absent, key)
		return ls, false, true
	}
	if _, ok := l.absent[key]; ok {
		return nil, false, false
	}
	return nil, true, true
}

// maxAbsent bounds liveKeys.absent.
const maxAbsent = 1 << 16

// noteAbsent remembers that a probe found key, of partition part, absent
// from the store. The caller holds the key's Entry.mu.
func (l *liveKeys) noteAbsent(key string, part int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.absent) >= maxAbsent {
		for k := range l.absent {
			delete(l.absent, k)
			break
		}
	}
	l.absent[key] = part
}

// adopt gives a probe that was found stored a place beyond MaxKeys; the
// caller holds e.mu.
func (l *liveKeys) adopt(e *Entry) {
	l.mu.Lock()
	defer l.mu.Unlock()
	ls := l.setLocked(e.probe)
	ls.n++
	e.live, e.probe = ls, ""
}

// release takes key out of e's live set as e leaves the table at now:
// resting when its state is not at rest yet (rest: it was swept for
// idleness; a key whose partition moved away is gone from here). The
// caller holds e.mu.
func (l *liveKeys) release(key string, e *Entry, now int64, rest bool) {
	ls := e.live
	if ls == nil {
		return
	}
	e.live = nil
	at := int64(0)
	if rest {
		at = l.restAt(e, ls.policy)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if at > now {
		if ls.resting == nil {
			ls.resting = make(map[string]restingKey)
		}
		ls.resting[key] = restingKey{at: at, part: e.part}
		return
	}
	ls.n--
	l.dropEmptyLocked(ls)
}

// restAt returns the instant (Unix ns) e's key, last used at e.lastUsed,
// comes to rest under policy's version in force: its limits refilled or
// rolled over (kvstate.RestSpan) and, if it remembers request_ids, past
// keyrec.DedupeWindow. A key whose policy is gone is at rest.
func (l *liveKeys) restAt(e *Entry, policy string) int64 {
	p := l.env.Current(policy)
	if p == nil {
		return 0
	}
	span := restSpan(p)
	if len(e.o.rec.Dedupe) > 0 {
		span = max(span, keyrec.DedupeWindow)
	}
	if span > math.MaxInt64-e.lastUsed {
		return math.MaxInt64
	}
	return e.lastUsed + span
}

// prune forgets the resting keys at rest at now, and those of partition
// part when part >= 0 (the partition moved away), with the absent keys
// of that partition.
func (l *liveKeys) prune(now int64, part int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if part >= 0 {
		for k, p := range l.absent {
			if p == part {
				delete(l.absent, k)
			}
		}
	}
	for _, ls := range l.sets {
		for k, r := range ls.resting {
			if r.at <= now || r.part == part {
				delete(ls.resting, k)
				ls.n--
			}
		}
		l.dropEmptyLocked(ls)
	}
}

// dropEmptyLocked forgets ls when it counts nothing (an entry still
// pointing at it keeps it alive and counts in it; a new set replaces it
// in the map). The caller holds l.mu.
func (l *liveKeys) dropEmptyLocked(ls *liveSet) {
	if ls.n <= 0 && len(ls.resting) == 0 && l.sets[ls.policy] == ls {
		delete(l.sets, ls.policy)
	}
}

// count returns the number of policy's live keys on this node (held in
// the table or resting; local-mode keys not counted).
func (l *liveKeys) count(policy string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	if ls := l.sets[policy]; ls != nil {
		return int(ls.n)
	}
	return 0
}

// concludeProbe applies the result of a probe's load (err as the store
// gave it) to e, whose owner is o; the caller holds e.mu. A stored record
// makes the key live (adopt) and the load continues as any other (it
// reports false). An absent one finishes the queued calls as overflowed;
// any other error fails them as a failed load does; either way e, which
// holds nothing, is marked gone and it reports true: the caller removes e
// from the table (the key's next call is a probe again).
func (l *liveKeys) concludeProbe(key string, e *Entry, o *owner, err error) (done bool) {
	switch {
	case err == nil:
		l.adopt(e)
		return false
	case errors.Is(err, kvstate.ErrNotFound):
		l.noteAbsent(key, e.part)
		o.busy = false
		for _, c := range o.queue {
			c.Overflowed = true
			o.finished = append(o.finished, c)
		}
		clear(o.queue)
		o.queue = o.queue[:0]
	default:
		o.loadedResult(nil, 0, err)
	}
	e.gone = true
	return true
}
