package ownership

import (
	"slices"

	"github.com/limitmesh/limitmesh/internal/bugs"
	"github.com/limitmesh/limitmesh/internal/fence"
)

// The ownership core: which partitions of the key space this node owns,
// as a deterministic state machine over what it observed in the shards
// bucket and the time. It does no I/O, reads no clock and starts no
// goroutine (in the manner of etcd raft's Ready/Advance, like owner.go);
// runner.go is the machine around it that feeds it the watched entries,
// does the KV writes it asks for and reports their results.
//
// Model. Limit keys hash to P partitions (partitionOf). Entry part.<n> of
// the shards bucket names the owner of partition n; node.<id> entries are
// heartbeats. All times are a monotonic clock of this node in ns; nothing
// compares clocks of different nodes:
//
//   - a node is live while its node.<id> entry was seen to change within
//     the lease (seen = the local instant the watcher delivered the new
//     revision; an entry seen at start counts as just seen);
//   - a partition is free when part.<n> is absent or deleted, or its
//     revision has not changed within the lease as seen locally (the owner
//     stopped renewing);
//   - the target owner of each partition is the live node with the highest
//     rendezvous (HRW) score: every node computes the same target from the
//     same members, partitions spread evenly, and a join or leave moves only
//     the partitions whose target changed;
//   - a node claims a free partition whose target it is, with a CAS write on
//     the entry's revision; the epoch is the revision of that claiming write
//     (greater than every earlier epoch of the partition, since revisions
//     only grow: O2). It renews every lease/3 with a CAS write that keeps the
//     epoch. A partition it owns but whose target is another node it
//     releases: stop serving, drain, drop cached keys, delete the entry with
//     CAS (so the target claims it at once);
//   - self-fencing (O1): an owner serves a partition only until 2/3 of the
//     lease after the send instant of its last successful claim or
//     renewal, so it stops before any other node (which waits the whole
//     lease from a later instant, when it saw that write) may claim. The
//     rule's arithmetic, shared with the elector, is package fence;
//   - an entry that names another node while this node thinks it owns the
//     partition (or a lost CAS on renewal) means the partition was lost.

// partObs is what this node last observed of one part.<n> entry.
type partObs struct {
	exists bool   // false: never seen, deleted or purged
	node   string // owner named by the entry
	epoch  uint64
	from   []string // a claiming entry's adoption sources (partValue.From)
	rev    uint64   // entry revision (of the delete marker when deleted)
	seen   int64    // local instant rev was first observed
}

// memberObs is what this node last observed of one node.<id> entry.
type memberObs struct {
	rev  uint64
	seen int64
}

type holdState uint8

const (
	holdNone      holdState = iota
	holdClaiming            // claim write outstanding
	holdOwned               // owner; serving while within the lease
	holdRenewing            // owner with a renewal outstanding
	holdReleasing           // draining and deleting; not serving
)

// holding is this node's own relation to one partition.
type holding struct {
	state     holdState
	epoch     uint64
	rev       uint64 // revision of this node's last successful write of the entry
	renewedAt int64  // send instant of the last successful claim or renewal
	sentAt    int64  // send instant of the outstanding write
	retryAt   int64  // a renewal that failed is not sent again before this instant
}

type shardOpKind uint8

const (
	opClaim     shardOpKind = iota + 1 // Update(part.<n>, {node: self}, rev), then claimed
	opRenew                            // Update(part.<n>, {node: self, epoch}, rev), then renewed
	opRelease                          // drain, drop keys, Delete(part.<n>, rev), then released
	opHeartbeat                        // Put(node.<self>), then beat
)

// shardOp is a KV operation the core asks the driver to do.
type shardOp struct {
	kind  shardOpKind
	part  int
	rev   uint64 // expected revision
	epoch uint64 // opRenew: the epoch to keep
	at    int64  // instant the op was issued (its send instant)
	// until is, for an opRelease of a partition held, the instant its
	// lease holds until (serving's): the release may write the
	// partition's records until then, no later (invariant J9).
	until int64
	// sources are, for opClaim, the nodes whose state journals the
	// claimer adopts the partition's records from (the state journal), oldest
	// first: the node the entry named before the claim and, when that
	// entry was a claim never renewed, its own sources. None when the
	// entry was absent or deleted.
	sources []string
}

// shardCore is the ownership state machine of one node. Not safe for
// concurrent use: the driver serializes access.
type shardCore struct {
	self    string
	parts   int
	lease   fence.Lease // the rule of O1 and O6 over the lease, ns
	leaving bool        // releasing everything (graceful stop); no longer a member

	members map[string]memberObs
	obs     []partObs
	mine    []holding

	// kept[n] is the revision of this node's entry of partition n whose
	// release failed before deleting it (its records could not be
	// checkpointed): the entry is left to expire, and the next claimer
	// adopts them from this node's journal. 0: none.
	kept []uint64

	// sent[n]: a claim of partition n by this incarnation landed (an
	// entry naming this node that it never claimed is an earlier
	// incarnation's; a claim that failed leaves the entry as it was).
	sent []bool

	// claimFails[n] counts the consecutive failed claims of partition n
	// (reset by a claim that lands); claimAfter[n] is the instant before
	// which it is not claimed again (claimBackoff).
	claimFails []int
	claimAfter []int64

	lastBeat  int64 // send instant of the last heartbeat; 0 = never
	beating   bool
	beatAfter int64 // a heartbeat that failed is not sent again before this instant
	// beatRev is the revision of this node's last heartbeat that landed
	// (0: none yet). The next heartbeat waits until the watch has
	// delivered it (invariant O5; with O6's paced retries it keeps I5:
	// once faults end, every partition gets an owner again).
	beatRev   uint64
	lostParts []int
	live      []string // scratch

	// Ownership changes so far.
	claims, releases, losses int
}

func newShardCore(self string, parts int, lease int64) *shardCore {
	return &shardCore{
		self:    self,
		parts:   parts,
		lease:   fence.Lease(lease),
		members: make(map[string]memberObs),
		obs:     make([]partObs, parts),
		mine:    make([]holding, parts),
		kept:    make([]uint64, parts),
		sent:    make([]bool, parts),

		claimFails: make([]int, parts),
		claimAfter: make([]int64, parts),
	}
}

// observeNode reports a node.<id> entry (deleted: the node left).
func (c *shardCore) observeNode(id string, rev uint64, deleted bool, now int64) {
	if deleted {
		delete(c.members, id)
		return
	}
	if m, ok := c.members[id]; ok && rev <= m.rev {
		return
	}
	c.members[id] = memberObs{rev: rev, seen: now}
}

// observePart reports a part.<n> entry: its value (ignored when deleted),
// revision, and whether it is a delete or purge marker. Revisions not
// newer than the last one observed are ignored.
func (c *shardCore) observePart(n int, v partValue, rev uint64, deleted bool, now int64) {
	if n < 0 || n >= c.parts || rev <= c.obs[n].rev {
		return
	}
	o := partObs{exists: !deleted, rev: rev, seen: now}
	if !deleted {
		o.node, o.epoch = v.Node, v.Epoch
		if o.epoch == 0 {
			o.epoch = rev
			o.from = v.From
		}
	}
	c.obs[n] = o
	h := &c.mine[n]
	if (h.state == holdOwned || h.state == holdRenewing) && rev > h.rev && (deleted || v.Node != c.self || o.epoch != h.epoch) {
		// Someone else wrote the entry: the partition is lost.
		c.lose(n)
	}
}

func (c *shardCore) lose(n int) {
	c.mine[n] = holding{}
	c.losses++
	c.lostParts = append(c.lostParts, n)
}

// takeLost returns the partitions lost (not released) since the last call.
func (c *shardCore) takeLost() []int {
	l := c.lostParts
	c.lostParts = nil
	return l
}

// liveNodes returns the members seen within the lease, plus this node
// unless it is leaving, sorted.
func (c *shardCore) liveNodes(now int64) []string {
	c.live = c.live[:0]
	if !c.leaving {
		c.live = append(c.live, c.self)
	}
	for id, m := range c.members {
		if id != c.self && !c.lease.Free(m.seen, now) {
			c.live = append(c.live, id)
		}
	}
	slices.Sort(c.live)
	return c.live
}

// free reports whether partition n may be claimed at now: its entry is
// absent, or unchanged for a whole lease as observed here (O1).
func (c *shardCore) free(n int, now int64) bool {
	o := c.obs[n]
	return !o.exists || c.lease.Free(o.seen, now)
}

// serving reports whether this node may decide partition n's keys at now,
// and until when (exclusive; monotonic ns): its self-fence, 2/3 of the
// lease after the send instant of its last claim or renewal that landed
// (O1).
func (c *shardCore) serving(n int, now int64) (until int64, ok bool) {
	h := c.mine[n]
	if h.state != holdOwned && h.state != holdRenewing {
		return 0, false
	}
	until = c.lease.Until(h.renewedAt)
	if bugs.Planted(bugs.SelfFence) {
		until += 100 * int64(c.lease) // a test's planted bug
	}
	return until, now < until
}

// holds reports whether this node holds partition n (owned or renewing),
// whatever the time: it keeps its subscription while it tries to renew.
func (c *shardCore) holds(n int) bool {
	s := c.mine[n].state
	return s == holdOwned || s == holdRenewing
}

// tick returns the operations to issue at now.
func (c *shardCore) tick(now int64) []shardOp {
	var ops []shardOp
	if !c.leaving && !c.beating && now >= c.beatAfter && (c.lastBeat == 0 || now >= c.lease.RenewAt(c.lastBeat)) && c.watchLive() {
		c.beating = true
		ops = append(ops, shardOp{kind: opHeartbeat, at: now})
	}
	live := c.liveNodes(now)
	for n := range c.parts {
		target := ""
		if len(live) > 0 {
			target = hrwTarget(live, n)
		}
		h := &c.mine[n]
		o := c.obs[n]
		switch h.state {
		case holdNone:
			mayClaim := now >= c.claimAfter[n]
			switch {
			case !mayClaim && (target == c.self || o.node == c.self):
				// A claim just failed: not again before its backoff.
			case o.exists && o.node == c.self && (target == c.self || !c.sent[n]):
				// Our own entry from before (a restart with the same id, a
				// failed release): take it over in a new epoch, adopting
				// from our journal. An entry of an earlier incarnation of
				// this node is taken over even when the partition is
				// another node's now: its records are in our journal only,
				// and a release (checkpoint, then delete) by this
				// incarnation, which holds none of them in memory, would
				// hand the next owner the state bucket's older records
				// (invariant O4). The release that follows checkpoints
				// what was adopted.
				ops = append(ops, c.claim(n, o.rev, adoptSources(o), now))
			case o.exists && o.node == c.self && len(o.from) > 0:
				// Our claim whose adoption did not finish, and the
				// partition is another node's now: deleting the entry
				// would lose its sources. It expires; the next claimer
				// adopts from them (and from us) (invariant O7).
			case o.exists && o.node == c.self && c.kept[n] == o.rev:
				// Our entry whose release failed: it expires, and the
				// next claimer adopts from our journal.
			case o.exists && o.node == c.self:
				h.state = holdReleasing
				ops = append(ops, shardOp{kind: opRelease, part: n, rev: o.rev, at: now})
			case target == c.self && c.free(n, now):
				ops = append(ops, c.claim(n, o.rev, adoptSources(o), now))
			}
		case holdOwned:
			switch {
			case target != c.self:
				until := c.lease.Until(h.renewedAt)
				h.state = holdReleasing
				c.releases++
				ops = append(ops, shardOp{kind: opRelease, part: n, rev: h.rev, at: now, until: until})
			case now >= c.lease.RenewAt(h.renewedAt) && now >= h.retryAt:
				h.state = holdRenewing
				h.sentAt = now
				ops = append(ops, shardOp{kind: opRenew, part: n, rev: h.rev, epoch: h.epoch, at: now})
			}
		}
	}
	return ops
}

func (c *shardCore) claim(n int, rev uint64, sources []string, now int64) shardOp {
	c.mine[n] = holding{state: holdClaiming, sentAt: now}
	return shardOp{kind: opClaim, part: n, rev: rev, at: now, sources: sources}
}

// adoptSources returns the adoption sources of a claim over the entry o:
// its unfinished claim's sources, then the node it names (none when it
// does not exist), oldest first, at most maxAdoptSources. A node named
// twice is kept where it comes last: a claimer that took the partition
// back over a claim adopting from it ([a, b] then a) adopted b's records
// and wrote newer ones, and the reader's later sources win.
func adoptSources(o partObs) []string {
	if !o.exists {
		return nil
	}
	var src []string
	for _, id := range append(slices.Clone(o.from), o.node) {
		if NodeIDRE.MatchString(id) {
			src = append(slices.DeleteFunc(src, func(s string) bool { return s == id }), id)
		}
	}
	if len(src) > maxAdoptSources {
		src = src[len(src)-maxAdoptSources:]
	}
	return src
}

// claimed reports the result of an opClaim: the new revision, or err
// (conflict or other). now is the instant of the report.
func (c *shardCore) claimed(op shardOp, rev uint64, err error, now int64) {
	h := &c.mine[op.part]
	if h.state != holdClaiming {
		return
	}
	c.sent[op.part] = c.sent[op.part] || rev != 0 // the claim landed (its adoption may have failed)
	if err != nil {
		*h = holding{}
		c.claimFails[op.part]++
		c.claimAfter[op.part] = now + c.claimBackoff(c.claimFails[op.part])
		return
	}
	c.claimFails[op.part], c.claimAfter[op.part] = 0, 0
	*h = holding{state: holdOwned, epoch: rev, rev: rev, renewedAt: op.at}
	c.claims++
	c.wrote(op.part, rev, rev, now)
}

// claimBackoff is the pause after the fails'th consecutive failed claim of
// a partition: lease/32, doubling, at most lease/4 (fence.Lease.Backoff).
// A claim that fails at once (its tenure marker or the shards bucket
// refused) is not sent again at every tick, so a node whose journal or
// shards bucket fails does not spend its time on claims that keep failing
// (invariant O6 of docs/protocol.md).
func (c *shardCore) claimBackoff(fails int) int64 { return c.lease.Backoff(fails) }

// renewed reports the result of an opRenew. A conflict loses the
// partition; another error keeps it (serving stops by time if renewals
// keep failing).
func (c *shardCore) renewed(op shardOp, rev uint64, err error, conflict bool, now int64) {
	h := &c.mine[op.part]
	if h.state != holdRenewing {
		return
	}
	switch {
	case err == nil:
		h.state, h.rev, h.renewedAt = holdOwned, rev, op.at
		c.wrote(op.part, h.epoch, rev, now)
	case conflict:
		c.lose(op.part)
	default:
		h.state = holdOwned
		h.retryAt = op.at + c.retryPause()
	}
}

// retryPause is the pause between the send of a failed renewal or
// heartbeat and the next: the runner ticks the core after every result,
// and a write that fails at once (a closed connection) must not be sent
// again at once, in a loop that takes the CPU the live nodes need for their
// own renewals; one that failed by its timeout has waited longer already
// and is sent again at once (invariant O6 of docs/protocol.md).
func (c *shardCore) retryPause() int64 { return c.lease.RetryPause() }

// renewLanded reports an opRenew that came back as a conflict although it
// had landed: the entry at rev names this node in op's epoch (a renewal
// whose acknowledgement was lost, then sent again with the old revision).
// The partition stays held; the lease still counts from the last renewal
// known to have landed (the one that landed unseen was sent after it), so
// the next tick renews again, over rev.
func (c *shardCore) renewLanded(op shardOp, rev uint64, now int64) {
	h := &c.mine[op.part]
	if h.state != holdRenewing || h.epoch != op.epoch {
		return
	}
	h.state, h.rev = holdOwned, rev
	c.wrote(op.part, h.epoch, rev, now)
}

// wrote records this node's own write of partition n's entry (in epoch,
// at rev) as observed, unless the watcher reported a newer one already.
func (c *shardCore) wrote(n int, epoch, rev uint64, now int64) {
	if rev > c.obs[n].rev {
		c.obs[n] = partObs{exists: true, node: c.self, epoch: epoch, rev: rev, seen: now}
	}
}

// released reports the end of an opRelease: deleted reports whether the
// entry was deleted. Either way this node no longer holds the partition.
// After a delete it treats the entry as gone until the watcher reports a
// newer revision; a claim of its own then still expects revision op.rev
// (and fails harmlessly if the delete marker landed). Otherwise (the
// records were not checkpointed, or the delete failed) the entry is left
// to expire: its observation stays, so a claim of this node's own adopts
// from its journal again, and it is not released again.
func (c *shardCore) released(op shardOp, deleted bool, now int64) {
	h := &c.mine[op.part]
	if h.state != holdReleasing {
		return
	}
	*h = holding{}
	if !deleted {
		c.kept[op.part] = op.rev
		return
	}
	if o := c.obs[op.part]; o.rev <= op.rev {
		c.obs[op.part] = partObs{rev: op.rev, seen: now}
	}
}

// beat reports the end of a heartbeat.
func (c *shardCore) beat(op shardOp, rev uint64, err error) {
	c.beating = false
	if err == nil {
		c.lastBeat, c.beatRev = op.at, max(c.beatRev, rev)
		return
	}
	c.beatAfter = op.at + c.retryPause()
}

// watchLive reports whether the watch delivered this node's last heartbeat
// that landed. A node whose watch has stalled (it cannot see claims,
// renewals and releases) stops heartbeating, so the others stop assigning
// partitions to it: they would release them to a node that does not see
// the releases, and the partitions would go without an owner for as long
// as the watch stalls.
func (c *shardCore) watchLive() bool {
	return c.beatRev == 0 || c.members[c.self].rev >= c.beatRev
}

// watchStale reports whether the watch has not delivered this node's last
// heartbeat for a third of a lease after it was sent: the driver should
// watch anew.
func (c *shardCore) watchStale(now int64) bool {
	return !c.watchLive() && now > c.lease.RenewAt(c.lastBeat)
}

// settled reports whether every partition is held by this node or owned by
// a node whose entry is live (no partition waits for an owner).
func (c *shardCore) settled(now int64) bool {
	for n := range c.parts {
		if c.holds(n) {
			continue
		}
		o := c.obs[n]
		if !o.exists || o.node == c.self || c.free(n, now) {
			return false
		}
	}
	return true
}

// empty reports whether this node holds nothing (after leaving).
func (c *shardCore) empty() bool {
	for _, h := range c.mine {
		if h.state != holdNone {
			return false
		}
	}
	return true
}

// owned counts the partitions this node holds.
func (c *shardCore) owned() int {
	k := 0
	for n := range c.parts {
		if c.holds(n) {
			k++
		}
	}
	return k
}
