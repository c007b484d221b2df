package journal

import (
	"fmt"

	"maps"
	"slices"
	"sync"
	"time"

	"github.com/limitmesh/limitmesh/internal/bugs"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
)

// Handing partitions over: the journal's side of ownership.Lifecycle.
//
// Fencing and adoption (invariant J1, J2). A node that claims a partition
// fences each journal its claim names as a source (appends a fence to the
// source's subject; for its own journal a barrier through its own writer)
// and reads it from the source's mark up to that fence or barrier: the
// source's next append fails its expected sequence, so no batch of the old
// owner commits after the fence, and the new owner has read every record
// the old owner committed. It appends the latest record of each of the
// partition's keys (later sources win) to its own journal, so whoever takes
// over from it finds them there, before it serves the partition. Of the
// records of a key in several sources, the one with the highest version is
// adopted (invariant J10). With the fence this keeps I2 (no acknowledged
// admission forgotten by a later owner) and I4 (a deposed owner's appends
// fail after the fence).
//
// Tenure markers (invariant J2). Before it claims a partition with sources
// that do not include itself, a node appends to its own subject a fence
// naming itself; a reader of a node's journal drops the partition's records
// from before the node's latest marker of it: they are from an earlier
// tenure, which ended in a release (checkpointed; the state bucket or a
// later owner's journal holds newer records) or a loss (adopted by the next
// owner, which renewed). The marker goes before the claim: once the claim
// lands the node is a source of the next claimer.

// Mark implements ownership.Lifecycle: it appends this node's tenure
// marker of partition p (epoch: the revision the claim expects).
func (j *Journal) Mark(p int, epoch uint64, timeout time.Duration, done func(error)) {
	j.w.enqueue(&write{fence: &fence{part: p, epoch: epoch, node: j.cfg.Self}, part: p, gen: j.recs.genOf(p),
		deadline: j.now().Add(timeout), done: func(_ uint64, err error) { done(err) }})
}

// barrier appends an empty batch to this node's journal through the writer
// (after every write queued before it) and returns its sequence; it fails
// if partition p's generation is no longer gen. Not the subject's last
// sequence as a read reports it: a stream leader cut off from the others
// answers reads until it learns it was replaced, with the messages it had,
// while the barrier's sequence comes from the current leader, and every
// batch of p this node committed is below it (invariant J11).
func (j *Journal) barrier(p int, gen uint64, deadline time.Time, done func(uint64, error)) {
	j.w.enqueue(&write{barrier: true, part: p, gen: gen, deadline: deadline,
		done: func(rev uint64, err error) { done(rev&revSeqMask, err) }})
}

// Adopt implements ownership.Lifecycle: it prepares partition p, just
// claimed in epoch over an entry whose adoption sources were sources
// (oldest first; none when the entry was absent or released).
func (j *Journal) Adopt(p int, sources []string, epoch uint64, timeout time.Duration, done func(error)) {
	gen := j.recs.adopting(p, epoch)
	j.open.reset(p, gen)
	deadline := j.now().Add(timeout)
	if bugs.Planted(bugs.AdoptBeforeServe) { // a test's planted bug
		j.recs.adopted(p, gen)
		done(nil)
		done = func(error) {}
	}
	latest := make(map[string][]byte)
	// The open-reservation index is read at or past every source's mark as
	// the reads found it (J17).
	var markFloor uint64
	var next func(i int)
	next = func(i int) {
		if i == len(sources) {
			j.adoptWrite(p, gen, sources, latest, markFloor, deadline, done)
			return
		}
		src := sources[i]
		read := func(upto uint64, err error) {
			if err != nil {
				done(err)
				return
			}
			j.rd.read(src, upto, j.until(deadline), func(states map[string]state, markRev uint64, err error) {
				if err != nil {
					done(err)
					return
				}
				markFloor = max(markFloor, markRev)
				for k, st := range states {
					if j.partOf(k) == p && newer(st.val, latest[k]) {
						latest[k] = st.val
						j.log.Debug("adopting a record", "partition", p, "key", k, "source", src, "seq", st.seq, "upto", upto)
					}
				}
				next(i + 1)
			})
		}
		if src == j.cfg.Self {
			j.barrier(p, gen, deadline, func(seq uint64, err error) {
				if err != nil {
					err = fmt.Errorf("appending a barrier to this node's journal: %w", err)
				}
				read(seq, err)
			})
			return
		}
		if bugs.Planted(bugs.JournalFence) { // a test's planted bug
			j.cfg.Stream.Last(j.subjOf(src), j.opTimeout(deadline), read)
			return
		}
		msg := appendFence(nil, fence{part: p, epoch: epoch, node: j.cfg.Self})
		j.cfg.Stream.Publish(j.subjOf(src), msg, j.floorTTL(), j.opTimeout(deadline), func(seq uint64, err error) {
			if err != nil {
				err = fmt.Errorf("fencing the journal of %s: %w", src, err)
			}
			read(seq, err)
		})
	}
	next(0)
}

// newer reports whether record a is later than b (nil: none): the higher
// version wins, whatever journal each came from (invariant J10); of equal
// versions (the same write, adopted and journalled again) the later read.
func newer(a, b []byte) bool {
	if b == nil {
		return true
	}
	va, _ := keyrec.PeekVersion(a)
	vb, _ := keyrec.PeekVersion(b)
	return va >= vb
}

// adoptWrite journals the adopted records of p in generation gen, then
// serves p (unless it changed hands meanwhile), writes its read floor and
// reads its open-reservation index (at or past markFloor).
func (j *Journal) adoptWrite(p int, gen uint64, sources []string, latest map[string][]byte, markFloor uint64, deadline time.Time, done func(error)) {
	var (
		mu       sync.Mutex
		left     = len(latest)
		firstErr error
	)
	end := func() {
		if firstErr != nil {
			done(fmt.Errorf("journalling the adopted records: %w", firstErr))
			return
		}
		j.recs.adopted(p, gen)
		j.recs.dropOrphans(p)
		j.open.adopted(p, gen, markFloor, latest)
		if f := j.cfg.OnAdopted; f != nil {
			for k, v := range latest {
				f(k, v)
			}
		}
		// The floor and the open-reservation index need the state bucket,
		// which the adopted records do not: without it (no stream leader
		// yet) the partition is served, its first load writes the floor,
		// and its checkpoints read the index (its records stay dirty until
		// then: J17).
		j.floors.claim(p, func(err error) {
			if err != nil {
				j.log.Debug("read floor not written yet", "partition", p, "error", err.Error())
			}
			j.log.Debug("partition adopted", "partition", p, "from", sources, "records", len(latest))
			done(nil)
			j.open.load(p, gen, j.cfg.Timeout, func(err error) {
				if err != nil {
					j.log.Debug("open-reservation index not read yet", "partition", p, "error", err.Error())
				}
			})
		})
	}
	if left == 0 {
		end()
		return
	}
	writes := make([]*write, 0, len(latest))
	for _, k := range slices.Sorted(maps.Keys(latest)) {
		val := latest[k]
		writes = append(writes, &write{key: k, val: val, part: p, gen: gen, deadline: deadline,
			done: func(_ uint64, err error) {
				mu.Lock()
				if err != nil && firstErr == nil {
					firstErr = err
				}
				left--
				last := left == 0
				mu.Unlock()
				if last {
					end()
				}
			}})
	}
	j.w.enqueue(writes...)
}

// Release implements ownership.Lifecycle: it checkpoints partition p's
// journalled records before this node hands p over (its slot no longer
// serves), writing nothing after holdUntil (its lease of p lapses then),
// then forgets them; on failure they stay as orphans. A partition
// with orphans (records of a tenure this node lost, not yet seen adopted by
// another node) is not released: the checkpoint skips orphans, so the next
// owner would read the state bucket's older records. Its entry is left to
// expire, and the next claimer adopts the orphans from this node's journal.
func (j *Journal) Release(p int, holdUntil time.Time, timeout time.Duration, done func(error)) {
	if orphans := j.recs.releasing(p); orphans > 0 {
		done(fmt.Errorf("%d records of the partition from before this node lost it are only in its journal", orphans))
		return
	}
	var once sync.Once
	finish := func(err error) {
		once.Do(func() {
			j.recs.released(p, err)
			j.open.drop(p)
			done(err)
		})
	}
	stop := j.rt.AfterFunc(timeout, func() { finish(fmt.Errorf("checkpoint of partition %d: no end within %v", p, timeout)) })
	// A barrier first: an append of the partition whose outcome is unknown
	// (J13, J15) is resolved before the checkpoint, committed if it landed
	// (the checkpoint then writes its records) or kept from landing by the
	// barrier. Otherwise it could land after the entry is deleted, unseen
	// by the next owner, which claims without fencing this journal and
	// reads the state bucket (J16).
	j.barrier(p, j.recs.genOf(p), j.now().Add(timeout), func(_ uint64, err error) {
		if err != nil {
			stop()
			finish(fmt.Errorf("appending a barrier before the checkpoint: %w", err))
			return
		}
		j.ck.run(p, func() bool { return j.now().Before(holdUntil) }, func(err error) {
			stop()
			finish(err)
		})
	})
}

// Lost implements ownership.Lifecycle: p's records stay as orphans until
// its next owner is seen to have adopted them.
func (j *Journal) Lost(p int) {
	kept, dropped := j.recs.lose(p)
	j.open.drop(p)
	j.log.Debug("lost partition's records", "partition", p, "kept", kept, "dropped", dropped)
}

// Renewed implements ownership.Lifecycle.
func (j *Journal) Renewed(p int) { j.recs.renewed(p) }

// OwnedElsewhere implements ownership.Lifecycle: p's orphans are forgotten
// once p has another owner that finished adopting them (or none after a
// release).
func (j *Journal) OwnedElsewhere(p int) {
	j.recs.settled(p)
	if n := j.recs.dropOrphans(p); n > 0 {
		j.log.Debug("orphans dropped", "partition", p, "records", n)
	}
}
