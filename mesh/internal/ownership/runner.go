package ownership

import (
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/limitmesh/limitmesh/mesh/internal/rt"
)

// The runner: the machine around the ownership core. It feeds the core the
// entries watched in the shards bucket and the passing time, does the KV
// writes the core asks for (each a chain of callbacks), asks the state
// layer (Lifecycle: the journal) to prepare and hand over partitions, and
// tells the host (routing and keys) which partitions it serves. It blocks
// on nothing: every method returns at once, and every operation continues
// in its callback, so the deterministic simulation drives the same code.

// KV is the shards bucket as the runner uses it. Every call returns at
// once; done is called exactly once, on a goroutine of the
// implementation's, within about timeout.
type KV interface {
	// Update writes val if key's revision is still rev (0: absent or a
	// delete marker's revision). A lost race is an error wrapping
	// ErrConflict.
	Update(key string, val []byte, rev uint64, timeout time.Duration, done func(rev uint64, err error))
	// Delete deletes key if its revision is still rev (0: whatever it is).
	Delete(key string, rev uint64, timeout time.Duration, done func(err error))
	// Put writes val unconditionally.
	Put(key string, val []byte, timeout time.Duration, done func(rev uint64, err error))
	// Get reads key's latest entry (a leader read); ErrNotFound when it
	// is absent or deleted.
	Get(key string, timeout time.Duration, done func(e Entry, err error))
}

// Entry is a shards bucket entry as watched or read.
type Entry struct {
	Key     string
	Value   []byte
	Rev     uint64
	Deleted bool // a delete or purge marker
}

// Errors of KV implementations.
var (
	ErrConflict = errors.New("mesh: shards entry revision mismatch")
	ErrNotFound = errors.New("mesh: shards entry not found")
)

// Lifecycle is what a change of a partition's hands asks of the state
// layer (the state journal). Every call with done returns at once and
// calls done exactly once.
type Lifecycle interface {
	// Mark appends this node's tenure marker of partition p before it
	// claims p over an entry at revision epoch (a claim whose sources do
	// not include this node); an error fails the claim.
	Mark(p int, epoch uint64, timeout time.Duration, done func(error))
	// Adopt prepares p, just claimed in epoch, from the journals of
	// sources (oldest first) before it is served.
	Adopt(p int, sources []string, epoch uint64, timeout time.Duration, done func(error))
	// Release makes p's records durable for its next owner (a graceful
	// release), writing nothing after holdUntil, when this node's lease of
	// p lapses (zero: it holds none); an error leaves the entry to expire.
	Release(p int, holdUntil time.Time, timeout time.Duration, done func(error))
	// Lost reports that p was lost (not released).
	Lost(p int)
	// Renewed reports that this node renewed its claim of p.
	Renewed(p int)
	// OwnedElsewhere reports that p has another owner that finished
	// adopting it, or none after a release.
	OwnedElsewhere(p int)
}

// Host is what the node does with the partitions it serves: routing and
// the keys it holds.
type Host interface {
	// Serve sets p served in epoch until the monotonic instant until
	// (Runner.Mono), exclusive; called whenever it changes.
	Serve(p int, epoch uint64, until int64)
	// Unserve stops serving p (idempotent).
	Unserve(p int)
	// Drain waits until p has no call in flight here, writes its keys'
	// unwritten async changes and drops its keys, then calls done.
	Drain(p int, done func())
	// Dropped reports that p was lost: drop its keys.
	Dropped(p int)
}

// Metrics are the runner's collectors (nil: none).
type Metrics interface {
	Owned(n int)
	Changed(change string, n int) // "claimed", "released", "lost"
}

// Config configures a Runner. Self, Parts, Lease, KV, Host and Runtime are
// required; Life may be nil (no journal: state lives in the bucket alone).
type Config struct {
	Self    string
	Parts   int
	Lease   time.Duration
	KV      KV
	Life    Lifecycle
	Host    Host
	Runtime rt.Runtime
	Log     *slog.Logger
	Metrics Metrics
	// Base is the origin of the monotonic clock of the instants given to
	// Host.Serve (the routing table's); zero: when the runner is made.
	Base time.Time
}

// Runner drives one node's ownership core. Its methods are safe for
// concurrent use and never block.
type Runner struct {
	cfg  Config
	log  *slog.Logger
	base time.Time
	op   time.Duration // timeout of one KV operation

	mu       sync.Mutex
	core     *shardCore
	initial  bool // the watch delivered its initial values
	stopped  bool
	pending  int     // operations in flight
	served   []int64 // the until last given to Host.Serve per partition; 0: not served
	changes  [3]int
	settled  chan struct{}
	isSettle bool
	empty    chan struct{}
	isEmpty  bool
}

// NewRunner returns a runner; it acts once Ready is called.
func NewRunner(cfg Config) *Runner {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Base.IsZero() {
		cfg.Base = cfg.Runtime.Now()
	}
	return &Runner{
		cfg:     cfg,
		log:     cfg.Log,
		base:    cfg.Base,
		op:      max(cfg.Lease/3, 50*time.Millisecond),
		core:    newShardCore(cfg.Self, cfg.Parts, int64(cfg.Lease)),
		served:  make([]int64, cfg.Parts),
		settled: make(chan struct{}),
		empty:   make(chan struct{}),
	}
}

// Mono is the runner's monotonic clock: ns since it was made, > 0.
func (r *Runner) Mono() int64 { return rt.Mono(r.cfg.Runtime, r.base) }

// MonoAt is Mono at t (a reading of the runner's Runtime).
func (r *Runner) MonoAt(t time.Time) int64 { return int64(t.Sub(r.base)) + 1 }

// Settled is closed once no partition waits for an owner (as this node
// sees it).
func (r *Runner) Settled() <-chan struct{} { return r.settled }

// Owned returns the number of partitions this node holds.
func (r *Runner) Owned() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.core.owned()
}

// Observe reports a watched entry of the shards bucket.
func (r *Runner) Observe(e Entry) {
	r.mu.Lock()
	if r.stopped {
		r.mu.Unlock()
		return
	}
	r.ownedElsewhere(r.observe(e))
	st := r.step()
	r.mu.Unlock()
	r.start(st)
}

// Ready reports that the watch delivered the initial values: the runner
// starts claiming.
func (r *Runner) Ready() {
	r.mu.Lock()
	r.initial = true
	st := r.step()
	r.mu.Unlock()
	r.start(st)
}

// Tick lets time pass: renewals, heartbeats, expiries. The driver calls it
// every lease/15.
func (r *Runner) Tick() {
	r.mu.Lock()
	st := r.step()
	r.mu.Unlock()
	r.start(st)
}

// Stop makes the runner stop acting (the node is shutting down or
// crashed): nothing more is written, results that come back are ignored,
// and the host stops serving every partition.
func (r *Runner) Stop() {
	r.mu.Lock()
	r.stopped = true
	var unserve []int
	for p, u := range r.served {
		if u != 0 {
			r.served[p] = 0
			unserve = append(unserve, p)
		}
	}
	r.mu.Unlock()
	for _, p := range unserve {
		r.cfg.Host.Unserve(p)
	}
}

// Leave makes the node leave the mesh: its heartbeat entry is deleted (the
// other nodes stop assigning partitions to it) and it releases every
// partition gracefully. done is called once it holds none, or after
// timeout with an error.
func (r *Runner) Leave(timeout time.Duration, done func(error)) {
	var once sync.Once
	finish := func(err error) { once.Do(func() { done(err) }) }
	stop := r.cfg.Runtime.AfterFunc(timeout, func() {
		finish(fmt.Errorf("mesh: releasing partitions: still holding %d after %v", r.Owned(), timeout))
	})
	r.cfg.KV.Delete("node."+r.cfg.Self, 0, r.op, func(error) {})
	r.mu.Lock()
	r.core.leaving = true
	st := r.step()
	r.mu.Unlock()
	r.start(st)
	var wait func()
	wait = func() {
		select {
		case <-r.empty:
			stop()
			finish(nil)
		default:
			r.cfg.Runtime.AfterFunc(5*time.Millisecond, wait)
		}
	}
	wait()
}

// Verify reads part.<p> and calls done(true) when it still names this node
// in the epoch it serves (or when it cannot tell: the key's compare-and-swap
// still protects the state). A different entry is fed to the core (which
// drops the partition) and p stops being served at once.
func (r *Runner) Verify(p int, timeout time.Duration, done func(ok bool)) {
	r.mu.Lock()
	epoch := r.core.mine[p].epoch
	r.mu.Unlock()
	r.cfg.KV.Get(partKey(p), timeout, func(e Entry, err error) {
		if err != nil && !errors.Is(err, ErrNotFound) {
			done(true)
			return
		}
		if err == nil && r.namesSelf(e, epoch) {
			done(true)
			return
		}
		r.cfg.Host.Unserve(p)
		if err == nil {
			r.Observe(e)
		}
		done(false)
	})
}

func partKey(p int) string { return "part." + strconv.Itoa(p) }

// observe applies a watched entry to the core (r.mu held). It returns the
// partitions whose records another node now owns (Lifecycle.OwnedElsewhere).
func (r *Runner) observe(e Entry) (elsewhere []int) {
	now := r.Mono()
	switch {
	case strings.HasPrefix(e.Key, "node."):
		r.core.observeNode(strings.TrimPrefix(e.Key, "node."), e.Rev, e.Deleted, now)
	case strings.HasPrefix(e.Key, "part."):
		n, err := strconv.Atoi(strings.TrimPrefix(e.Key, "part."))
		if err != nil || n < 0 || n >= r.core.parts {
			return nil
		}
		var v partValue
		if !e.Deleted {
			if v, err = decodePartValue(e.Value); err != nil {
				// An entry no node wrote: treat it as a foreign owner
				// (it expires like any unrenewed entry).
				r.log.Warn("corrupt shard entry", "key", e.Key, "error", err.Error())
				v = partValue{Node: "?"}
			}
		}
		newer := e.Rev > r.core.obs[n].rev
		r.core.observePart(n, v, e.Rev, e.Deleted, now)
		// Another node renewed (so it finished adopting from this node's
		// journal) or the entry was released (checkpointed first); an
		// entry older than one already seen says nothing of the present.
		if newer && (e.Deleted || (v.Node != r.core.self && v.Epoch != 0)) {
			return []int{n}
		}
	}
	return nil
}

// step is what one turn of the core asks for: operations, and what to
// tell the host and the state layer.
type step struct {
	ops     []shardOp
	serve   []serveChange
	lost    []int
	settled bool
	empty   bool
}

type serveChange struct {
	p     int
	epoch uint64
	until int64 // 0: unserve
}

// step ticks the core, tells the host and the state layer what changed,
// and returns what must follow outside r.mu (r.mu held).
func (r *Runner) step() *step {
	if !r.initial || r.stopped {
		return nil
	}
	now := r.Mono()
	st := &step{ops: r.core.tick(now)}
	r.pending += len(st.ops)
	for p := range r.core.parts {
		if r.core.holds(p) {
			until, _ := r.core.serving(p, now)
			if until != r.served[p] {
				r.served[p] = until
				st.serve = append(st.serve, serveChange{p, r.core.mine[p].epoch, until})
			}
			continue
		}
		if r.served[p] != 0 {
			r.served[p] = 0
			st.serve = append(st.serve, serveChange{p: p})
		}
	}
	st.lost = r.core.takeLost()
	if m := r.cfg.Metrics; m != nil {
		m.Owned(r.core.owned())
		for i, c := range [3]int{r.core.claims, r.core.releases, r.core.losses} {
			if d := c - r.changes[i]; d > 0 {
				m.Changed([3]string{"claimed", "released", "lost"}[i], d)
			}
			r.changes[i] = c
		}
	}
	if !r.isSettle && r.core.settled(now) {
		r.isSettle = true
		st.settled = true
	}
	if !r.isEmpty && r.core.leaving && r.core.empty() && r.pending == 0 {
		r.isEmpty = true
		st.empty = true
	}
	r.notify(st)
	return st
}

// ownedElsewhere tells the state layer about partitions whose records
// another node now owns (r.mu held, so lifecycle calls keep their order).
func (r *Runner) ownedElsewhere(parts []int) {
	if life := r.cfg.Life; life != nil {
		for _, p := range parts {
			life.OwnedElsewhere(p)
		}
	}
}

// notify tells the host and the state layer what the step changed (r.mu
// held: host and lifecycle calls keep their order and never call back
// into the runner).
func (r *Runner) notify(st *step) {
	for _, c := range st.serve {
		if c.until == 0 {
			r.cfg.Host.Unserve(c.p)
		} else {
			r.cfg.Host.Serve(c.p, c.epoch, c.until)
		}
	}
	for _, p := range st.lost {
		r.log.Warn("partition lost", "partition", p)
		r.cfg.Host.Dropped(p)
		if life := r.cfg.Life; life != nil {
			life.Lost(p)
		}
	}
}

// start carries out the rest of a step outside r.mu: the signals and the
// operations (whose callbacks take r.mu).
func (r *Runner) start(st *step) {
	if st == nil {
		return
	}
	if st.settled {
		close(r.settled)
	}
	if st.empty {
		close(r.empty)
	}
	for _, op := range st.ops {
		r.do(op)
	}
}

// result is the outcome of one operation.
type result struct {
	op       shardOp
	rev      uint64
	err      error
	conflict bool
	landed   bool // an opRenew conflict that was this node's own renewal (renewLanded)
}

// done applies an operation's result to the core and carries out what
// follows.
func (r *Runner) done(res result) {
	r.mu.Lock()
	if r.stopped {
		r.mu.Unlock()
		return
	}
	now := r.Mono()
	switch res.op.kind {
	case opClaim:
		r.core.claimed(res.op, res.rev, res.err, now)
		if res.err != nil && !res.conflict {
			r.log.Warn("partition claim failed", "partition", res.op.part, "error", res.err.Error())
		}
	case opRenew:
		if res.landed {
			r.core.renewLanded(res.op, res.rev, now)
		} else {
			r.core.renewed(res.op, res.rev, res.err, res.conflict, now)
		}
		if res.err == nil && r.cfg.Life != nil {
			r.cfg.Life.Renewed(res.op.part)
		}
		if res.err != nil {
			r.log.Warn("partition renewal failed", "partition", res.op.part, "error", res.err.Error())
		}
	case opRelease:
		r.core.released(res.op, res.err == nil, now)
	case opHeartbeat:
		r.core.beat(res.op, res.rev, res.err)
		if res.err != nil {
			r.log.Warn("heartbeat failed", "error", res.err.Error())
		}
	}
	r.pending--
	st := r.step()
	r.mu.Unlock()
	r.start(st)
}
