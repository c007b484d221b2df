package mesh

import (
	"errors"
	"fmt"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/policies"
)

// The owner core: the per-key state machine that turns decide calls and
// store results into store operations and replies. It does no I/O, reads no
// clock and starts no goroutine, so tests drive it by hand (in the manner
// of etcd raft's Ready/Advance); keyRunner in keys.go is the thin goroutine
// that does the I/O around it.
//
// Protocol. Calls are submitted in arrival order. next(now) returns one
// action: load the key's record, write a new record with an expected
// revision, or nothing; plus the calls finished since the last next. After
// a load or write the driver reports the result (loaded, written) and calls
// next again. At most one store operation is outstanding per key.
//
// Group commit. Calls that queue while a store operation is outstanding
// are decided together, in order, against the cached record, and every
// state change among them goes out in one compare-and-swap write. In strict
// mode each of them is answered only once the write that contains it is
// acknowledged. A batch that changes nothing (denials without request_id,
// dry runs, remembered request_ids) is answered at once.
//
// Conflicts. A write that loses the compare-and-swap (another node wrote
// the key) drops the cache; the calls go back to the head of the queue,
// and after a reload they are decided again against the fresh record. A
// call that has been in maxConflicts lost writes, or whose deadline passes
// while queued, fails with ErrUnavailable.

// policyEnv gives the owner core the policy versions it needs.
type policyEnv interface {
	// current returns the policy in force named name, or nil.
	current(name string) *policies.Policy
	// version returns version rev of policy name and the instant (ns) it
	// was written, if known.
	version(name string, rev uint64) (*policies.Policy, int64, bool)
}

// call is one decide request travelling through an owner.
type call struct {
	policy   *policies.Policy // resolved when the request arrived
	cost     int64            // micro-units
	id       [16]byte         // request_id hash, when hasID
	hasID    bool
	dryRun   bool
	deadline int64 // ns; the call fails with ErrUnavailable at or after it

	conflicts int // lost writes this call was part of

	// Results, set when the call is finished.
	out decision
	err error
	// deduped is true when the reply is a remembered request_id's.
	deduped bool

	// done is for the driver (the reply to send); the core never reads it.
	done func(*call)
}

type actionKind uint8

const (
	actNone  actionKind = iota
	actLoad             // Get the key, then loaded()
	actWrite            // Update(key, value, rev), then written()
)

// action is what the driver does next.
type action struct {
	kind     actionKind
	value    []byte // actWrite: the encoded record
	rev      uint64 // actWrite: the expected revision
	deadline int64  // ns: the latest deadline among the calls waiting on it
	finished []*call
}

// owner is the core for one limit key. It is not safe for concurrent use:
// the driver serializes access.
type owner struct {
	env          policyEnv
	maxConflicts int
	// ttl is the state bucket's idle expiry (ns; 0: none). A key whose
	// cached record was last written ttl/2 ago is written again with its
	// next batch, even if that batch changes nothing, so traffic that is
	// only denied still keeps the stored state from expiring (and a key
	// that did expire is noticed by the CAS of that write).
	ttl       int64
	lastWrite int64 // ns of the batch of the last acknowledged write; 0 after a load
	batchAt   int64 // ns of the outstanding write's batch

	loaded bool
	rec    record // committed (as far as this node knows) when loaded
	rev    uint64 // its revision; 0 when absent

	busy     bool    // a load or write is outstanding
	queue    []*call // waiting to be decided
	inflight []*call // decided, in the outstanding write
	pending  record  // the record being written
	finished []*call // done, not yet handed to the driver

	// scratch is reused for DecideAll's output.
	limits []kvstate.Limit
	// corrupt counts stored records that could not be decoded.
	corrupt int
}

func newOwner(env policyEnv, maxConflicts int, ttl int64) *owner {
	return &owner{env: env, maxConflicts: maxConflicts, ttl: ttl}
}

// submit queues c.
func (o *owner) submit(c *call) { o.queue = append(o.queue, c) }

// idle reports whether the owner has nothing queued or outstanding.
func (o *owner) idle() bool {
	return !o.busy && len(o.queue) == 0 && len(o.finished) == 0
}

func (o *owner) finish(c *call, err error) {
	c.err = err
	o.finished = append(o.finished, c)
}

// next returns the next action at instant now. It must not be called while
// a load or write is outstanding (it then returns only finished calls).
func (o *owner) next(now int64) (a action) {
	defer func() { a.finished, o.finished = o.finished, nil }()
	if o.busy {
		return a
	}
	live := o.queue[:0]
	for _, c := range o.queue {
		if now >= c.deadline {
			o.finish(c, fmt.Errorf("%w: decision deadline passed", ErrUnavailable))
			continue
		}
		live = append(live, c)
	}
	clear(o.queue[len(live):])
	o.queue = live
	if len(o.queue) == 0 {
		return a
	}
	if !o.loaded {
		o.busy = true
		a.kind = actLoad
		a.deadline = maxDeadline(o.queue)
		return a
	}
	rec := o.rec
	write := false
	for _, c := range o.queue {
		if o.decide(&rec, c, now) {
			write = true
		}
	}
	if !write && o.ttl > 0 && now-o.lastWrite >= o.ttl/2 && len(o.rec.states) > 0 {
		write = true // keep-alive (see owner.ttl); an absent key has nothing to keep
	}
	if !write {
		o.finished = append(o.finished, o.queue...)
		o.queue = nil
		return a
	}
	o.inflight, o.queue = o.queue, nil
	o.pending = rec
	o.batchAt = now
	o.busy = true
	a.kind = actWrite
	a.value = appendRecord(make([]byte, 0, recordSizeHint(&rec)), &rec)
	a.rev = o.rev
	a.deadline = maxDeadline(o.inflight)
	return a
}

func maxDeadline(cs []*call) int64 {
	var d int64
	for _, c := range cs {
		d = max(d, c.deadline)
	}
	return d
}

// loaded reports the result of an actLoad: the stored value and revision,
// or err (wrapping kvstate.ErrNotFound for an absent key, with rev the
// revision to expect). Another error fails the queued calls.
func (o *owner) loadedResult(val []byte, rev uint64, err error) {
	o.busy = false
	switch {
	case err == nil:
		rec, derr := decodeRecord(val)
		if derr != nil {
			// A record this node cannot read starts fresh; the next
			// write replaces it (its revision is kept for the CAS).
			o.corrupt++
			rec = record{}
		}
		o.rec, o.rev, o.loaded = rec, rev, true
		o.lastWrite = 0
	case errors.Is(err, kvstate.ErrNotFound):
		o.rec, o.rev, o.loaded = record{}, rev, true
		o.lastWrite = 0
	default:
		o.loaded = false
		for _, c := range o.queue {
			o.finish(c, fmt.Errorf("%w: loading state: %v", ErrUnavailable, err))
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
	switch {
	case err == nil:
		o.rec, o.rev = o.pending, rev
		o.lastWrite = o.batchAt
		o.pending = record{}
		o.finished = append(o.finished, batch...)
		return false
	case errors.Is(err, kvstate.ErrConflict):
		o.loaded = false
		o.pending = record{}
		retry := batch[:0:0]
		for _, c := range batch {
			c.conflicts++
			c.out, c.deduped = decision{}, false
			if c.conflicts >= o.maxConflicts {
				o.finish(c, fmt.Errorf("%w: %d conflicting writes", ErrUnavailable, c.conflicts))
				continue
			}
			retry = append(retry, c)
		}
		o.queue = append(retry, o.queue...)
		return true
	default:
		// The outcome is unknown (the write may have landed): reload
		// before deciding again, and fail this batch.
		o.loaded = false
		o.pending = record{}
		for _, c := range batch {
			o.finish(c, fmt.Errorf("%w: writing state: %v", ErrUnavailable, err))
		}
		return false
	}
}

// decide decides c at now against rec, updating rec, and reports whether
// rec changed in a way that must be written.
func (o *owner) decide(rec *record, c *call, now int64) bool {
	p := c.policy
	if cur := o.env.current(p.Name); cur != nil && cur.Revision > p.Revision {
		p = cur
	}
	if rec.policy != p.Name || rec.revision != p.Revision {
		o.transition(rec, p, now)
	}
	rec.pruneDedupe(now)
	if c.hasID && !c.dryRun {
		if d, ok := rec.findDedupe(c.id); ok {
			d.Policy = p.Name
			c.out, c.deduped = d, true
			return false
		}
	}
	o.limits = o.limits[:0]
	for _, l := range p.Limits {
		o.limits = append(o.limits, l.Limit)
	}
	kd, states := kvstate.DecideAll(o.limits, rec.states, now, c.cost, nil)
	d := decision{
		Allowed:    kd.Allowed,
		Policy:     p.Name,
		Revision:   p.Revision,
		Remaining:  kd.Remaining,
		RetryAfter: kd.RetryAfter,
		ResetAfter: kd.ResetAfter,
	}
	if p.Shadow && !kd.Allowed {
		d.Allowed, d.ShadowDenied = true, true
	}
	c.out = d
	if c.dryRun {
		return false
	}
	changed := false
	if kd.Allowed {
		rec.states = states
		changed = true
	}
	if c.hasID {
		rec.addDedupe(c.id, now, d)
		changed = true
	}
	return changed
}

// transition brings rec's states to policy p (§28). The instant of the
// change is when p's revision was written (now if unknown). A record of
// another policy starts fresh. When the old version is unknown, states
// are kept by position where the algorithm matches, clamped to p's limits.
func (o *owner) transition(rec *record, p *policies.Policy, now int64) {
	at := now
	if _, created, ok := o.env.version(p.Name, p.Revision); ok && created > 0 && created < now {
		at = created
	}
	var states []kvstate.State
	switch {
	case rec.policy != p.Name || len(rec.states) == 0:
		states = make([]kvstate.State, len(p.Limits))
	default:
		if old, _, ok := o.env.version(rec.policy, rec.revision); ok {
			states = policies.Transition(old, p, rec.states, at)
		} else {
			states = make([]kvstate.State, len(p.Limits))
			for i, l := range p.Limits {
				if i < len(rec.states) && rec.states[i].Algorithm == l.Algorithm {
					states[i] = kvstate.Rebase(l.Limit, l.Limit, rec.states[i], at)
				}
			}
		}
	}
	if rec.policy != p.Name {
		rec.dedupe = nil
	}
	rec.policy, rec.revision, rec.states = p.Name, p.Revision, states
}
