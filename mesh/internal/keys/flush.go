package keys

import (
	"sync"
	"time"
)

// Write-behind timing of async mode. An owner with unwritten changes asks
// its driver to arm a flush (action.arm); the flush must come at most one
// async interval later (the overshoot bound counts that interval). Rather
// than a timer per key and interval, a node keeps one flushWheel: a ring
// of flushSlots slots that one goroutine turns every interval/flushSlots.
// A key armed while slot s receives is flushed when the ring comes back
// to s, flushSlots ticks later: between (flushSlots-1)/flushSlots of an
// interval and one interval after it was armed, so writes still coalesce
// about an interval of changes. The goroutine runs only while some key is
// armed: it stops at a tick that finds the ring empty, and the next arm
// starts it again.

// flushSlots is the number of slots of a flushWheel.
const flushSlots = 4

// flushEntry is one armed key.
type flushEntry struct {
	key string
	e   *Entry
}

// flushWheel holds the armed keys of a node. Its methods are safe for
// concurrent use; it does no I/O and reads no clock (the driver ticks it).
type flushWheel struct {
	mu      sync.Mutex
	slots   [flushSlots][]flushEntry
	pos     int // the slot that receives new entries
	pending int // entries in all slots
	running bool
	spare   []flushEntry // a drained slot's array, for reuse
}

// add arms key: it is handed out by the flushSlots-th tick from now. It
// reports whether the caller must start the ticking goroutine (none runs).
func (w *flushWheel) add(key string, e *Entry) (start bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.slots[w.pos] = append(w.slots[w.pos], flushEntry{key, e})
	w.pending++
	if w.running {
		return false
	}
	w.running = true
	return true
}

// tick turns the ring by one slot and returns the entries now due (to be
// given back with recycle once flushed). stop is true when nothing was due
// and nothing is armed: the ticking goroutine must end (the next add
// starts another).
func (w *flushWheel) tick() (due []flushEntry, stop bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.pos = (w.pos + 1) % flushSlots
	due = w.slots[w.pos]
	w.slots[w.pos], w.spare = w.spare[:0], nil
	w.pending -= len(due)
	if len(due) == 0 && w.pending == 0 {
		w.running = false
		return nil, true
	}
	return due, false
}

// recycle takes back a slice returned by tick, for reuse.
func (w *flushWheel) recycle(due []flushEntry) {
	clear(due)
	w.mu.Lock()
	if cap(due) > cap(w.spare) {
		w.spare = due[:0]
	}
	w.mu.Unlock()
}

// armFlush makes key's owner write its unwritten async changes within
// the async interval (the owner asked with action.arm).
func (t *Table) armFlush(key string, e *Entry) {
	if t.flush.add(key, e) {
		t.scheduleTick()
	}
}

// scheduleTick ticks the wheel after a slot's share of the interval; each
// tick schedules the next until the wheel stops (nothing armed).
func (t *Table) scheduleTick() {
	period := max(t.cfg.AsyncInterval/flushSlots, time.Microsecond)
	t.cfg.Runtime.AfterFunc(period, func() {
		due, stop := t.flush.tick()
		if stop {
			return
		}
		t.scheduleTick()
		for _, f := range due {
			t.flushKey(f.key, f.e)
		}
		t.flush.recycle(due)
	})
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
