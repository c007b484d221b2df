package elector

import "github.com/limitmesh/limitmesh/internal/fence"

// leaseCore is the arithmetic of an [Elector]'s lease, free of I/O and clocks:
// the driver feeds it what it observed and what its writes returned, with
// the instants (ns of the driver's own monotonic clock), and asks it what
// to do next and whether it leads. The timing is package fence's rule,
// the one partition ownership keeps (O1 and O6 of docs/protocol.md):
//
//   - The holder renews with compare-and-swap on the entry's revision
//     every L/3 after the send instant of its last successful write, and
//     leads until 2L/3 after that send instant (it fences itself: it stops
//     even when it cannot reach the server to learn anything).
//   - Another elector reads the entry every L/3. It claims an absent
//     (never written, deleted or released) entry at once, and takes over
//     an entry whose revision it has seen unchanged for a whole L on its
//     own clock, from the first read that returned that revision, with
//     compare-and-swap on that revision.
//   - A read or write that gets no answer is retried after L/16.
//
// Whatever the timing, two writers never both succeed against the same
// revision.
type leaseCore struct {
	lease fence.Lease

	known    bool   // rev/exists reflect a read or write since the last conflict
	exists   bool   // the entry holds a lease (not absent, deleted or purged)
	rev      uint64 // its revision (0 when absent)
	mine     bool   // the entry at rev was written by this elector
	since    int64  // first instant rev (and exists) was seen
	lastRead int64  // the last read's instant

	fence    int64 // leads while now < fence; 0: no send instant to lead from
	lastSend int64 // send instant of the last successful write
	retryAt  int64 // no operation before this instant (after a failure)
}

// opKind is what the driver does next.
type opKind int

const (
	opWait  opKind = iota // nothing before op.at
	opRead                // read the entry, then observe
	opClaim               // create the entry (absent), then wrote
	opWrite               // compare-and-swap on op.rev (renew or take over), then wrote
)

// leaseOp is the driver's next operation.
type leaseOp struct {
	kind opKind
	rev  uint64 // opWrite: the expected revision
	at   int64  // opWait: when to ask again
}

// writeResult is the outcome of a claim or compare-and-swap.
type writeResult int

const (
	writeOK       writeResult = iota // landed: the new revision is given
	writeConflict                    // the revision moved (another writer), or the entry exists
	writeFailed                      // no answer: it may or may not have landed
)

// leads reports whether the elector leads at now.
func (c *leaseCore) leads(now int64) bool { return c.mine && now < c.fence }

// next returns the operation due at now.
func (c *leaseCore) next(now int64) leaseOp {
	if now < c.retryAt {
		return leaseOp{kind: opWait, at: c.retryAt}
	}
	if c.mine {
		due := c.lease.RenewAt(c.lastSend)
		if c.fence == 0 || now >= due {
			// fence 0: the entry was found to be ours (a write whose
			// answer was lost); renew to learn a send instant.
			return leaseOp{kind: opWrite, rev: c.rev}
		}
		return leaseOp{kind: opWait, at: due}
	}
	if !c.known {
		return leaseOp{kind: opRead}
	}
	if !c.exists {
		return leaseOp{kind: opClaim}
	}
	takeAt := c.lease.FreeAt(c.since)
	if now >= takeAt {
		return leaseOp{kind: opWrite, rev: c.rev}
	}
	readAt := c.lastRead + c.lease.Period()
	if now >= readAt {
		return leaseOp{kind: opRead}
	}
	return leaseOp{kind: opWait, at: min(readAt, takeAt)}
}

// observe records a read at now: whether the entry holds a lease, its
// revision and whether this elector wrote it.
func (c *leaseCore) observe(now int64, exists bool, rev uint64, mine bool) {
	if !c.known || exists != c.exists || rev != c.rev {
		c.since = now
	}
	c.known, c.exists, c.rev, c.lastRead = true, exists, rev, now
	if mine && exists {
		// Our write landed but its answer was lost: we hold the entry,
		// with no send instant to lead from until the next renewal.
		if !c.mine {
			c.fence = 0
		}
		c.mine = true
		return
	}
	c.mine, c.fence = false, 0
}

// readFailed records a read that got no answer at now.
func (c *leaseCore) readFailed(now int64) { c.retryAt = now + c.lease.RetryPause() }

// wrote records the outcome, known at now, of a write sent at sendAt.
func (c *leaseCore) wrote(sendAt, now int64, res writeResult, newRev uint64) {
	switch res {
	case writeOK:
		c.known, c.exists, c.rev, c.mine = true, true, newRev, true
		c.since, c.lastRead = now, now
		c.lastSend = sendAt
		c.fence = c.lease.Until(sendAt)
		c.retryAt = 0
	case writeConflict:
		// Someone else wrote (or our own earlier write landed): stop
		// leading at once and read what is there.
		c.known, c.mine, c.fence = false, false, 0
		c.retryAt = 0
	case writeFailed:
		// Keep leading until the fence; try again shortly. A claim or
		// takeover that may have landed is learnt from the next read.
		if !c.mine {
			c.known = false
		}
		c.retryAt = now + c.lease.RetryPause()
	}
}
