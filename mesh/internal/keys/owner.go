package keys

import (
	"fmt"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/fail"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/policies"
)

// The owner core: the per-key state machine that turns decide calls and
// store results into store operations and replies. It does no I/O, reads no
// clock and starts no goroutine, so tests drive it by hand (in the manner
// of etcd raft's Ready/Advance); the driver in run.go does the I/O around
// it.
//
// Protocol. Calls are submitted in arrival order. next(now) returns one
// action: load the key's record, write a new keyrec.Record with an expected
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
// Call that has been in maxConflicts lost writes, or whose deadline passes
// while queued, fails with fail.ErrUnavailable.
//
// Async mode (calls whose policy in force has mode async). Such a Call is
// answered as soon as it is decided, from the cached record: the change
// stays in memory (the owner is dirty) and is written behind. The first
// change after a write asks the driver to arm a timer (action.arm); when
// it fires the driver calls requestFlush, and the next next writes the
// whole keyrec.Record (every change of the interval in one CAS) as soon as no
// other store operation is outstanding. While an async write is
// outstanding, async calls keep being decided (decideInline), so a hot
// key is not held up by its writes. A lost CAS drops the unwritten
// changes and reloads (the documented overshoot of async mode); a write
// that fails otherwise is retried with the same expected revision at the
// next interval (if it did land, that retry loses the CAS and reloads a
// keyrec.Record that contains it). A strict Call that meets unwritten async
// changes is decided on top of them, and its write carries them.
//
// Blind create. A key this node has never read may well be absent from
// the store (a new key), and an absent key needs no read: when the driver
// allows it (owner.blind, set on a new owner), the first batch of strict
// calls is decided against the empty keyrec.Record and written with expected
// revision 0 (the key must not exist), with no load first. Strictness is
// kept by the compare-and-swap: the calls are answered only once that
// write is acknowledged, and if the key does exist the write loses, the
// calls are decided again after a load (a blind loss does not count
// toward maxConflicts). A batch that would write nothing (denials, dry
// runs) is not answered from the empty record: the key is loaded first.
// Only one blind start per owner (strict or async, below).
//
// Blind async start. Async calls are answered before any write, so for them
// the blind start is the async bound's own case: when the driver allows
// it, the first async Call on a key this node has never read is decided
// inline against the empty keyrec.Record (o.unread), and the first write of the
// key (write-behind or a strict write carrying it) is a blind create. If
// the key did exist, that write loses the compare-and-swap: the changes
// decided since are dropped and counted as lost, and the key is reloaded,
// exactly as after another writer's win (at most the async bound). A Call
// that would change nothing against the empty keyrec.Record (a dry run, a denial)
// is not answered from it: the key is loaded first.
//
// Corrupt records. A stored keyrec.Record this node cannot decode starts the key
// conservatively EMPTY at the instant of the load: every limit as it is
// right after spending its whole capacity, so corrupt state never admits
// more than the limits allow.

// Env gives the owner core the policy versions it needs.
type Env interface {
	// Current returns the live policy named name, or nil.
	Current(name string) *policies.Policy
	// Version returns version rev of policy name and the instant (ns) it
	// was written, if known.
	Version(name string, rev uint64) (*policies.Policy, int64, bool)
}

// Call is one decide request travelling through a key's owner.
type Call struct {
	Policy   *policies.Policy // resolved when the request arrived
	Cost     int64            // micro-units
	ID       [16]byte         // request_id hash (keyrec.IDHash), when HasID
	HasID    bool
	DryRun   bool
	Deadline int64 // ns; the call fails with fail.ErrUnavailable at or after it
	// Overflow marks a call for its policy's overflow key
	// (policies.Policy.OverflowKey): that key takes no place among the
	// policy's live keys (overflow.go).
	Overflow bool

	// Results, set when the call is finished.
	Out keyrec.Decision
	Err error
	// Deduped is true when the reply is a remembered request_id's.
	Deduped bool
	// Overflowed is set, with nothing decided (no Out, no Err), when the
	// call's key is new to this node and its policy has max_keys live
	// keys here (overflow.go): the caller decides the call again against
	// the policy's overflow key.
	Overflowed bool

	// Done is the driver's continuation (the reply to send); the core
	// never reads it.
	Done Finisher

	// Desc and RequestID are what an admission's usage record needs
	// beyond what the core knows (nil Desc: the call records no usage).
	Desc      policies.Descriptor
	RequestID string
	// At is set when the call is decided: the decision's instant (ns).
	At int64
	// Lease, when not nil, makes the call a grant operation of a leased
	// key instead of a decision (lease.go).
	Lease *LeaseOp
	// Res, when not nil, makes the call a reservation operation
	// (reserve.go).
	Res *ResOp

	conflicts int           // lost writes this call was part of
	mode      policies.Mode // of the policy version that decided it
}

// Finisher is told once that its call is finished (c.Out or c.Err set).
type Finisher interface{ Finish(c *Call) }

type actionKind uint8

const (
	actNone  actionKind = iota
	actLoad             // Get the key, then loaded()
	actWrite            // Update(key, value, rev), then written()
)

// action is what the driver does next.
type action struct {
	kind  actionKind
	value []byte // actWrite: the encoded record
	// usage is, for an actWrite, the usage of the admissions the record
	// spends that no earlier write carried: the store journals it with the
	// record (keyrec.Usage).
	usage    []keyrec.Usage
	rev      uint64 // actWrite: the expected revision
	deadline int64  // ns: the latest deadline among the calls waiting on it
	finished []*Call
	// arm asks the driver to Call requestFlush after the async interval:
	// the owner holds changes that are not written yet.
	arm bool
	// blind marks an actWrite that is a blind create (expected revision
	// 0 without a load): losing it is the normal outcome for a key that
	// exists, not a sign of another owner.
	blind bool
}

// noDeadline is the deadline of a write no Call waits on (async
// write-behind): the driver bounds it by its own write timeout.
const noDeadline = 1<<63 - 1

// owner is the core for one limit key. It is not safe for concurrent use:
// the driver serializes access.
type owner struct {
	env          Env
	maxConflicts int
	// ttl is the state bucket's idle expiry (ns; 0: none). A key whose
	// cached keyrec.Record was last written ttl/2 ago is written again with its
	// next batch, even if that batch changes nothing, so traffic that is
	// only denied still keeps the stored state from expiring (and a key
	// that did expire is noticed by the CAS of that write).
	ttl       int64
	lastWrite int64 // ns of the batch of the last acknowledged write; 0 after a load
	batchAt   int64 // ns of the outstanding write's batch

	// rec is the node's view of the key when loaded: the stored keyrec.Record
	// plus every change decided since (in the outstanding write, or
	// unwritten async changes).
	rec keyrec.Record
	rev uint64 // the revision of the last keyrec.Record read or written; 0 when absent

	// The flags are side by side (a key's owner is most of its memory).
	loaded bool
	// stored is true when the store holds a keyrec.Record of the key (as far as
	// this node knows): an absent key has nothing to keep alive.
	stored bool

	// blind allows one blind create (see above); it is cleared when
	// used or when the key is loaded. blindWrite marks the outstanding
	// write as one.
	blind      bool
	blindWrite bool
	// unread is true while rec was started empty without a read (blind
	// async start) and no write of it has been acknowledged: every write
	// meanwhile is a blind create.
	unread bool

	busy bool // a load or write is outstanding
	// moved is set when the key's partition moved away (the table
	// dropped it, Table.DropPartition): another node decides the key
	// now, so this owner decides nothing more. The result of its
	// outstanding write is applied (its calls are answered as it went);
	// the record of its outstanding load is not kept; then every call
	// still queued fails as fenced (its caller forwards it to the
	// partition's owner) and the cache is dropped, so a record that may
	// be stale never answers a call.
	moved bool
	// denying is true when the last call decided was denied (deny.go).
	denying bool

	loadAt   int64   // ns the outstanding load was asked for
	queue    []*Call // waiting to be decided
	inflight []*Call // decided, in the outstanding write
	finished []*Call // done, not yet handed to the driver

	// Async write-behind.
	asyncWrite bool   // the outstanding write is a write-behind (no Call waits on it)
	dirty      bool   // rec holds async changes not yet written (or in an outstanding write)
	armed      bool   // a flush timer is pending
	flushReq   bool   // the timer fired: write the dirty keyrec.Record
	gen        uint64 // counts async changes
	writeGen   uint64 // gen when the outstanding write was encoded

	// The usage of the admissions of strict and async calls: usage (and
	// usageAsync, whether each is an async call's) are in rec and in no
	// write yet; inflightUsage in the outstanding write. lostUsage holds
	// async admissions whose changes a lost write dropped (they were
	// answered: the driver publishes their usage directly), of policy
	// usagePolicy.
	usage         []keyrec.Usage
	usageAsync    []bool
	inflightUsage []keyrec.Usage
	inflightAsync []bool
	lostUsage     []keyrec.Usage
	usagePolicy   string
	// Uncertain usage. With a store that journals usage with the record
	// (usageKept: the state journal), the usage of a write whose outcome
	// was unknown is published by the store if that write lands. The
	// retry carries it again (it is published with the retry if the retry
	// lands, which it cannot if the first write did), but a lost retry
	// does not count it lost: the first write may have landed with it.
	// uncertain is how many leading entries of usage (inflightUncertain:
	// of inflightUsage) are such.
	usageKept         bool
	uncertain         int
	inflightUncertain int

	// limits is DecideAll's input, the limits of policy version
	// limitsOf (parsed policies are never modified); spare is reused
	// for its output.
	limits   []kvstate.Limit
	limitsOf *policies.Policy
	spare    []kvstate.State
	// lost counts async changes dropped by a lost CAS (the overshoot of
	// async mode), and corrupt the stored records that could not be
	// decoded, for the driver's metrics (it takes differences).
	lost, corrupt int32
}

func newOwner(env Env, maxConflicts int, ttl int64) *owner {
	return &owner{env: env, maxConflicts: maxConflicts, ttl: ttl}
}

// submit queues c.
func (o *owner) submit(c *Call) { o.queue = append(o.queue, c) }

// idle reports whether the owner has nothing queued, outstanding or
// unwritten: only an idle owner may be dropped from memory.
func (o *owner) idle() bool {
	return !o.busy && len(o.queue) == 0 && len(o.finished) == 0 && !o.dirty
}

// requestFlush reports that the async interval armed by action.arm has
// passed: the next next writes the dirty record.
func (o *owner) requestFlush() {
	o.armed = false
	if o.dirty {
		o.flushReq = true
	}
}

// policyFor returns the policy version that decides c: the one in force if
// it is newer than the one c arrived with.
func (o *owner) policyFor(c *Call) *policies.Policy {
	p := c.Policy
	if cur := o.env.Current(p.Name); cur != nil && cur.Revision > p.Revision {
		p = cur
	}
	return p
}

// decideInline decides an async Call at once, without the queue, when
// that keeps arrival order and strictness: the key is loaded, nothing is
// queued, no strict write is outstanding, and c's policy is async. It
// reports whether it did; then c is finished (not handed out by next: the
// caller replies) and arm tells the driver to arm the flush timer.
//
// On a key never read and with blind allowed, it starts the owner blind
// (see Blind async start) when c changes the empty record.
func (o *owner) decideInline(c *Call, now int64) (ok, arm bool) {
	if len(o.queue) > 0 || (o.busy && !o.asyncWrite) || c.Res != nil {
		return false, false
	}
	p := o.policyFor(c)
	if p.Mode != policies.ModeAsync {
		return false, false
	}
	if now >= c.Deadline {
		return false, false
	}
	if !o.loaded {
		if !o.blind || o.busy || c.DryRun {
			return false, false
		}
		var rec keyrec.Record
		if !o.decideWith(&rec, c, p, now) {
			c.Out, c.Deduped = keyrec.Decision{}, false
			return false, false
		}
		o.blind = false
		o.rec, o.rev, o.loaded, o.stored, o.unread = rec, 0, true, false, true
		o.lastWrite = 0
		o.markDirty()
		return true, o.armIfDirty()
	}
	if o.decideWith(&o.rec, c, p, now) || o.keepAliveDue(now) {
		o.markDirty()
	}
	return true, o.armIfDirty()
}

func (o *owner) markDirty() {
	o.gen++
	o.dirty = true
}

// armIfDirty reports whether a flush timer must be armed now: there are
// changes that no outstanding write carries, and no timer or flush is
// pending.
func (o *owner) armIfDirty() bool {
	if o.dirty && !o.armed && !o.flushReq && !(o.busy && o.gen == o.writeGen) {
		o.armed = true
		return true
	}
	return false
}

// keepAliveDue reports whether the stored keyrec.Record should be written again
// even without a change (see owner.ttl).
func (o *owner) keepAliveDue(now int64) bool {
	return o.ttl > 0 && now-o.lastWrite >= o.ttl/2 && o.stored
}

func (o *owner) finish(c *Call, err error) {
	c.Err = err
	o.finished = append(o.finished, c)
}

// next returns the next action at instant now. It must not be called while
// a load or write is outstanding (it then returns only finished calls).
func (o *owner) next(now int64) (a action) {
	defer func() {
		a.finished, o.finished = o.finished, nil
		a.arm = o.armIfDirty()
	}()
	if o.busy {
		return a
	}
	if o.moved {
		o.fence()
		return a
	}
	live := o.queue[:0]
	for _, c := range o.queue {
		if now >= c.Deadline {
			o.finish(c, fmt.Errorf("%w: keyrec.Decision deadline passed", fail.ErrUnavailable))
			continue
		}
		live = append(live, c)
	}
	clear(o.queue[len(live):])
	o.queue = live
	if len(o.queue) == 0 {
		if o.loaded && o.dirty && o.flushReq {
			return o.writeBehind(now)
		}
		return a
	}
	if !o.loaded && o.blind {
		o.blind = false
		if a, ok := o.blindCreate(now); ok {
			return a
		}
	}
	if !o.loaded {
		o.busy = true
		o.loadAt = now
		a.kind = actLoad
		a.deadline = maxDeadline(o.queue)
		return a
	}
	write, async := false, false
	strict := o.queue[:0]
	for _, c := range o.queue {
		changed := o.decide(&o.rec, c, now)
		if c.mode == policies.ModeAsync {
			o.finished = append(o.finished, c)
			async = async || changed
			continue
		}
		strict = append(strict, c)
		write = write || changed
	}
	clear(o.queue[len(strict):])
	o.queue = nil
	if async {
		o.markDirty()
	}
	if !write && o.keepAliveDue(now) {
		if len(strict) > 0 {
			write = true
		} else {
			o.markDirty()
		}
	}
	if !write {
		o.finished = append(o.finished, strict...)
		if o.dirty && o.flushReq {
			return o.writeBehind(now)
		}
		return a
	}
	// A strict write carries any unwritten async changes too.
	o.inflight = strict
	o.asyncWrite = false
	o.blindWrite = o.unread
	o.writeGen = o.gen
	o.flushReq = false
	o.batchAt = now
	o.busy = true
	a.kind = actWrite
	a.value, a.usage = o.encode()
	a.rev = o.rev
	a.deadline = maxDeadline(o.inflight)
	a.blind = o.unread
	return a
}

// blindCreate decides the queued calls against the empty keyrec.Record and
// returns their write with expected revision 0, when they are all strict
// and change something; otherwise it leaves the calls as they were
// (queued, undecided) and reports false.
func (o *owner) blindCreate(now int64) (action, bool) {
	for _, c := range o.queue {
		if o.policyFor(c).Mode != policies.ModeStrict {
			return action{}, false
		}
	}
	var rec keyrec.Record
	write := false
	for _, c := range o.queue {
		write = o.decide(&rec, c, now) || write
	}
	if !write {
		for _, c := range o.queue {
			c.Out, c.Deduped = keyrec.Decision{}, false
		}
		return action{}, false
	}
	o.rec, o.rev, o.loaded, o.stored = rec, 0, true, false
	o.lastWrite = 0
	o.inflight = o.queue
	o.queue = nil
	o.asyncWrite = false
	o.blindWrite = true
	o.writeGen = o.gen
	o.batchAt = now
	o.busy = true
	value, usage := o.encode()
	return action{
		kind:     actWrite,
		value:    value,
		usage:    usage,
		deadline: maxDeadline(o.inflight),
		blind:    true,
	}, true
}

// writeBehind returns the write of the dirty keyrec.Record (async mode).
func (o *owner) writeBehind(now int64) action {
	o.asyncWrite = true
	o.blindWrite = o.unread
	o.writeGen = o.gen
	o.flushReq = false
	o.batchAt = now
	o.busy = true
	value, usage := o.encode()
	return action{
		kind:     actWrite,
		value:    value,
		usage:    usage,
		rev:      o.rev,
		deadline: noDeadline,
		blind:    o.unread,
	}
}

// encode returns the next write of the record, one version above the
// record it was decided from (keyrec.Record.Version) and with the instant
// it comes to rest (keyrec.Record.RestAt, which decides how long the
// store keeps it), with the usage of the admissions no earlier write
// carried.
func (o *owner) encode() ([]byte, []keyrec.Usage) {
	o.rec.Version++
	o.rec.RestAt = recordRestAt(o.policyOf(&o.rec), &o.rec)
	o.inflightUsage, o.inflightAsync, o.inflightUncertain = o.usage, o.usageAsync, o.uncertain
	o.usage, o.usageAsync, o.uncertain = nil, nil, 0
	return keyrec.Append(make([]byte, 0, keyrec.SizeHint(&o.rec)), &o.rec), o.inflightUsage
}

// loseUsage keeps the async admissions of us (async[i]: whether us[i] is
// one) for the driver to publish directly; strict ones are decided again
// (or failed) and dropped. The first uncertain ones are skipped (a write
// whose outcome was unknown may have landed with them).
func (o *owner) loseUsage(us []keyrec.Usage, async []bool, uncertain int) {
	for i := uncertain; i < len(us); i++ {
		if async[i] {
			o.lostUsage = append(o.lostUsage, us[i])
		}
	}
}

// takeLostUsage returns (and forgets) the usage the driver must publish
// directly, and its policy.
func (o *owner) takeLostUsage() ([]keyrec.Usage, string) {
	us := o.lostUsage
	o.lostUsage = nil
	return us, o.usagePolicy
}

func maxDeadline(cs []*Call) int64 {
	var d int64
	for _, c := range cs {
		d = max(d, c.Deadline)
	}
	return d
}

// Mode returns the mode of the policy version that decided c.
func (c *Call) Mode() policies.Mode { return c.mode }
