package journal

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/fail"
)

// New-key checks. The first write of a key the journal holds no record of
// expects revision 0 and is checked against the state bucket before it is
// journalled: the key must have no record there (a delete or TTL marker is
// fine: the write then expects the marker's revision), else it loses (a
// conflict: the key's owner reads the key and decides again). These checks
// are batched: one floor read of up to kvstate.MaxManyKeys keys at a time,
// from a replica holding every write of those keys (the partitions' claim
// floors and this node's own writes); the checks that come meanwhile form
// the next batch. A batch whose read fails (a timeout, a replica behind the
// floor checkTries times, an answer cut short) is checked key by key with
// leader reads, as are keys of partitions without a floor.

// checkTries is how many times a batch of new-key checks is read from a
// replica behind its floor before it is checked key by key.
const checkTries = 3

type checker struct {
	j *Journal

	mu      sync.Mutex
	queue   []*write
	running bool // a batch read is out
}

// add queues w (a write expecting revision 0 of a partition with a floor)
// for the next batch.
func (c *checker) add(w *write) {
	c.mu.Lock()
	c.queue = append(c.queue, w)
	start := !c.running
	c.running = true
	c.mu.Unlock()
	if start {
		c.next()
	}
}

// next sends the next batch's read, or stops when none is waiting.
func (c *checker) next() {
	c.mu.Lock()
	n := min(len(c.queue), kvstate.MaxManyKeys)
	if n == 0 {
		c.running = false
		c.mu.Unlock()
		return
	}
	batch := slices.Clone(c.queue[:n])
	rest := copy(c.queue, c.queue[n:])
	clear(c.queue[rest:])
	c.queue = c.queue[:rest]
	c.mu.Unlock()
	latest := batch[0].deadline
	keys := make([]string, len(batch))
	parts := make([]int, len(batch))
	for i, w := range batch {
		latest = later(latest, w.deadline)
		keys[i], parts[i] = w.key, w.part
	}
	c.read(batch, keys, c.j.floors.floorOf(parts), latest, 1)
}

// read sends the floor read of one batch (try is its number); then the
// next batch.
func (c *checker) read(batch []*write, keys []string, floor uint64, latest time.Time, try int) {
	j := c.j
	j.checkReads.Add(1)
	j.cfg.Bucket.GetManyAsyncFloor(keys, j.floors.key, floor, j.until(latest), func(recs []kvstate.KeyRecord, err error) {
		if errors.Is(err, kvstate.ErrStale) && try < checkTries && j.until(latest) > 2*floorRetry {
			j.rt.AfterFunc(floorRetry, func() { c.read(batch, keys, floor, latest, try+1) })
			return
		}
		if err != nil {
			j.log.Debug("journal: batched key check failed, checking one by one", "keys", len(batch), "error", err.Error())
			for _, w := range batch {
				c.one(w)
			}
		} else {
			absent := make([]*write, 0, len(batch))
			for i, w := range batch {
				if recs[i].Live {
					w.done(0, kvstate.ErrConflict)
					continue
				}
				w.kvRev, w.kvKnown = recs[i].Rev, true
				absent = append(absent, w)
			}
			if len(absent) > 0 {
				j.w.enqueue(absent...)
			}
		}
		c.next()
	})
}

// one checks the key of new-key write w against the state bucket with a
// leader read, then journals it or fails it.
func (c *checker) one(w *write) {
	j := c.j
	timeout := j.until(w.deadline)
	if timeout <= 0 {
		w.done(0, fmt.Errorf("%w: journal write: deadline passed", fail.ErrUnavailable))
		return
	}
	j.checkOne.Add(1)
	j.cfg.Bucket.GetAsync(w.key, timeout, func(_ []byte, r uint64, err error) {
		switch {
		case err == nil:
			w.done(0, kvstate.ErrConflict)
		case errors.Is(err, kvstate.ErrNotFound):
			w.kvRev, w.kvKnown = r, true
			j.w.enqueue(w)
		default:
			w.done(0, err)
		}
	})
}
