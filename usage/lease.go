package usage

import "time"

// leaseCore is the arithmetic of an [Elector]'s lease, free of I/O and
// clocks: the driver feeds it what it observed and what its writes
// returned, with the instants (monotonic, on the driver's own clock), and
// asks it what to do next and whether it leads.
//
// The rules (lease L):
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
//
// Any successful write was sent before the entry held its revision, and
// every other elector's first read of that revision came after; so a
// takeover happens at least L after the holder's last successful send,
// while the holder stopped 2L/3 after it: L/3 of margin for clock rate
// differences and for the job to wind down. Clocks of different nodes are
// never compared. Whatever the timing, two writers never both succeed
// against the same revision.
type leaseCore struct {
	lease time.Duration

	known    bool          // rev/exists reflect a read or write since the last conflict
	exists   bool          // the entry holds a lease (not absent, deleted or purged)
	rev      uint64        // its revision (0 when absent)
	mine     bool          // the entry at rev was written by this elector
	since    time.Duration // first instant rev (and exists) was seen
	lastRead time.Duration // the last read's instant

	fence    time.Duration // leads while now < fence
	lastSend time.Duration // send instant of the last successful write
	retryAt  time.Duration // no operation before this instant (after a failure)
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
	rev  uint64        // opWrite: the expected revision
	at   time.Duration // opWait: when to ask again
}

// writeResult is the outcome of a claim or compare-and-swap.
type writeResult int

const (
	writeOK       writeResult = iota // landed: the new revision is given
	writeConflict                    // the revision moved (another writer), or the entry exists
	writeFailed                      // no answer: it may or may not have landed
)

func (c *leaseCore) period() time.Duration { return c.lease / 3 }

// retryDelay is the pause after a failed read or write.
func (c *leaseCore) retryDelay() time.Duration {
	d := c.lease / 10
	if d > time.Second {
		d = time.Second
	}
	return d
}

// leads reports whether the elector leads at now.
func (c *leaseCore) leads(now time.Duration) bool { return c.mine && now < c.fence }

// next returns the operation due at now.
func (c *leaseCore) next(now time.Duration) leaseOp {
	if now < c.retryAt {
		return leaseOp{kind: opWait, at: c.retryAt}
	}
	if c.mine {
		due := c.lastSend + c.period()
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
	takeAt := c.since + c.lease
	if now >= takeAt {
		return leaseOp{kind: opWrite, rev: c.rev}
	}
	readAt := c.lastRead + c.period()
	if now >= readAt {
		return leaseOp{kind: opRead}
	}
	return leaseOp{kind: opWait, at: min(readAt, takeAt)}
}

// observe records a read at now: whether the entry holds a lease, its
// revision and whether this elector wrote it.
func (c *leaseCore) observe(now time.Duration, exists bool, rev uint64, mine bool) {
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
func (c *leaseCore) readFailed(now time.Duration) { c.retryAt = now + c.retryDelay() }

// wrote records the outcome, known at now, of a write sent at sendAt.
func (c *leaseCore) wrote(sendAt, now time.Duration, res writeResult, newRev uint64) {
	switch res {
	case writeOK:
		c.known, c.exists, c.rev, c.mine = true, true, newRev, true
		c.since, c.lastRead = now, now
		c.lastSend = sendAt
		c.fence = sendAt + 2*c.lease/3
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
		c.retryAt = now + c.retryDelay()
	}
}
