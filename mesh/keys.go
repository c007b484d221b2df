package mesh

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"

	"github.com/limitmesh/limitmesh/policies"
)

// blindScoreMax bounds keyTable.blindScore; a new table starts at
// blindScoreStart.
const (
	blindScoreMax   = 16
	blindScoreStart = 4
)

// blindVote moves the blind-create score by d within its bounds.
func (t *keyTable) blindVote(d int64) {
	for {
		v := t.blindScore.Load()
		nv := min(max(v+d, -blindScoreMax), blindScoreMax)
		if nv == v || t.blindScore.CompareAndSwap(v, nv) {
			return
		}
	}
}

// keyEntry is one limit key held in memory: its owner core and whether a
// runner goroutine is driving it.
type keyEntry struct {
	mu       sync.Mutex
	o        *owner
	running  bool
	lastUsed int64 // ns
	gone     bool  // removed from the key table (a memo's hint to it is stale)
}

// keyTable maps limit keys to their entries. Idle entries are swept; a
// swept key is reloaded from the store on its next request.
//
// Keys of local-mode policies are not here but in local, a table of their
// own that never touches the store (local.go).
type keyTable struct {
	mu sync.Mutex
	m  map[string]*keyEntry

	// blindScore says whether new owners may try a blind create (owner.go):
	// it rises when a key read for the first time is absent or a blind
	// create wins, and falls (faster) when such a key exists or a blind
	// create loses, within ±blindScoreMax. Blind creates are tried while
	// it is positive, so after a handoff of existing keys they stop after
	// a few losses, and with new keys they save each key's first read.
	blindScore atomic.Int64

	local *localTable

	// flush times the async write-behinds (async_flush.go).
	flush flushWheel
}

func newKeyTable() *keyTable {
	t := &keyTable{m: make(map[string]*keyEntry), local: newLocalTable(DefaultLocalMaxKeys)}
	t.blindScore.Store(blindScoreStart)
	return t
}

func (t *keyTable) len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.m)
}

// sweep drops entries idle for longer than idle, every idle/2, until ctx
// ends.
func (t *keyTable) sweep(ctx context.Context, clock func() time.Time, idle time.Duration) {
	tk := time.NewTicker(idle / 2)
	defer tk.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tk.C:
		}
		now := clock()
		cutoff := now.Add(-idle).UnixNano()
		t.local.sweep(now.UnixNano())
		t.mu.Lock()
		for k, e := range t.m {
			e.mu.Lock()
			if !e.running && e.o.idle() && e.lastUsed < cutoff {
				t.removeLocked(k, e)
			}
			e.mu.Unlock()
		}
		t.mu.Unlock()
	}
}

// removeLocked removes key's entry e from the table; the caller holds
// t.mu and e.mu.
func (t *keyTable) removeLocked(key string, e *keyEntry) {
	e.gone = true
	delete(t.m, key)
}

// submit hands c to key's owner and starts a runner if none is active.
// A local-mode call is decided at once by this node's local table; an
// async call is decided at once when its owner can (owner.decideInline).
// hint, when not nil, caches key's entry for the next call (a memo entry's,
// memo.go): it is used while the entry is still in the table, and set
// whenever the table is looked up.
func (n *Node) submit(key string, c *call, now int64, hint *atomic.Pointer[keyEntry]) {
	t := n.keys
	if c.policy.Mode == policies.ModeLocal {
		t.local.decide(n.policies, key, c, now)
		c.done.finish(c)
		return
	}
	var e *keyEntry
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
		e = t.m[key]
		if e == nil {
			e = &keyEntry{o: newOwner(n.policies, n.cfg.MaxConflicts, int64(n.cfg.StateTTL))}
			e.o.blind = t.blindScore.Load() > 0
			t.m[key] = e
		}
		e.mu.Lock()
		t.mu.Unlock()
		if hint != nil {
			hint.Store(e)
		}
	}
	e.lastUsed = now
	if ok, arm := e.o.decideInline(c, now); ok {
		e.mu.Unlock()
		if arm {
			n.armFlush(key, e)
		}
		c.done.finish(c)
		return
	}
	e.o.submit(c)
	start := !e.running
	e.running = true
	e.mu.Unlock()
	if !start {
		return
	}
	if as, _ := n.asyncStore(); as != nil {
		// The runner only starts store operations: it does not block.
		n.runKey(key, e)
		return
	}
	go n.runKey(key, e)
}

// asyncInterval is the write-behind interval of async mode.
func (n *Node) asyncInterval() time.Duration {
	if n.cfg.AsyncInterval > 0 {
		return n.cfg.AsyncInterval
	}
	return DefaultAsyncInterval
}

// runKey drives one key's owner core until it has nothing to do or waits
// on the store: it does the store I/O the core asks for and sends the
// replies it releases. With an asynchronous store (the JetStream one) it
// only starts each operation and returns; the operation's result
// continues the drive (pipeline.go), so it never blocks and no goroutine
// waits on a key's store operation. With a blocking store it does the
// operation itself and loops.
func (n *Node) runKey(key string, e *keyEntry) {
	defer func() {
		if v := recover(); v != nil {
			n.recoverKey(key, e, v)
		}
	}()
	as, fenced := n.asyncStore()
	for {
		e.mu.Lock()
		o := e.o
		now := n.clock().UnixNano()
		a := o.next(now)
		if a.kind == actNone {
			e.running = false
			e.lastUsed = now
		}
		e.mu.Unlock()
		if a.arm {
			n.armFlush(key, e)
		}
		for _, c := range a.finished {
			c.done.finish(c)
		}
		switch a.kind {
		case actNone:
			return
		case actLoad:
			if as != nil {
				n.loadAsync(as, key, e, o, a, now)
				return
			}
			ctx, cancel := context.WithTimeout(context.Background(), n.opTimeout(a, now))
			t0 := time.Now()
			val, rev, err := n.store.Get(ctx, key)
			n.observeOp("get", t0, err)
			if err == nil {
				n.ensureVersion(ctx, val)
			}
			cancel()
			n.applyLoad(key, e, o, val, rev, err)
		case actWrite:
			if as != nil {
				n.writeAsync(as, fenced, key, e, o, a, now)
				return
			}
			ctx, cancel := context.WithTimeout(context.Background(), n.opTimeout(a, now))
			t0 := time.Now()
			rev, err := n.store.Update(ctx, key, a.value, a.rev)
			n.observeOp("update", t0, err)
			cancel()
			n.applyWrite(key, e, o, a.blind, rev, err)
		}
	}
}

// applyLoad reports a load's result to o, e's owner when the load
// started (nothing if e's owner was replaced since: recoverKey).
func (n *Node) applyLoad(key string, e *keyEntry, o *owner, val []byte, rev uint64, err error) {
	switch {
	case err == nil:
		n.keys.blindVote(-1)
	case errors.Is(err, kvstate.ErrNotFound):
		n.keys.blindVote(1)
	}
	e.mu.Lock()
	if e.o != o {
		e.mu.Unlock()
		return
	}
	before := o.corrupt
	o.loadedResult(val, rev, err)
	corrupt := o.corrupt - before
	e.mu.Unlock()
	if corrupt > 0 {
		n.metrics.corruptRecords.Inc()
		n.log.Warn("corrupt state record replaced; the key starts empty", "key", key)
	}
}

// applyWrite reports a write's result to o (as applyLoad); blind marks a
// blind create.
func (n *Node) applyWrite(key string, e *keyEntry, o *owner, blind bool, rev uint64, err error) {
	if blind {
		switch {
		case err == nil:
			n.keys.blindVote(1)
		case errors.Is(err, kvstate.ErrConflict):
			n.keys.blindVote(-2)
		}
	}
	e.mu.Lock()
	if e.o != o {
		e.mu.Unlock()
		return
	}
	batch := len(o.inflight)
	lost := o.lost
	conflict := o.written(rev, err)
	retried := len(o.queue)
	lost = o.lost - lost
	e.mu.Unlock()
	if lost > 0 {
		n.metrics.asyncLost.Add(float64(lost))
	}
	if batch > 0 {
		n.metrics.batchSize.Observe(float64(batch))
	}
	if conflict && !blind {
		n.metrics.casConflicts.Inc()
		n.metrics.casRetries.Add(float64(min(batch, retried)))
	} else if err != nil {
		n.log.Warn("state write failed", "key", key, "error", err.Error())
	}
}

// opTimeout bounds a store operation by the latest deadline of the calls
// waiting on it (at least 1 ms, at most the decision timeout), so a hung
// store turns into 503s at the deadline rather than later.
func (n *Node) opTimeout(a action, now int64) time.Duration {
	return min(max(time.Duration(a.deadline-now), time.Millisecond), n.cfg.DecisionTimeout)
}

func (n *Node) observeOp(op string, t0 time.Time, err error) {
	n.metrics.stateOp(op, err).Observe(time.Since(t0).Seconds())
}

// ensureVersion makes sure the policy version a loaded record was written
// under is in the version cache (reading the policy bucket's history if
// needed), so the core can apply the §28 transition from it.
func (n *Node) ensureVersion(ctx context.Context, val []byte) {
	name, rev, ok := n.policies.peek(val)
	if !ok {
		return
	}
	if err := n.watcher.fetchVersion(ctx, name, rev); err != nil {
		n.log.Info("old policy version unavailable; keeping state by position", "policy", name, "revision", rev, "error", err.Error())
	}
}

// peek returns the policy version of a stored record when it is neither
// current nor cached.
func (s *policySet) peek(val []byte) (string, uint64, bool) {
	name, rev, ok := peekRecordPolicy(val)
	if !ok || name == "" {
		return "", 0, false
	}
	if cur := s.current(name); cur != nil && cur.Revision == rev {
		return "", 0, false
	}
	if _, _, ok := s.version(name, rev); ok {
		return "", 0, false
	}
	return name, rev, true
}

// recoverKey answers every call of a key whose runner panicked with a 500
// and resets the key (it reloads from the store on the next request).
func (n *Node) recoverKey(key string, e *keyEntry, v any) {
	n.log.Error("panic deciding a key", "key", key, "panic", fmt.Sprint(v))
	e.mu.Lock()
	o := e.o
	calls := append(append(append([]*call(nil), o.finished...), o.inflight...), o.queue...)
	e.o = newOwner(n.policies, n.cfg.MaxConflicts, int64(n.cfg.StateTTL))
	e.running = false
	e.mu.Unlock()
	for _, c := range calls {
		c.err = fmt.Errorf("%w: internal error", errInternal)
		c.done.finish(c)
	}
}
