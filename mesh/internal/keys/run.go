package keys

import (
	"errors"
	"fmt"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/fail"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
)

// The driver of the owner cores. A key's runner asks its core for the next
// action, hands out the calls it finished, and starts the load or write the
// core asks for; the operation's result, delivered by the store's
// callback, is applied to the core and continues the runner. So many
// keys' writes are in flight together while each key has at most one
// store operation outstanding (the core's rule), and no goroutine is
// parked per key. The rare slow steps run in a goroutine of their own:
// the fencing check after a lost compare-and-swap and fetching an old
// policy version a loaded record names.

// run drives key's core until it has nothing to do or waits on the store.
func (t *Table) run(key string, e *Entry) {
	defer func() {
		if v := recover(); v != nil {
			t.recoverKey(key, e, v)
		}
	}()
	e.mu.Lock()
	o := e.o
	now := t.cfg.Runtime.Now().UnixNano()
	a := o.next(now)
	if a.kind == actNone {
		e.running = false
		e.lastUsed = now
	}
	lostUsage, policy := o.takeLostUsage() // a moved owner's unwritten changes
	e.mu.Unlock()
	if len(lostUsage) > 0 && t.cfg.LostUsage != nil {
		t.cfg.LostUsage(policy, key, lostUsage)
	}
	if a.arm {
		t.flush.arm(key, e)
	}
	for _, c := range a.finished {
		c.Done.Finish(c)
	}
	switch a.kind {
	case actLoad:
		t.load(key, e, o, a, now)
	case actWrite:
		t.write(key, e, o, a, now)
	}
}

// opTimeout bounds a store operation by the latest deadline of the calls
// waiting on it (at least 1 ms, at most the decision timeout), so a hung
// store turns into 503s at the deadline rather than later.
func (t *Table) opTimeout(a action, now int64) time.Duration {
	return min(max(time.Duration(a.deadline-now), time.Millisecond), t.cfg.DecisionTimeout)
}

func (t *Table) observe(write bool, t0 time.Time, err error) {
	if t.m != nil {
		t.m.stateOp(write, err).Observe(t.cfg.Runtime.Now().Sub(t0).Seconds())
	}
}

// load starts the load a and continues key's runner with its result.
func (t *Table) load(key string, e *Entry, o *owner, a action, now int64) {
	timeout := t.opTimeout(a, now)
	t0 := t.cfg.Runtime.Now()
	t.cfg.Store.GetAsync(key, timeout, func(val []byte, rev uint64, err error) {
		t.observe(false, t0, err)
		if err == nil && t.cfg.Versions != nil {
			if name, prev, ok := keyrec.PeekPolicy(val); ok && t.cfg.Versions.Missing(name, prev) {
				t.cfg.Versions.Fetch(name, prev, timeout, func(ferr error) {
					if ferr != nil {
						t.log.Info("old policy version unavailable; keeping state by position",
							"policy", name, "revision", prev, "error", ferr.Error())
					}
					t.continueLoad(key, e, o, val, rev, err)
				})
				return
			}
		}
		t.continueLoad(key, e, o, val, rev, err)
	})
}

func (t *Table) continueLoad(key string, e *Entry, o *owner, val []byte, rev uint64, err error) {
	defer func() {
		if v := recover(); v != nil {
			t.recoverKey(key, e, v)
		}
	}()
	t.applyLoad(key, e, o, val, rev, err)
	t.run(key, e)
}

// write starts the write a and continues key's runner with its result.
func (t *Table) write(key string, e *Entry, o *owner, a action, now int64) {
	timeout := t.opTimeout(a, now)
	t0 := t.cfg.Runtime.Now()
	blind := a.blind // the closure keeps only what it needs, not a
	t.cfg.Store.UpdateAsync(key, a.value, a.usage, a.rev, timeout, func(rev uint64, err error) {
		// A lost blind create is the normal outcome for an existing key:
		// no fencing check (the write after the load does it if needed).
		if !blind && t.cfg.Fencer != nil && errors.Is(err, kvstate.ErrConflict) {
			t.cfg.Fencer.Fenced(key, timeout, func(fenced bool) {
				if fenced {
					err = fmt.Errorf("%w (%v)", fail.ErrFenced, err)
				}
				t.observe(true, t0, err)
				t.continueWrite(key, e, o, false, 0, err)
			})
			return
		}
		t.observe(true, t0, err)
		t.continueWrite(key, e, o, blind, rev, err)
	})
}

func (t *Table) continueWrite(key string, e *Entry, o *owner, blind bool, rev uint64, err error) {
	defer func() {
		if v := recover(); v != nil {
			t.recoverKey(key, e, v)
		}
	}()
	t.applyWrite(key, e, o, blind, rev, err)
	t.run(key, e)
}

// applyLoad reports a load's result to o, e's owner when the load started
// (nothing if e's owner was replaced since: recoverKey).
func (t *Table) applyLoad(key string, e *Entry, o *owner, val []byte, rev uint64, err error) {
	switch {
	case err == nil:
		t.blind.vote(-1)
	case errors.Is(err, kvstate.ErrNotFound):
		t.blind.vote(1)
	}
	e.mu.Lock()
	if e.o != o {
		e.mu.Unlock()
		return
	}
	if e.probe != "" && !o.moved && t.live.concludeProbe(key, e, o, err) {
		e.mu.Unlock()
		t.forget(key, e)
		return
	}
	before := o.corrupt
	o.loadedResult(val, rev, err)
	corrupt := o.corrupt - before
	var open int
	var next int64
	if o.loaded && len(o.rec.Reservations) > 0 {
		open, next = o.rec.OpenReservations()
	}
	policy := o.rec.Policy
	e.mu.Unlock()
	if open > 0 && t.cfg.OnReservations != nil {
		t.cfg.OnReservations(policy, key, open, next)
	}
	if corrupt > 0 {
		if t.m != nil {
			t.m.corruptRecords.Inc()
		}
		t.log.Warn("corrupt state record replaced; the key starts empty", "key", key)
	}
}

// applyWrite reports a write's result to o (as applyLoad); blind marks a
// blind create.
func (t *Table) applyWrite(key string, e *Entry, o *owner, blind bool, rev uint64, err error) {
	if blind {
		switch {
		case err == nil:
			t.blind.vote(1)
		case errors.Is(err, kvstate.ErrConflict):
			t.blind.vote(-2)
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
	lostUsage, policy := o.takeLostUsage()
	e.mu.Unlock()
	if len(lostUsage) > 0 && t.cfg.LostUsage != nil {
		t.cfg.LostUsage(policy, key, lostUsage)
	}
	if t.m != nil {
		if lost > 0 {
			t.m.asyncLost.Add(float64(lost))
		}
		if batch > 0 {
			t.m.batchSize.Observe(float64(batch))
		}
		if conflict {
			// Expected and retried (a blind create that found the key
			// stored, or another writer): counted, not logged.
			t.m.casConflicts.Inc()
			t.m.casRetries.Add(float64(min(batch, retried)))
		}
	}
	if err != nil && !conflict && !errors.Is(err, fail.ErrFenced) {
		t.log.Debug("state write failed", "key", key, "error", err.Error())
	}
}

// recoverKey answers every call of a key whose runner panicked with a 500
// and resets the key (it reloads from the store on the next call).
func (t *Table) recoverKey(key string, e *Entry, v any) {
	t.log.Error("panic deciding a key", "key", key, "panic", fmt.Sprint(v))
	e.mu.Lock()
	o := e.o
	calls := append(append(append([]*Call(nil), o.finished...), o.inflight...), o.queue...)
	e.o = t.newOwner()
	e.running = false
	e.mu.Unlock()
	for _, c := range calls {
		c.Err = fmt.Errorf("%w: %v", fail.ErrInternal, v)
		c.Done.Finish(c)
	}
}
