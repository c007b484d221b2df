package journal

import (
	"cmp"
	"errors"
	"fmt"
	"math"

	"github.com/limitmesh/limitmesh/mesh/internal/fail"
	"strconv"
	"sync"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
)

// Checkpoints. Every checkpoint interval the node writes the records
// journalled since its last checkpoint to the state bucket, each a
// compare-and-swap on the key's revision (read first when unknown), then
// records its mark (key _journal.<node id> of the state bucket, a decimal
// sequence: every journal message up to it is checkpointed) and purges its
// subject below the mark. The message at the mark stays: it is the
// subject's last sequence when nothing was appended since, which the next
// append expects. The mark never passes a record that is not in the state
// bucket, that is pinned, or that is an orphan (invariant J3).
//
// Retention (docs/protocol.md, "State retention"). A checkpointed record
// carries its own time to live in the state bucket, computed when it is
// written (keyrec.Retention.TTLOf: the state TTL, or until the record comes
// to rest); the mark is kept as long as the journal messages it covers
// (writer.keepUntil), so a reader never finds messages the mark passed
// without the mark.

type checkpointer struct {
	j *Journal

	mu      sync.Mutex
	busy    bool
	waiting []ckRequest
	mark    uint64 // batches up to it are checkpointed
}

type ckRequest struct {
	part int // -1: every partition served
	// held reports whether this node still holds part's lease (nil: the
	// partition of each key is served, View.Serving).
	held func() bool
	done func(error)
}

// ownMark returns this node's mark.
func (c *checkpointer) ownMark() uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.mark
}

// schedule runs a checkpoint of every served partition after the
// checkpoint interval, then schedules the next.
func (c *checkpointer) schedule() {
	c.j.rt.AfterFunc(c.j.cfg.CheckpointInterval, func() {
		if c.j.stopped.Load() {
			return
		}
		c.run(-1, nil, func(err error) {
			if err != nil {
				c.j.log.Warn("checkpoint incomplete", "error", err.Error())
			}
			c.j.rd.expire()
			c.schedule()
		})
	})
}

// run checkpoints partition part (-1: every partition this node serves)
// and advances the mark, one checkpoint at a time (a key is written by
// one); done gets the first failure.
func (c *checkpointer) run(part int, held func() bool, done func(error)) {
	req := ckRequest{part, held, done}
	c.mu.Lock()
	if c.busy {
		c.waiting = append(c.waiting, req)
		c.mu.Unlock()
		return
	}
	c.busy = true
	c.mu.Unlock()
	c.start(req)
}

// finished ends a checkpoint and starts the next one waiting.
func (c *checkpointer) finished(req ckRequest, err error) {
	req.done(err)
	c.mu.Lock()
	if len(c.waiting) == 0 {
		c.busy = false
		c.mu.Unlock()
		return
	}
	next := c.waiting[0]
	c.waiting = c.waiting[1:]
	c.mu.Unlock()
	c.start(next)
}

func (c *checkpointer) start(req ckRequest) {
	j := c.j
	list := j.recs.dirty(req.part, j.cfg.View.Serving)
	tasks := j.open.checkpointing(list, req.part, j.cfg.View.Serving)
	heldOf := func(p int) func() bool {
		if req.held != nil {
			return req.held
		}
		return func() bool { return j.cfg.View.Serving(p) }
	}
	revs := make([]uint64, len(list))
	errs := make([]error, len(list))
	var (
		mu       sync.Mutex
		next     int
		inflight int
		ended    bool
	)
	var step func()
	step = func() {
		mu.Lock()
		for inflight < checkpointParallel && next < len(list) && !j.stopped.Load() {
			i := next
			t := list[i]
			next++
			inflight++
			mu.Unlock()
			c.writeRecord(t.key, t.val, t.rev, t.known, heldOf(t.e.part), func(rev uint64, err error) {
				if err == nil {
					j.floors.raise(rev)
					j.checkpoints.Add(1)
				}
				mu.Lock()
				revs[i], errs[i] = rev, err
				inflight--
				mu.Unlock()
				step()
			})
			mu.Lock()
		}
		if ended || inflight > 0 || (next < len(list) && !j.stopped.Load()) {
			mu.Unlock()
			return
		}
		ended = true
		written := next // the journal stopped before the others
		mu.Unlock()
		c.saveIndexes(tasks, heldOf, func(saved map[int]uint64, idxErr error) {
			failed, kept := 0, 0
			var firstErr error
			for i, t := range list[:written] {
				// A record is checkpointed once its partition's index, as
				// of it, is written too (J17): until then it stays dirty,
				// so the mark does not pass it.
				keep := errs[i] == nil && saved[t.e.part] != t.gen
				j.recs.checkpointed(t, revs[i], errs[i], keep)
				switch {
				case errs[i] != nil:
					failed++
					firstErr = cmp.Or(firstErr, errs[i])
				case keep:
					kept++
				}
			}
			var err error
			if failed > 0 {
				err = fmt.Errorf("%d of %d records not checkpointed: %v", failed, len(list), firstErr)
			}
			if idxErr != nil {
				err = errors.Join(err, fmt.Errorf("%d records kept in the journal: %w", kept, idxErr))
			}
			c.advanceMark(func() { c.finished(req, err) })
		})
	}
	step()
}

// saveIndexes writes the open-reservation index of each task's partition
// (when it changed) and reports the tenure of each written or unchanged
// one, and the first failure.
func (c *checkpointer) saveIndexes(tasks []indexTask, heldOf func(int) func() bool, done func(saved map[int]uint64, err error)) {
	j := c.j
	saved := make(map[int]uint64, len(tasks))
	if len(tasks) == 0 {
		done(saved, nil)
		return
	}
	var (
		mu       sync.Mutex
		left     = len(tasks)
		firstErr error
	)
	for _, tk := range tasks {
		j.open.save(tk.part, tk.gen, heldOf(tk.part), j.cfg.Timeout, func(err error) {
			mu.Lock()
			if err == nil {
				saved[tk.part] = tk.gen
			} else if firstErr == nil {
				firstErr = err
			}
			left--
			last := left == 0
			mu.Unlock()
			if last {
				done(saved, firstErr)
			}
		})
	}
}

// writeRecord writes val as key's record in the state bucket with a
// compare-and-swap on rev (read first when not known). A lost
// compare-and-swap is retried once after a read. It writes only with a
// revision read or written while this node holds the key's partition
// (held): before a read or a write starts, and when a read's answer
// arrives, held must be true, so no record of a node whose lease lapsed
// ever lands over a newer owner's (invariant J9).
func (c *checkpointer) writeRecord(key string, val []byte, rev uint64, known bool, held func() bool, done func(uint64, error)) {
	ttl := func() time.Duration { return c.j.cfg.Retention.TTLOf(val, c.j.now().UnixNano()) }
	c.writeKey(key, val, ttl, rev, known, held, done)
}

// writeKey is writeRecord with the time to live ttl computes at each
// write.
func (c *checkpointer) writeKey(key string, val []byte, ttl func() time.Duration, rev uint64, known bool, held func() bool, done func(uint64, error)) {
	j := c.j
	lapsed := func() { done(0, fmt.Errorf("%w: the partition's lease lapsed", fail.ErrFenced)) }
	var write func(rev uint64, retry bool)
	reread := func() {
		if !held() {
			lapsed()
			return
		}
		j.cfg.Bucket.GetAsync(key, j.cfg.Timeout, func(_ []byte, r uint64, err error) {
			if err != nil && !errors.Is(err, kvstate.ErrNotFound) {
				done(0, err)
				return
			}
			write(r, false)
		})
	}
	write = func(rev uint64, retry bool) {
		if !held() {
			lapsed()
			return
		}
		j.cfg.Bucket.UpdateAsync(key, val, rev, ttl(), j.cfg.Timeout, func(nrev uint64, err error) {
			if errors.Is(err, kvstate.ErrConflict) && retry {
				reread()
				return
			}
			done(nrev, err)
		})
	}
	if !known {
		reread()
		return
	}
	write(rev, true)
}

// advanceMark records how far this node's journal is checkpointed and
// purges it up to there; it also forgets checkpointed records idle for an
// interval.
//
// A record its owner has not seen (an unknown outcome that landed) is kept
// while an owner may still write over an older read of its key (J14): a
// key owner whose state expires writes with the first batch after a load
// (a keep-alive), and drops a key idle for at most half the state TTL, so
// such a record is forgotten once idle for half the retention floor (the
// state TTL), before its record can expire from the bucket (a create over
// an expired record then meets no record in memory); without retention,
// while the partition is held.
func (c *checkpointer) advanceMark(done func()) {
	j := c.j
	now := j.now()
	idle := now.Add(-j.cfg.CheckpointInterval).UnixNano()
	idleUnseen := int64(math.MinInt64)
	if f := j.cfg.Retention.Floor; f > 0 {
		idleUnseen = now.Add(-max(f/2, j.cfg.CheckpointInterval)).UnixNano()
	}
	m := j.recs.markLimit(j.w.lastSeq(), idle, idleUnseen)
	old := c.ownMark()
	if m <= old || j.stopped.Load() {
		done()
		return
	}
	put := func() {
		ttl := j.cfg.Retention.TTLAt(j.w.keepUntil(), j.now().UnixNano())
		j.cfg.Bucket.PutAsync(markPrefix+j.cfg.Self, strconv.AppendUint(nil, m, 10), ttl, j.cfg.Timeout, func(_ uint64, err error) {
			if err != nil {
				j.log.Warn("recording the journal mark", "error", err.Error())
				done()
				return
			}
			j.log.Debug("journal mark advanced", "from", old, "to", m)
			c.mu.Lock()
			c.mark = max(c.mark, m)
			c.mu.Unlock()
			j.cfg.Stream.Purge(j.subj, m, j.cfg.Timeout, func(err error) {
				if err != nil {
					j.log.Debug("purging the journal", "error", err.Error())
				}
				done()
			})
		})
	}
	sink := j.cfg.Usage
	if sink == nil {
		put()
		return
	}
	// The usage of every admission up to the mark must be published
	// before the messages holding it may be purged.
	sink.Sync(func(err error) {
		if err != nil {
			j.log.Warn("usage not published yet; the journal mark waits", "error", err.Error())
			done()
			return
		}
		put()
	})
}

// markOf returns node id's mark: this node's own, or the one id recorded
// in the state bucket (0 when it has none) and the revision it was read
// at (0 for this node's own: its writes raise its read floors).
func (c *checkpointer) markOf(id string, timeout time.Duration, done func(mark, rev uint64, err error)) {
	if id == c.j.cfg.Self {
		done(c.ownMark(), 0, nil)
		return
	}
	c.j.cfg.Bucket.GetAsync(markPrefix+id, timeout, func(val []byte, rev uint64, err error) {
		if errors.Is(err, kvstate.ErrNotFound) {
			done(0, rev, nil)
			return
		}
		if err != nil {
			done(0, 0, err)
			return
		}
		m, perr := strconv.ParseUint(string(val), 10, 64)
		if perr != nil {
			done(0, 0, fmt.Errorf("%w: journal mark of %s: %q", ErrCorrupt, id, val))
			return
		}
		done(m, rev, nil)
	})
}
