// Package fence is the self-fencing lease rule, the one arithmetic behind
// every lease of the module: partition ownership
// (mesh/internal/ownership, invariants O1 and O6 of docs/protocol.md) and
// the elector that keeps one ledger reconciler and one shadow evaluator
// active (internal/elector, docs/protocol.md "The elector").
//
// A lease is one KV entry, written only with compare-and-swap. With lease
// L, on each node's own monotonic clock (ns; clocks of different nodes are
// never compared):
//
//   - the holder renews every L/3 after the send instant of its last
//     write that landed ([Lease.RenewAt]);
//   - it acts (serves a partition, runs a job) only until 2L/3 after that
//     send instant ([Lease.Until]), even when it cannot reach the server
//     to learn anything: it fences itself;
//   - a contender may claim the entry only a whole L after the instant it
//     observed the entry's last change ([Lease.FreeAt]).
//
// A write is sent before the entry holds its revision, and every other
// node observes that revision after it holds it, so a contender claims at
// least L after the holder's send while the holder stopped 2L/3 after it.
// That holds whatever the clocks' offsets, as long as a contender's clock
// runs less than 3/2 as fast as the holder's (rates within 20% of each
// other: 1.2/0.8 = 3/2, invariant I1), and leaves L/3 of the holder's
// clock for scheduling and for the job to wind down.
//
// Failed writes are paced ([Lease.RetryPause], [Lease.Backoff]; invariant
// O6): a write that fails at once (a closed connection) is not sent again
// at once, in a loop taking the CPU that live nodes need for their own
// renewals.
//
// fence does no I/O, reads no clock and imports nothing.
package fence

// Lease is a lease duration L in ns and the rule over it. Its methods take
// and return instants of one node's monotonic clock, ns.
type Lease int64

// Period is L/3: the holder's renewal interval, the interval between a
// contender's reads of the entry, and a node's heartbeat interval.
func (l Lease) Period() int64 { return int64(l) / 3 }

// RenewAt is the instant a holder renews a lease whose last write that
// landed was sent at sent: L/3 after the send.
func (l Lease) RenewAt(sent int64) int64 { return sent + l.Period() }

// Until is the instant a holder stops acting on a lease whose last write
// that landed was sent at sent (exclusive): 2L/3 after the send (the
// self-fence, O1).
func (l Lease) Until(sent int64) int64 { return sent + int64(l)*2/3 }

// Acts reports whether a holder whose last write that landed was sent at
// sent may act at now.
func (l Lease) Acts(sent, now int64) bool { return now < l.Until(sent) }

// FreeAt is the instant from which a contender may claim an entry whose
// last change it observed at seen: a whole L later (O1).
func (l Lease) FreeAt(seen int64) int64 { return seen + int64(l) }

// Free reports whether an entry whose last change was observed at seen may
// be claimed at now. An entry not Free is live: its writer (a renewing
// holder, a heartbeating node) is taken to be alive.
func (l Lease) Free(seen, now int64) bool { return now >= l.FreeAt(seen) }

// RetryPause is the pause after a failed renewal, heartbeat or read before
// the next: L/16 (O6).
func (l Lease) RetryPause() int64 { return int64(l) / 16 }

// Backoff is the pause after the fails'th consecutive failed claim (fails
// at least 1): L/32, doubling, at most L/4 (O6).
func (l Lease) Backoff(fails int) int64 {
	d, most := int64(l)/32, int64(l)/4
	for i := 1; i < fails && d < most; i++ {
		d *= 2
	}
	return min(d, most)
}
