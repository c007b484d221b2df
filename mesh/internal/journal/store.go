package journal

import (
	"errors"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
)

// The journal as the key owners' store (kvstate.AsyncStore).

// GetAsync implements keys.Store: the journalled record when it is
// not checkpointed yet, else the state bucket's (which may have expired
// since, once at rest: its TTL applies as without the journal). A key of
// a partition this node does not hold fails as fenced.
func (j *Journal) GetAsync(key string, timeout time.Duration, done func([]byte, uint64, error)) {
	part := j.partOf(key)
	val, jseq, gen, hit, owned := j.recs.lookup(key, part, j.now().UnixNano())
	switch {
	case !owned:
		j.rt.Go(func() { done(nil, 0, fencedErr(part)) })
	case hit:
		rev := tagRev(jseq|journalRevBit, gen)
		j.rt.Go(func() { done(val, rev, nil) })
	default:
		j.floors.get(key, part, timeout, func(val []byte, rev uint64, err error) {
			// The partition's open-reservation index learns what the key's
			// record says now (J17): a key it names whose reservations all
			// ended is dropped.
			if (err == nil || errors.Is(err, kvstate.ErrNotFound)) && j.open.wants(part, gen, key) {
				j.open.see(part, gen, key, val)
			}
			if rev != 0 {
				rev = tagRev(rev, gen)
			}
			done(val, rev, err)
		})
	}
}

// UpdateAsync implements keys.Store: the record, with the usage of the
// admissions it spends, goes into the next batch. A revision of an older generation of the key's partition is
// a conflict; expected revision 0 (the key must not exist) is checked
// against the journalled records and the state bucket (checks.go).
func (j *Journal) UpdateAsync(key string, value []byte, usage []keyrec.Usage, rev uint64, timeout time.Duration, done func(uint64, error)) {
	part := j.partOf(key)
	gen, known, owned := j.recs.prepare(key, part)
	if !owned {
		j.rt.Go(func() { done(0, fencedErr(part)) })
		return
	}
	w := &write{key: key, val: value, usage: usage, part: part, gen: gen, deadline: j.now().Add(timeout), done: done}
	switch {
	case rev != 0 && rev>>revSeqBits&revGenMask != gen&revGenMask, rev == 0 && known:
		j.rt.Go(func() { done(0, kvstate.ErrConflict) })
	case rev == 0 && j.floors.batchable(part):
		j.checks.add(w)
	case rev == 0:
		j.checks.one(w)
	default:
		if rev&journalRevBit == 0 {
			w.kvRev, w.kvKnown = rev&revSeqMask, true
		}
		w.expect = rev
		j.w.enqueue(w)
	}
}
