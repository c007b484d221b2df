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
	fence   *fence
	barrier bool
	key     string
	val     []byte
	usage   []keyrec.Usage // the admissions the record spends (their usage records)
	part    int
	gen     uint64 // the partition's generation when the write came
	kvRev   uint64
	kvKnown bool
	// expect is the (tagged) revision the write expects, 0 for a create
	// (checked against the bucket, checks.go), a fence or a barrier.
	expect   uint64
	deadline time.Time
	done     func(rev uint64, err error)
	failed   bool // answered with an error (the writer's)
}

type writer struct {
	j *Journal

	mu      sync.Mutex
	pending []*write
	busy    bool   // an append (or its resync) is in flight
	last    uint64 // the last sequence of the subject this node knows of
	stopped bool
	buf     []byte // the last message built (a batch ends before the next is built)
	nonce   uint64 // the next batch's nonce
	// keep is the instant (Unix ns) until which the messages appended so
	// far must be kept (see Retention above); it never decreases.
	keep int64
	// abandoned holds frozen flights that no write waits on any more
	// (each failed its deadline) and that may still land, as the
	// subject's next message after the one they expected: the resync that
	// finds one commits it (its records and usage), before anything after
	// it (invariant J15). A flight is dropped once the subject has a
	// message after the one it expected.
	abandoned []*flight
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
			w.attempt(&flight{writes: batch}, 0, nil)
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
		if w.j.recs.stale(x) {
			// Of an older generation of its partition, or expecting a
			// record that a later commit of the key replaced (J14): a
			// conflict.
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

// flight is a batch being appended: its writes and the message built
// from them, with its nonce. After an append with an unknown outcome the
// message may still land, at the position it expected (the sequence after
// the one it expected), until another message takes that position; while
// it may (frozen), every attempt sends the same message, so whichever
// attempt lands is recognised by the nonce, and what the node commits is
// what the journal holds (the records and the ids of their usage). Once a
// resync sees that position taken by another message, no attempt of the
// batch can land any more: its content may change (writes whose deadline
// passed or whose partition was fenced away leave it) under a new nonce
// (invariant J13).
type flight struct {
	writes []*write
	data   []byte
	nonce  uint64
	frozen bool
	expect uint64 // the subject's last sequence its latest append expected
}

// attempt appends f (the n'th attempt; lastErr is why the previous one
// failed). A write is answered by its deadline: one whose batch is not
// known to be committed by then fails (its outcome may be unknown: a
// strict call then gets a 503, never an admission that was not recorded);
// a frozen message keeps it, since it may land.
func (w *writer) attempt(f *flight, n int, lastErr error) {
	now := w.j.now()
	live := 0
	var latest time.Time
	for _, x := range f.writes {
		if x.failed {
			continue
		}
		if n > 0 && (n == commitRetries || w.j.stopped.Load() || !now.Before(x.deadline)) {
			x.failed = true
			x.done(0, fmt.Errorf("%w: journal write: %v", fail.ErrUnavailable, lastErr))
			continue
		}
		if n > 0 && !f.frozen && x.expect != 0 && w.j.recs.superseded(x.key, x.expect) {
			// The batch will be built again; meanwhile a commit the
			// write did not expect replaced its record (an abandoned
			// batch that landed, J15): a conflict (J14).
			x.failed = true
			x.done(0, kvstate.ErrConflict)
			continue
		}
		if live == 0 || x.deadline.After(latest) {
			latest = x.deadline
		}
		live++
	}
	if live == 0 {
		// Nothing waits for the batch. If it was frozen it may still
		// land: the next batch's append, expecting the same sequence,
		// then fails, and its resync finds it and commits it (J15).
		if f.frozen && f.nonce != 0 {
			w.mu.Lock()
			w.abandoned = append(w.abandoned, f)
			w.mu.Unlock()
		}
		w.idle()
		return
	}
	deadline := now.Add(w.j.cfg.Timeout)
	if latest.Before(deadline) {
		deadline = latest
	}
	w.mu.Lock()
	last := w.last
	f.expect = last
	ret, at := w.j.cfg.Retention, now.UnixNano()
	w.keep = max(w.keep, ret.KeepUntil(0, at))
	for _, x := range f.writes {
		if x.fence == nil && !x.barrier {
			rest, _ := keyrec.PeekRestAt(x.val)
			w.keep = max(w.keep, ret.KeepUntil(rest, at))
		}
	}
	ttl := ret.TTLAt(w.keep, at)
	if !f.frozen {
		f.writes = slices.DeleteFunc(f.writes, func(x *write) bool { return x.failed })
		f.build(w)
	}
	data := f.data
	w.mu.Unlock()
	w.j.cfg.Stream.Append(w.j.subj, data, last, ttl, deadline.Sub(now), func(seq uint64, err error) {
		if err == nil {
			// On the stream's callback goroutine: an acknowledgement
			// never comes from within Append, and the answers only start
			// operations (the key owners' next writes, replies). A
			// goroutine per batch cost more than the answers' wait: a new
			// goroutine grows its stack to the answers' depth every time
			// (about a tenth of their CPU in limitmesh bench).
			w.committed(f.writes, seq)
			w.idle()
			return
		}
		// Off the callback goroutine: the resync reads the stream.
		w.j.rt.Go(func() {
			f.frozen = true
			w.resync(f, n, last, deadline, err)
		})
	})
}

// build encodes f's writes as a new message with a new nonce (w.mu held).
func (f *flight) build(w *writer) {
	if fc := f.writes[0].fence; fc != nil {
		// No nonce: after an unknown outcome the marker is appended
		// again, which is harmless.
		f.nonce, f.data = 0, appendFence(w.buf[:0], *fc)
		w.buf = f.data
		return
	}
	if w.nonce == 0 {
		w.nonce = rand.Uint64() | 1
	}
	f.nonce = w.nonce
	w.nonce++
	items := make([]item, 0, len(f.writes))
	for _, x := range f.writes {
		if !x.barrier {
			items = append(items, item{key: x.key, val: x.val, usage: x.usage})
		}
	}
	f.data = appendBatch(w.buf[:0], f.nonce, w.j.cfg.Boot, items)
	w.buf = f.data
}

// committed records batch committed at seq and answers its writes (those
// not answered already: a frozen message keeps writes that failed their
// deadline, and their records landed with it). The answers run before the
// next batch is taken: the writes they start (the calls that queued on
// these keys) join that batch.
//
// The records are marked dirty and their usage queued before the writer's
// last sequence reaches seq: the checkpointer bounds the mark by that
// sequence and by the dirty records, and syncs the usage queued before it
// reads them, so no mark covers seq before both are in view (else the
// mark could pass records never checkpointed, or usage that its node, if
// it died then, never published and no reader would read again).
func (w *writer) committed(batch []*write, seq uint64) {
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
	w.mu.Lock()
	w.last = max(w.last, seq)
	w.settleAbandoned(seq)
	w.mu.Unlock()
	for _, x := range batch {
		if !x.failed {
			x.done(tagRev(seq|journalRevBit, x.gen), nil)
		}
	}
}

// resync reads this node's subject after last, where an append of f
// failed with err: if f landed it is committed; otherwise, when another
// message took the position f expected, f can no longer land: writes of
// partitions fenced away from this node fail as fenced (and the node stops
// serving those partitions at once), and the rest is appended again as a
// new message. While the position is free (or the read fails), f may still
// land and is appended again as it is.
func (w *writer) resync(f *flight, n int, last uint64, deadline time.Time, err error) {
	timeout := min(w.j.cfg.Timeout, w.j.until(later(deadline, w.j.now().Add(50*time.Millisecond))))
	nonce := f.nonce
	w.j.cfg.Stream.Last(w.j.subj, timeout, func(end uint64, lerr error) {
		if lerr != nil {
			w.attempt(f, n+1, errors.Join(err, lerr))
			return
		}
		var landed uint64
		var found []foundFlight // abandoned flights that landed (J15)
		lost := map[int]fence{} // per partition, the latest fence of another node
		scan := func(seq uint64, data []byte) error {
			m, derr := decode(data)
			switch {
			case derr != nil:
				w.j.log.Warn("corrupt journal message", "subject", w.j.subj, "seq", seq, "error", derr.Error())
			case m.fence != nil:
				fc := m.fence
				if fc.node != w.j.cfg.Self && fc.part < w.j.cfg.Parts &&
					(fc.epoch > w.j.cfg.View.Epoch(fc.part) || !w.j.cfg.View.Serving(fc.part)) &&
					fc.epoch >= lost[fc.part].epoch {
					lost[fc.part] = *fc
				}
			case nonce != 0 && m.nonce == nonce:
				landed = seq
			case m.nonce != 0:
				if af := w.abandonedAt(m.nonce, seq); af != nil {
					found = append(found, foundFlight{af, seq})
				}
			}
			return nil
		}
		finish := func(rerr error) {
			if rerr != nil {
				w.attempt(f, n+1, errors.Join(err, rerr))
				return
			}
			// end < last when the subject's messages expired (the
			// stream's age limit, after a long idle time): expect what is
			// there now.
			// Abandoned flights that landed, in order, before anything
			// after them (J15).
			for _, ff := range found {
				w.committed(ff.f.writes, ff.seq)
			}
			setLast := func() {
				w.mu.Lock()
				w.last = end
				w.settleAbandoned(end)
				w.mu.Unlock()
			}
			for _, p := range slices.Sorted(maps.Keys(lost)) {
				fc := lost[p]
				// Every write of p's tenure fails from here on, not only
				// f's: the writes queued behind f would otherwise go out
				// next, expecting a sequence at or past the fence, and
				// commit after it (J1).
				w.j.recs.fenced(p, fc.epoch)
				w.j.log.Warn("partition fenced by its new owner", "partition", p, "owner", fc.node)
				if w.j.cfg.OnFenced != nil {
					w.j.cfg.OnFenced(p, fc.node)
				}
			}
			if landed != 0 {
				// The last sequence moves past f only once f is
				// committed (see committed).
				w.committed(f.writes, landed)
				setLast()
				w.idle()
				return
			}
			setLast()
			if end > last {
				// The position f expected holds another message: f did
				// not land and never will.
				f.frozen = false
				for _, x := range f.writes {
					if _, ok := lost[x.part]; ok && !x.failed {
						x.failed = true
						x.done(0, fmt.Errorf("%w (journal fenced)", fail.ErrFenced))
					}
				}
			}
			w.attempt(f, n+1, err)
		}
		if end <= last {
			finish(nil)
			return
		}
		w.j.cfg.Stream.Read(w.j.subj, last+1, end, timeout, scan, finish)
	})
}

// foundFlight is an abandoned flight a resync found landed at seq.
type foundFlight struct {
	f   *flight
	seq uint64
}

// abandonedAt returns the abandoned flight with nonce that landed at seq
// (a message of this node's subject after the one it expected: the
// stream's sequences are shared by every node's subject, so its place is
// the subject's next message, not the sequence after); nil if none.
func (w *writer) abandonedAt(nonce, seq uint64) *flight {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, f := range w.abandoned {
		if f.nonce == nonce && f.expect < seq {
			return f
		}
	}
	return nil
}

// settleAbandoned drops the abandoned flights that expected a sequence
// below seq, a message of this node's subject: the subject's next message
// after the one they expected exists (theirs, committed, or another), so
// they can no longer land (w.mu held).
func (w *writer) settleAbandoned(seq uint64) {
	w.abandoned = slices.DeleteFunc(w.abandoned, func(f *flight) bool { return f.expect < seq })
}
