package keys

import (
	"sync"
	"time"

	"github.com/limitmesh/limitmesh/mesh/internal/rt"
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

// flusher ticks a node's flushWheel on the runtime and hands each due
// key to flush (the table's flushKey, which drives the key's owner).
type flusher struct {
	wheel  flushWheel
	rt     rt.Runtime
	period time.Duration // a slot's share of the async interval
	flush  func(key string, e *Entry)
}

func newFlusher(r rt.Runtime, interval time.Duration, flush func(string, *Entry)) *flusher {
	return &flusher{rt: r, period: max(interval/flushSlots, time.Microsecond), flush: flush}
}

// arm makes key's owner write its unwritten async changes within the
// async interval (the owner asked with action.arm).
func (f *flusher) arm(key string, e *Entry) {
	if f.wheel.add(key, e) {
		f.schedule()
	}
}

// schedule ticks the wheel after a slot's share of the interval; each
// tick schedules the next until the wheel stops (nothing armed).
func (f *flusher) schedule() {
	f.rt.AfterFunc(f.period, func() {
		due, stop := f.wheel.tick()
		if stop {
			return
		}
		f.schedule()
		for _, d := range due {
			f.flush(d.key, d.e)
		}
		f.wheel.recycle(due)
	})
}
