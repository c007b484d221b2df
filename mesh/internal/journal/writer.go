package journal

import (
	"errors"

	"fmt"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"maps"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/fail"
)

// The writer appends batches to this node's subject, one message at a
// time, each expecting the subject's last sequence: the records changed
// while an append is in flight go into the next one, so a message carries
// more records as the load grows. A write is acknowledged when its
// message is. An append that fails (refused because another message came
// first, or with an unknown outcome) is resolved by reading the subject
// after the last known sequence: the batch's nonce shows whether it
// landed, and a fence of another node shows which partitions were taken
// away (invariant J1: after a fence, no batch of the fenced owner for that
// partition commits).
//
// Retention. Every message carries a time to live: until the latest
// instant any record this node has appended so far must be kept
// (keyrec.Retention.KeepUntil of its RestAt; the state TTL for a message
// with no record), so the subject's messages expire oldest first, as they
// would by an age limit, and none expires before the records in it (and
// in any message before it) come to rest. A dead node's journal is thus
// kept until its next owner would no longer need it, however long no node
// runs.

// write is a key write waiting for its batch, or (fence != nil) a tenure
// marker appended on its own, or (barrier) an empty batch appended on its
// own, whose sequence bounds everything this node appended before it.
type write struct {
	fence    *fence
	barrier  bool
	key      string
	val      []byte
	usage    []keyrec.Usage // the admissions the record spends (their usage records)
	part     int
	gen      uint64 // the partition's generation when the write came
	kvRev    uint64
	kvKnown  bool
	deadline time.Time
	done     func(rev uint64, err error)
}

type writer struct {
	j *Journal

	mu      sync.Mutex
	pending []*write
	busy    bool   // an append (or its resync) is in flight
	last    uint64 // the last sequence of the subject this node knows of
	stopped bool
	buf     []byte
	nonce   uint64 // the next batch's nonce
	// keep is the instant (Unix ns) until which the messages appended so
	// far must be kept (see Retention above); it never decreases.
	keep int64
}

// enqueue adds writes to the next batch.
func (w *writer) enqueue(ws ...*write) {
	w.mu.Lock()
	w.pending = append(w.pending, ws...)
	w.mu.Unlock()
	w.kick()
}

// keepUntil returns the instant (Unix ns) until which the messages this
// node appended so far must be kept.
func (w *writer) keepUntil() int64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.keep
}

// lastSeq returns the last sequence of the subject this node knows of.
func (w *writer) lastSeq() uint64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.last
}

// stop fails the pending writes; later ones fail at once.
func (w *writer) stop() {
	w.mu.Lock()
	w.stopped = true
	p := w.pending
	w.pending = nil
	w.mu.Unlock()
	for _, x := range p {
		x.done(0, fmt.Errorf("%w: node stopping", fail.ErrUnavailable))
	}
}

// kick starts the next batch unless one is in flight.
func (w *writer) kick() {
	for {
		w.mu.Lock()
		if w.busy || len(w.pending) == 0 {
			w.mu.Unlock()
			return
		}
		if w.stopped {
			w.mu.Unlock()
			w.stop()
			return
		}
		w.busy = true
		batch, expired, stale := w.take()
		w.mu.Unlock()
		for _, x := range expired {
			x.done(0, fmt.Errorf("%w: journal write: deadline passed", fail.ErrUnavailable))
		}
		for _, x := range stale {
			x.done(0, kvstate.ErrConflict)
		}
		if len(batch) > 0 {
			w.attempt(batch, 0, nil)
			return
		}
		w.mu.Lock()
		w.busy = false
		w.mu.Unlock()
	}
}

// idle ends the batch in flight and starts the next.
func (w *writer) idle() {
	w.mu.Lock()
	w.busy = false
	w.mu.Unlock()
	w.kick()
}

// take removes the next batch from the pending writes (at most
// maxBatchBytes, at least one write), with the writes whose deadline
// passed and those of a partition that changed hands meanwhile (w.mu
// held).
func (w *writer) take() (batch, expired, stale []*write) {
	now := w.j.now()
	size, i := 0, 0
	for ; i < len(w.pending); i++ {
		x := w.pending[i]
		if now.After(x.deadline) {
			expired = append(expired, x)
			continue
		}
		if x.gen != w.j.recs.genOf(x.part) {
			stale = append(stale, x)
			continue
		}
		if x.fence != nil || x.barrier {
			// A marker or barrier is a message of its own, between the
			// batches queued before and after it.
			if len(batch) == 0 {
				batch = append(batch, x)
				i++
			}
			break
		}
		if len(batch) > 0 && size+len(x.key)+len(x.val)+8 > maxBatchBytes {
			break
		}
		size += len(x.key) + len(x.val) + 8
		batch = append(batch, x)
	}
	rest := copy(w.pending, w.pending[i:])
	clear(w.pending[rest:])
	w.pending = w.pending[:rest]
	return batch, expired, stale
}

// attempt appends batch (the n'th attempt; lastErr is why the previous one
// failed). A write is answered by its deadline: one whose batch is not
// known to be committed by then fails (its outcome may be unknown: a
// strict call then gets a 503, never an admission that was not recorded).
func (w *writer) attempt(batch []*write, n int, lastErr error) {
	now := w.j.now()
	keep := batch[:0]
	for _, x := range batch {
		if n > 0 && (n == commitRetries || w.j.stopped.Load() || !now.Before(x.deadline)) {
			x.done(0, fmt.Errorf("%w: journal write: %v", fail.ErrUnavailable, lastErr))
			continue
		}
		keep = append(keep, x)
	}
	batch = keep
	if len(batch) == 0 {
		w.idle()
		return
	}
	deadline := now.Add(w.j.cfg.Timeout)
	latest := batch[0].deadline
	for _, x := range batch {
		latest = later(latest, x.deadline)
	}
	if latest.Before(deadline) {
		deadline = latest
	}
	w.mu.Lock()
	last := w.last
	ret, at := w.j.cfg.Retention, now.UnixNano()
	w.keep = max(w.keep, ret.KeepUntil(0, at))
	for _, x := range batch {
		if x.fence == nil && !x.barrier {
			rest, _ := keyrec.PeekRestAt(x.val)
			w.keep = max(w.keep, ret.KeepUntil(rest, at))
		}
	}
	ttl := ret.TTLAt(w.keep, at)
	var nonce uint64
	if f := batch[0].fence; f != nil {
		// No nonce: after an unknown outcome the marker is appended
		// again, which is harmless.
		w.buf = appendFence(w.buf[:0], *f)
	} else {
		if w.nonce == 0 {
			w.nonce = rand.Uint64() | 1
		}
		nonce = w.nonce
		w.nonce++
		items := make([]item, 0, len(batch))
		for _, x := range batch {
			if !x.barrier {
				items = append(items, item{key: x.key, val: x.val, usage: x.usage})
			}
		}
		w.buf = appendBatch(w.buf[:0], nonce, w.j.cfg.Boot, items)
	}
	data := w.buf
	w.mu.Unlock()
	w.j.cfg.Stream.Append(w.j.subj, data, last, ttl, deadline.Sub(now), func(seq uint64, err error) {
		// Off the stream's callback goroutine: the answers run the key
		// owners' next batches and replies.
		w.j.rt.Go(func() {
			if err == nil {
				w.committed(batch, seq)
				w.idle()
				return
			}
			w.resync(batch, n, last, nonce, deadline, err)
		})
	})
}

// committed records batch committed at seq and answers its writes. The
// answers run before the next batch is taken: the writes they start (the
// calls that queued on these keys) join that batch.
func (w *writer) committed(batch []*write, seq uint64) {
	w.mu.Lock()
	w.last = max(w.last, seq)
	w.mu.Unlock()
	n := w.j.recs.commit(batch, seq, w.j.now().UnixNano())
	w.j.appends.Add(1)
	w.j.committedRecords.Add(n)
	if sink := w.j.cfg.Usage; sink != nil {
		// The usage of the admissions the batch spends, in message order
		// (their ids are the message's sequence and their index).
		var idx uint32
		for _, x := range batch {
			for i := range x.usage {
				sink.Add(w.j.cfg.Self, w.j.cfg.Boot, seq, idx, x.key, x.val, &x.usage[i])
				idx++
			}
		}
	}
	for _, x := range batch {
		x.done(tagRev(seq|journalRevBit, x.gen), nil)
	}
}

// resync reads this node's subject after last, where an append of batch
// (with nonce) failed with err: if the batch landed it is committed;
// writes of partitions fenced away from this node fail as fenced (and the
// node stops serving those partitions at once); the rest is appended
// again.
func (w *writer) resync(batch []*write, n int, last, nonce uint64, deadline time.Time, err error) {
	timeout := min(w.j.cfg.Timeout, w.j.until(later(deadline, w.j.now().Add(50*time.Millisecond))))
	w.j.cfg.Stream.Last(w.j.subj, timeout, func(end uint64, lerr error) {
		if lerr != nil {
			w.attempt(batch, n+1, errors.Join(err, lerr))
			return
		}
		var landed uint64
		lost := map[int]string{}
		scan := func(seq uint64, data []byte) error {
			m, derr := decode(data)
			switch {
			case derr != nil:
				w.j.log.Warn("corrupt journal message", "subject", w.j.subj, "seq", seq, "error", derr.Error())
			case m.fence != nil:
				f := m.fence
				if f.node != w.j.cfg.Self && f.part < w.j.cfg.Parts &&
					(f.epoch > w.j.cfg.View.Epoch(f.part) || !w.j.cfg.View.Serving(f.part)) {
					lost[f.part] = f.node
				}
			case nonce != 0 && m.nonce == nonce:
				landed = seq
			}
			return nil
		}
		finish := func(rerr error) {
			if rerr != nil {
				w.attempt(batch, n+1, errors.Join(err, rerr))
				return
			}
			// end < last when the subject's messages expired (the
			// stream's age limit, after a long idle time): expect what is
			// there now.
			w.mu.Lock()
			w.last = end
			w.mu.Unlock()
			for _, p := range slices.Sorted(maps.Keys(lost)) {
				by := lost[p]
				w.j.log.Warn("partition fenced by its new owner", "partition", p, "owner", by)
				if w.j.cfg.OnFenced != nil {
					w.j.cfg.OnFenced(p, by)
				}
			}
			if landed != 0 {
				w.committed(batch, landed)
				w.idle()
				return
			}
			keep := batch[:0]
			for _, x := range batch {
				if _, ok := lost[x.part]; ok {
					x.done(0, fmt.Errorf("%w (journal fenced)", fail.ErrFenced))
					continue
				}
				keep = append(keep, x)
			}
			w.attempt(keep, n+1, err)
		}
		if end <= last {
			finish(nil)
			return
		}
		w.j.cfg.Stream.Read(w.j.subj, last+1, end, timeout, scan, finish)
	})
}
