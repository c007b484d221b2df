package elector

import "testing"

// leaseStep is one step of a lease timeline: at instant at (ms on the
// elector's own clock), feed an input, then check what the core asks for
// and whether it leads.
type leaseStep struct {
	at    int64 // ms
	input func(c *leaseCore, now int64)
	want  leaseOp
	leads bool
}

func ms(n int64) int64 { return n * 1_000_000 }

func observed(exists bool, rev uint64, mine bool) func(*leaseCore, int64) {
	return func(c *leaseCore, now int64) { c.observe(now, exists, rev, mine) }
}

func wroteAt(sendMs int64, res writeResult, rev uint64) func(*leaseCore, int64) {
	return func(c *leaseCore, now int64) { c.wrote(ms(sendMs), now, res, rev) }
}

func readFail(c *leaseCore, now int64) { c.readFailed(now) }

func runLease(t *testing.T, steps []leaseStep) {
	t.Helper()
	c := &leaseCore{lease: 3000 * 1_000_000}
	for i, s := range steps {
		now := ms(s.at)
		if s.input != nil {
			s.input(c, now)
		}
		if got := c.next(now); got != s.want {
			t.Fatalf("step %d (t=%dms): next = %+v, want %+v", i, s.at, got, s.want)
		}
		if got := c.leads(now); got != s.leads {
			t.Fatalf("step %d (t=%dms): leads = %v, want %v", i, s.at, got, s.leads)
		}
	}
}

func waitUntil(n int64) leaseOp { return leaseOp{kind: opWait, at: ms(n)} }

// Lease 3 s: renew every 1 s, fence 2 s after a renewal's send, take over
// after 3 s of an unchanged revision, read every 1 s, retry a failure
// after 187.5 ms.
func TestLeaseClaimRenewFence(t *testing.T) {
	runLease(t, []leaseStep{
		{at: 0, want: leaseOp{kind: opRead}},
		{at: 5, input: observed(false, 0, false), want: leaseOp{kind: opClaim}},
		{at: 10, input: wroteAt(6, writeOK, 1), want: waitUntil(1006), leads: true},
		{at: 1006, want: leaseOp{kind: opWrite, rev: 1}, leads: true},
		{at: 1020, input: wroteAt(1007, writeOK, 2), want: waitUntil(2007), leads: true},
		// The renewal at 2007 gets no answer; retry L/16 later.
		{at: 2007, want: leaseOp{kind: opWrite, rev: 2}, leads: true},
		{at: 2500, input: wroteAt(2007, writeFailed, 0), want: leaseOp{kind: opWait, at: ms(2500) + 187_500_000}, leads: true},
		{at: 2688, want: leaseOp{kind: opWrite, rev: 2}, leads: true},
		// Still no answer: fenced at 1007 + 2000, whatever the server did.
		{at: 3006, input: wroteAt(2688, writeFailed, 0), want: leaseOp{kind: opWait, at: ms(3006) + 187_500_000}, leads: true},
		{at: 3007, want: leaseOp{kind: opWait, at: ms(3006) + 187_500_000}, leads: false},
		// The server is back; the CAS on rev 2 succeeds: leading again.
		{at: 3400, input: wroteAt(3306, writeOK, 3), want: waitUntil(4306), leads: true},
	})
}

func TestLeaseTakeover(t *testing.T) {
	runLease(t, []leaseStep{
		{at: 0, want: leaseOp{kind: opRead}},
		{at: 10, input: observed(true, 7, false), want: waitUntil(1010)},
		{at: 1010, want: leaseOp{kind: opRead}},
		// Renewed by the holder: the takeover clock restarts.
		{at: 1015, input: observed(true, 8, false), want: waitUntil(2015)},
		{at: 2015, input: observed(true, 8, false), want: waitUntil(3015)},
		{at: 3015, input: observed(true, 8, false), want: waitUntil(4015)},
		// Unchanged since 1015 for 3 s: take over.
		{at: 4015, want: leaseOp{kind: opWrite, rev: 8}},
		// Someone else was faster: read again.
		{at: 4020, input: wroteAt(4015, writeConflict, 0), want: leaseOp{kind: opRead}},
		{at: 4025, input: observed(true, 9, false), want: waitUntil(5025)},
	})
}

func TestLeaseTakeoverWins(t *testing.T) {
	runLease(t, []leaseStep{
		{at: 0, input: observed(true, 4, false), want: waitUntil(1000)},
		{at: 1000, input: observed(true, 4, false), want: waitUntil(2000)},
		{at: 2000, input: observed(true, 4, false), want: waitUntil(3000)},
		{at: 3000, want: leaseOp{kind: opWrite, rev: 4}},
		{at: 3010, input: wroteAt(3001, writeOK, 5), want: waitUntil(4001), leads: true},
		{at: 5000, want: leaseOp{kind: opWrite, rev: 5}, leads: true},
		{at: 5001, leads: false, want: leaseOp{kind: opWrite, rev: 5}},
	})
}

// A released (deleted) entry is claimed at once; a failed read waits.
func TestLeaseReleasedAndFailures(t *testing.T) {
	runLease(t, []leaseStep{
		{at: 0, input: observed(true, 4, false), want: waitUntil(1000)},
		{at: 1000, input: readFail, want: leaseOp{kind: opWait, at: ms(1000) + 187_500_000}},
		{at: 1188, want: leaseOp{kind: opRead}},
		{at: 1190, input: observed(false, 0, false), want: leaseOp{kind: opClaim}},
		// The claim's answer is lost: read to learn whether it landed.
		{at: 1400, input: wroteAt(1191, writeFailed, 0), want: leaseOp{kind: opWait, at: ms(1400) + 187_500_000}},
		{at: 1588, want: leaseOp{kind: opRead}},
		// It landed (the entry names us) but we have no send instant: not
		// leading until a renewal succeeds.
		{at: 1590, input: observed(true, 5, true), want: leaseOp{kind: opWrite, rev: 5}},
		{at: 1600, input: wroteAt(1591, writeOK, 6), want: waitUntil(2591), leads: true},
	})
}

// A conflict on renewal stops leading at once.
func TestLeaseRenewConflict(t *testing.T) {
	runLease(t, []leaseStep{
		{at: 0, input: observed(false, 0, false), want: leaseOp{kind: opClaim}},
		{at: 1, input: wroteAt(0, writeOK, 1), want: waitUntil(1000), leads: true},
		{at: 1001, input: wroteAt(1000, writeConflict, 0), want: leaseOp{kind: opRead}, leads: false},
		{at: 1002, input: observed(true, 2, false), want: waitUntil(2002)},
	})
}
