package journal

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/fail"
)

// Read floors (invariant J7 of docs/protocol.md; with J5, J6, J8-J10 and
// K2 it keeps I3: a decision never uses a record older than an earlier one
// did). A stream leader cut off from its cluster keeps answering leader
// reads for a while, with what it had when it was cut off (right after the
// partition heals too); a key's
// latest record in the state bucket was written before this node's claim
// (by a previous owner) or by this node. So for floorWindow after it claims
// a partition, this node reads that partition's keys with a floor read: a
// direct get whose answering replica must be at or past the claim's floor
// (the revision of this node's write of its floor key just after the claim,
// or of its latest write to the bucket if higher).

// partFloor is a partition's read floor.
type partFloor struct {
	seq uint64 // 0: not written yet
	at  int64  // unix ns of the claim
}

type floors struct {
	j   *Journal
	key string // _floor.<node id>

	mu    sync.Mutex
	parts []partFloor // nil when the bucket allows no direct gets
	// high is the highest sequence of this node's writes to the state
	// bucket that it knows of: a floor read must see them too.
	high uint64
	// written: this node wrote its floor key (a floor read reads it, so
	// a current replica's answer is never empty).
	written bool
}

func newFloors(j *Journal) *floors {
	f := &floors{j: j, key: floorPrefix + j.cfg.Self}
	if j.cfg.Floors {
		f.parts = make([]partFloor, j.cfg.Parts)
	}
	return f
}

// of returns the floor of reads of partition p now (0: none needed) and
// whether the claim's floor is not written yet.
func (f *floors) of(p int) (floor uint64, unset bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.parts == nil {
		return 0, false
	}
	pf := f.parts[p]
	if f.j.now().UnixNano()-pf.at >= int64(floorWindow) {
		return 0, false
	}
	return max(pf.seq, f.high), pf.seq == 0
}

// batchable reports whether new-key checks of partition p may be batched
// (its floor is written).
func (f *floors) batchable(p int) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.parts != nil && f.parts[p].seq != 0
}

// raise records a write of this node to the bucket at rev.
func (f *floors) raise(rev uint64) {
	f.mu.Lock()
	f.high = max(f.high, rev)
	f.mu.Unlock()
}

// floorOf returns the floor of a batch read of keys of partitions parts:
// the highest of their claim floors and this node's latest write.
func (f *floors) floorOf(parts []int) uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	floor := f.high
	for _, p := range parts {
		floor = max(floor, f.parts[p].seq)
	}
	return floor
}

// claim starts partition p's floor window and writes its floor.
func (f *floors) claim(p int, done func(error)) {
	f.mu.Lock()
	if f.parts == nil {
		f.mu.Unlock()
		done(nil)
		return
	}
	f.parts[p] = partFloor{at: f.j.now().UnixNano()} // unset until the write lands
	f.mu.Unlock()
	f.write(p, done)
}

// write writes the floor key and raises partition p's floor to the write's
// revision (unless p was claimed again meanwhile: that claim's floor must
// come from a write after it).
func (f *floors) write(p int, done func(error)) {
	f.mu.Lock()
	claimed := f.parts[p].at
	f.mu.Unlock()
	// No TTL: the floor key is kept for the bucket's age limit (the
	// retention horizon), far beyond the node's batched key checks.
	f.j.cfg.Bucket.PutAsync(f.key, nil, 0, f.j.cfg.Timeout, func(seq uint64, err error) {
		if err != nil {
			done(fmt.Errorf("writing the read floor: %w", err))
			return
		}
		f.mu.Lock()
		if f.parts[p].at == claimed {
			f.parts[p].seq = max(f.parts[p].seq, seq)
		}
		f.high = max(f.high, seq)
		f.written = true
		f.mu.Unlock()
		done(nil)
	})
}

// get reads key of partition p from the bucket, with its floor when one
// applies (writing the claim's floor first when it is not written yet).
func (f *floors) get(key string, p int, timeout time.Duration, done func([]byte, uint64, error)) {
	f.getFrom(key, p, 0, timeout, done)
}

// getFrom is get from a replica at or past least too (when the bucket
// allows floor reads).
func (f *floors) getFrom(key string, p int, least uint64, timeout time.Duration, done func([]byte, uint64, error)) {
	floor, unset := f.of(p)
	f.mu.Lock()
	direct, written := f.parts != nil, f.written
	f.mu.Unlock()
	deadline := f.j.now().Add(timeout)
	switch {
	case unset, direct && least != 0 && !written:
		// The claim could not write its floor (or this node has never
		// written its floor key, which a floor read reads with): write it
		// now.
		f.write(p, func(err error) {
			if err != nil {
				done(nil, 0, fmt.Errorf("%w: %w", fail.ErrUnavailable, err))
				return
			}
			floor, _ := f.of(p)
			f.getAfter(key, max(floor, least), deadline, nil, done)
		})
	case floor != 0, direct && least != 0:
		f.getAfter(key, max(floor, least), deadline, nil, done)
	default:
		f.j.cfg.Bucket.GetAsync(key, timeout, done)
	}
}

// getAfter reads key with floor, again after floorRetry while the replica
// answering is behind it, until deadline. A read that fails after earlier
// ones were answered behind the floor (the last one ran out of time)
// reports that staleness, the cause.
func (f *floors) getAfter(key string, floor uint64, deadline time.Time, stale error, done func([]byte, uint64, error)) {
	f.j.cfg.Bucket.GetAsyncFloor(key, f.key, floor, f.j.until(deadline), func(val []byte, rev uint64, err error) {
		if errors.Is(err, kvstate.ErrStale) {
			if f.j.until(deadline) > floorRetry {
				f.j.rt.AfterFunc(floorRetry, func() { f.getAfter(key, floor, deadline, err, done) })
				return
			}
			stale = err
		}
		if stale != nil && (errors.Is(err, kvstate.ErrStale) || isTimeout(err)) {
			val, rev, err = nil, 0, fmt.Errorf("%w: %w", fail.ErrUnavailable, stale)
		}
		done(val, rev, err)
	})
}
