// Package keys holds the limit keys a node decides: for each key an owner
// core (owner.go) that decides calls in order and groups their writes
// (group commit), the table of keys in memory (table.go), the driver that
// does each core's store operations (run.go), and the parts the table
// composes: the live-key caps and the overflow (overflow.go), the async
// write-behind timing (flush.go), the blind-create score (blind.go) and
// the in-memory table of local-mode keys (local.go).
//
// The store is asynchronous (kvstate.AsyncStore): a key's runner starts
// an operation and returns; the result continues it. Time, timers and
// goroutines come from an rt.Runtime, so the deterministic simulation
// drives the same code.
//
// keys imports kvstate, policies, keyrec, lease, fail and rt.
package keys

import (
	"errors"
	"log/slog"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/rt"
	"github.com/limitmesh/limitmesh/policies"
)

// Versions fetches policy versions that a loaded record names and the
// node does not know (for the §28 transition).
type Versions interface {
	// Missing reports whether version rev of policy name must be fetched.
	Missing(name string, rev uint64) bool
	// Fetch reads it into the node's policy set, then calls done (on a
	// goroutine of its own) with nil or why it could not.
	Fetch(name string, rev uint64, timeout time.Duration, done func(error))
}

// Fencer checks, after a write of a key lost its compare-and-swap, whether
// this node still holds the key's partition (in the epoch it serves): if
// not, the write fails as fenced (the calls go to the new owner) instead
// of being decided again.
type Fencer interface {
	Fenced(key string, timeout time.Duration, done func(fenced bool))
}

// Store is where a key's record is loaded from and written to (the state
// journal, or the state bucket itself). Every call returns at once and
// calls done exactly once, on a goroutine of its own.
type Store interface {
	// GetAsync returns key's record and revision; an error wrapping
	// kvstate.ErrNotFound (with the revision a create must expect) when
	// it has none.
	GetAsync(key string, timeout time.Duration, done func(val []byte, rev uint64, err error))
	// UpdateAsync writes value if key's revision is still rev (0: must
	// not exist); an error wrapping kvstate.ErrConflict otherwise. usage is
	// the usage of the admissions the record spends that no earlier write
	// carried: the store makes it durable with the record (the journal)
	// or publishes it once the write succeeds.
	UpdateAsync(key string, value []byte, usage []keyrec.Usage, rev uint64, timeout time.Duration, done func(rev uint64, err error))
}

// Config configures a Table. Env, Store and Runtime are required.
type Config struct {
	Env      Env
	Versions Versions // nil: records of unknown policy versions keep their states by position
	Store    Store
	Fencer   Fencer // nil: a lost compare-and-swap is always a conflict
	// Partition returns a key's partition (for DropPartition and
	// FlushPartition); nil: every key is in partition 0.
	Partition       func(key string) int
	Runtime         rt.Runtime
	MaxConflicts    int           // lost writes one call may go through; default 8
	TTL             time.Duration // the state's idle expiry (keep-alive writes); 0: none
	AsyncInterval   time.Duration // the write-behind interval of async mode
	DecisionTimeout time.Duration // bounds a store operation; default 500 ms
	LocalMaxKeys    int           // default DefaultLocalMaxKeys
	// LostUsage publishes the usage of async admissions whose changes a
	// lost write dropped (they were answered); nil: dropped.
	LostUsage func(policy, key string, us []keyrec.Usage)
	// UsageKept says that Store journals the usage with the record and
	// publishes it if a write whose outcome it reported unknown lands
	// later (the state journal): a retry that loses then does not make
	// that usage lost (it would be counted twice).
	UsageKept bool
	// OnReservations is told, when a key's record is loaded, that it
	// holds open reservations: open of them, the first expiring at next
	// (so a node that takes a key over sweeps what its old owner left);
	// nil: not told.
	OnReservations func(policy, key string, open int, next int64)
	Log            *slog.Logger
	Metrics        *Metrics // nil: none registered
}

// Table holds the limit keys this node decides: their entries, each an
// owner core and whether a runner drives it (run.go), and what the keys
// share, each a part of its own: the live keys of each policy and the
// overflow (liveKeys, overflow.go), the async write-behind timing
// (flusher, flush.go), whether new keys start with a blind create
// (blindScore, blind.go), and the local-mode keys, in a table of their
// own that never touches the store (localTable, local.go). Idle entries
// are swept; a swept key is reloaded from the store on its next call.
type Table struct {
	cfg   Config
	log   *slog.Logger
	m     *Metrics
	live  *liveKeys
	flush *flusher
	blind blindScore
	local *localTable

	mu      sync.Mutex
	entries map[string]*Entry
}

// Entry is one limit key held in memory: its owner core and whether a
// runner is driving it. A caller may keep a pointer to it (the request
// memo does) while Gone reports false.
type Entry struct {
	mu       sync.Mutex
	o        *owner
	running  bool
	lastUsed int64 // ns
	gone     bool  // removed from the table (a hint to it is stale)
	part     int
	// live is the live set the key is counted in (overflow.go); nil for
	// an overflow key and a probe. probe is, for a key new to this node
	// beyond its policy's max_keys, that policy's name: its first load
	// decides whether it is live already or overflows.
	live  *liveSet
	probe string
}

// New returns an empty table.
func New(cfg Config) *Table {
	if cfg.MaxConflicts <= 0 {
		cfg.MaxConflicts = 8
	}
	if cfg.DecisionTimeout <= 0 {
		cfg.DecisionTimeout = 500 * time.Millisecond
	}
	if cfg.AsyncInterval <= 0 {
		cfg.AsyncInterval = 100 * time.Millisecond
	}
	if cfg.LocalMaxKeys <= 0 {
		cfg.LocalMaxKeys = DefaultLocalMaxKeys
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Partition == nil {
		cfg.Partition = func(string) int { return 0 }
	}
	t := &Table{cfg: cfg, log: cfg.Log, m: cfg.Metrics, entries: make(map[string]*Entry),
		live: newLiveKeys(cfg.Env), local: newLocalTable(cfg.LocalMaxKeys)}
	t.flush = newFlusher(cfg.Runtime, cfg.AsyncInterval, t.flushKey)
	t.blind.v.Store(blindScoreStart)
	return t
}

// Len returns the number of keys held (not counting local-mode keys).
func (t *Table) Len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.entries)
}

func (t *Table) newOwner() *owner {
	o := newOwner(t.cfg.Env, t.cfg.MaxConflicts, int64(t.cfg.TTL))
	o.usageKept = t.cfg.UsageKept
	return o
}

// Submit hands c to key's owner at now (Unix ns) and starts a runner if
// none is active; c.Done is told when c is finished. A local-mode call is
// decided at once by the local table; an async call is decided at once
// when its owner can (owner.decideInline). hint, when not nil, caches
// key's entry between calls (the request memo's): it is used while the
// entry is still in the table, and set whenever the table is looked up.
func (t *Table) Submit(key string, c *Call, now int64, hint *atomic.Pointer[Entry]) {
	if c.Policy.Mode == policies.ModeLocal {
		t.local.decide(t.cfg.Env, key, c, now)
		c.Done.Finish(c)
		return
	}
	var e *Entry
	if hint != nil {
		if e = hint.Load(); e != nil {
			e.mu.Lock()
			if e.gone {
				e.mu.Unlock()
				e = nil
			}
		}
	}
	if e == nil {
		t.mu.Lock()
		if e = t.entries[key]; e != nil {
			e.mu.Lock()
			if e.gone { // a probe that overflowed, on its way out
				e.mu.Unlock()
				e = nil
			}
		}
		if e == nil {
			ls, probe, ok := t.live.place(key, c)
			if !ok {
				t.mu.Unlock()
				c.Overflowed = true
				c.Done.Finish(c)
				return
			}
			e = &Entry{o: t.newOwner(), part: t.cfg.Partition(key), live: ls}
			if probe {
				e.probe = c.Policy.Name
			}
			// A probe is loaded first: a stored record makes it live.
			e.o.blind = !probe && t.blind.allows()
			t.entries[key] = e
			e.mu.Lock()
		}
		t.mu.Unlock()
		if hint != nil {
			hint.Store(e)
		}
	}
	e.lastUsed = now
	if ok, arm := e.o.decideInline(c, now); ok {
		e.mu.Unlock()
		if arm {
			t.flush.arm(key, e)
		}
		c.Done.Finish(c)
		return
	}
	if !e.running && e.o.denyInline(c, now) {
		e.mu.Unlock()
		c.Done.Finish(c)
		return
	}
	e.o.submit(c)
	start := !e.running
	e.running = true
	e.mu.Unlock()
	if start {
		// The runner only starts a store operation: it does not block.
		t.run(key, e)
	}
}

// Sweep drops the entries idle since before now-idle (Unix ns) and the
// local-mode keys at rest at now.
func (t *Table) Sweep(now int64, idle time.Duration) {
	cutoff := now - int64(idle)
	t.local.sweep(now)
	t.mu.Lock()
	defer t.mu.Unlock()
	for k, e := range t.entries {
		e.mu.Lock()
		if !e.running && e.o.idle() && e.lastUsed < cutoff {
			t.removeLocked(k, e, now, true)
		}
		e.mu.Unlock()
	}
	t.live.prune(now, -1)
}

// removeLocked removes key's entry e at now, releasing its place among
// the live keys (rest: swept for idleness, it rests until its state is
// at rest; otherwise its partition moved away); the caller holds t.mu
// and e.mu.
func (t *Table) removeLocked(key string, e *Entry, now int64, rest bool) {
	if t.entries[key] == e {
		delete(t.entries, key)
	}
	if !e.gone {
		e.gone = true
		t.live.release(key, e, now, rest)
	}
}

// DropPartition drops the entries of partition p: its keys are decided
// elsewhere now, and a record cached here may be older than the next
// owner's writes. A key whose runner is still working is dropped too, its
// owner marked moved: its outstanding store operation finishes (a write's
// calls are answered as it went), then it decides nothing more (the calls
// still queued fail as fenced, owner.moved). A later call of the key, if
// the partition comes back, starts a new entry that loads the key
// (invariant K5).
func (t *Table) DropPartition(p int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for k, e := range t.entries {
		if e.part != p {
			continue
		}
		e.mu.Lock()
		e.o.moved = true
		t.removeLocked(k, e, 0, false)
		e.mu.Unlock()
	}
	t.live.prune(math.MinInt64, p)
}

// FlushPartition writes the unwritten async changes of partition p's keys
// now (before a graceful release hands p over: they would otherwise meet
// the next owner's epoch and be lost), then calls done once those keys
// are idle or at deadline. No new call of p arrives meanwhile (the
// partition no longer serves).
func (t *Table) FlushPartition(p int, deadline time.Time, done func()) {
	type pending struct {
		key string
		e   *Entry
	}
	var busy []pending
	t.mu.Lock()
	for k, e := range t.entries {
		if e.part != p {
			continue
		}
		e.mu.Lock()
		if e.running || !e.o.idle() {
			busy = append(busy, pending{k, e})
		}
		e.mu.Unlock()
	}
	t.mu.Unlock()
	// In key order, not the map's (a simulation schedule replays exactly).
	slices.SortFunc(busy, func(a, b pending) int { return strings.Compare(a.key, b.key) })
	for _, k := range busy {
		t.flushKey(k.key, k.e)
	}
	var poll func()
	poll = func() {
		for len(busy) > 0 {
			e := busy[0].e
			e.mu.Lock()
			idle := !e.running && e.o.idle()
			e.mu.Unlock()
			if !idle && t.cfg.Runtime.Now().Before(deadline) {
				t.cfg.Runtime.AfterFunc(time.Millisecond, poll)
				return
			}
			busy = busy[1:]
		}
		done()
	}
	poll()
}

// forget removes e from the table if it is still key's entry.
func (t *Table) forget(key string, e *Entry) {
	t.mu.Lock()
	if t.entries[key] == e {
		delete(t.entries, key)
	}
	t.mu.Unlock()
}

// flushKey asks e's owner to write its unwritten changes and drives it
// if no runner is active.
func (t *Table) flushKey(key string, e *Entry) {
	e.mu.Lock()
	e.o.requestFlush()
	start := !e.running && e.o.flushReq
	if start {
		e.running = true
	}
	e.mu.Unlock()
	if start {
		// The runner only starts the write: it does not block the wheel.
		t.run(key, e)
	}
}

// Gone reports whether e was removed from its table (a hint to it is
// stale: the key's state lives in a new entry, or in the store).
func (e *Entry) Gone() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.gone
}

// ErrNotLeased is a LeaseOp's Refused for an acquire of a key whose
// policy is not in leased mode.
var ErrNotLeased = errors.New("keys: the policy is not leased")
