package keys

import (
	"errors"
	"fmt"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/fail"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
)

// The results of the driver's loads and writes, applied to an owner.

// loaded reports the result of an actLoad: the stored value and revision,
// or err (wrapping kvstate.ErrNotFound for an absent key, with rev the
// revision to expect). Another error fails the queued calls.
func (o *owner) loadedResult(val []byte, rev uint64, err error) {
	o.busy = false
	o.blind, o.unread = false, false
	if o.moved {
		return // not kept: next fails the queued calls as fenced
	}
	switch {
	case err == nil:
		rec, derr := keyrec.Decode(val)
		if derr != nil {
			// A keyrec.Record this node cannot read starts conservatively
			// empty (never a fresh burst: that could double-spend); the
			// next write replaces it (its revision is kept for the CAS).
			o.corrupt++
			if len(o.queue) == 0 {
				o.loaded = false // no policy to build it for: load again when asked
				return
			}
			rec = emptyRecord(o.policyFor(o.queue[0]), o.loadAt)
		}
		o.rec, o.rev, o.loaded, o.stored = rec, rev, true, true
		o.lastWrite = 0
	case errors.Is(err, kvstate.ErrNotFound):
		o.rec, o.rev, o.loaded, o.stored = keyrec.Record{}, rev, true, false
		o.lastWrite = 0
	default:
		o.loaded = false
		for _, c := range o.queue {
			o.finish(c, fmt.Errorf("%w: loading state: %w", fail.ErrUnavailable, err))
		}
		o.queue = nil
	}
}

// written reports the result of an actWrite: the new revision, or err. It
// returns true when the write lost a compare-and-swap.
func (o *owner) written(rev uint64, err error) (conflict bool) {
	o.busy = false
	batch := o.inflight
	o.inflight = nil
	wasAsync, wasBlind := o.asyncWrite, o.blindWrite
	o.asyncWrite, o.blindWrite = false, false
	usage, usageAsync, uncertain := o.inflightUsage, o.inflightAsync, o.inflightUncertain
	o.inflightUsage, o.inflightAsync, o.inflightUncertain = nil, nil, 0
	switch {
	case err == nil:
		// The write is acknowledged: only now are the batch's strict
		// calls answered (invariant K1).
		o.rev, o.stored, o.unread = rev, true, false
		o.lastWrite = o.batchAt
		if o.gen == o.writeGen {
			o.dirty = false
		}
		o.finished = append(o.finished, batch...)
		return false
	case errors.Is(err, kvstate.ErrConflict):
		// Another writer got there first: what this node decided and did
		// not write is lost (async: the documented overshoot); the
		// strict calls of the batch are decided again after a reload
		// (invariant K2).
		o.loseUsage(usage, usageAsync, uncertain)
		o.dropCache()
		retry := batch[:0:0]
		for _, c := range batch {
			if !wasBlind {
				c.conflicts++
			}
			c.Out, c.Deduped = keyrec.Decision{}, false
			if c.conflicts >= o.maxConflicts {
				o.finish(c, fmt.Errorf("%w: %d conflicting writes", fail.ErrUnavailable, c.conflicts))
				continue
			}
			retry = append(retry, c)
		}
		o.queue = append(retry, o.queue...)
		return true
	case errors.Is(err, fail.ErrFenced):
		// This node no longer holds the key's partition: nothing was
		// written; the calls go to the new owner, not decided again here
		// (invariant K3), and what async changes were not written are lost
		// (within the async bound).
		o.loseUsage(usage, usageAsync, uncertain)
		o.dropCache()
		for _, c := range batch {
			o.finish(c, err)
		}
		return false
	case wasAsync:
		// The outcome is unknown: keep the record and retry with the
		// same expected revision at the next interval (if this write did
		// land, the retry loses the CAS and reloads a record with it); the
		// retry carries the usage again (journalled twice, it has one id
		// per journal message: a write that landed and its retry that
		// lost cannot both be journalled). With a store that journals
		// usage, that usage is uncertain: if the retry loses, the first
		// write may have landed with it, and it is not published again.
		o.usage = append(usage, o.usage...)
		o.usageAsync = append(usageAsync, o.usageAsync...)
		if o.usageKept {
			o.uncertain = len(usage)
		}
		return false
	default:
		// The outcome is unknown (the write may have landed): reload
		// before deciding again, and fail this batch: 503, never an
		// admission that was not written (K1).
		o.dropCache()
		for _, c := range batch {
			o.finish(c, fmt.Errorf("%w: writing state: %w", fail.ErrUnavailable, err))
		}
		return false
	}
}

// errMoved fails the calls still queued on an owner whose key's partition
// moved away (owner.moved).
var errMoved = fmt.Errorf("%w: the key's partition moved away", fail.ErrFenced)

// fence fails the queued calls of a moved owner as fenced and drops its
// cache (unwritten async changes are lost: their usage is published
// directly). Nothing is outstanding.
func (o *owner) fence() {
	for _, c := range o.queue {
		o.finish(c, errMoved)
	}
	o.queue = nil
	o.dropCache()
}

// dropCache forgets the cached record, counting unwritten async changes
// as lost (their usage is published directly); the next Call reloads the
// key.
func (o *owner) dropCache() {
	if o.dirty {
		o.lost++
	}
	o.loseUsage(o.usage, o.usageAsync, o.uncertain)
	o.usage, o.usageAsync, o.uncertain = nil, nil, 0
	o.loaded, o.dirty, o.flushReq, o.unread = false, false, false, false
	o.rec = keyrec.Record{}
}
