// Package lease is the pure core of leased mode (CONTRACT §8): the grants a
// limit key's owner hands out and accounts for (book.go), what going back
// to a limit's state a returned grant may add (refund.go), and a holder
// node's accounting of the grants it holds and the sub-grants it carves
// from them for the gateways of its region (pool.go). Nothing here reads a
// clock, does I/O or starts a goroutine: every function takes the instant
// it works at, so tests drive it with step tables and properties.
//
// # The rules
//
// A grant debits its units from the key's limiter states when it is made
// (kvstate.DecideAll with the grant's units as the cost), so what its holder
// spends needs no round trip. The owner keeps every grant outstanding in
// the key's record (keyrec.Record.Grants), journalled like any other state
// change, until it is returned or expires:
//
//   - outstanding(t) = Σ (Units − Spent) over the record's grants with
//     t < Expires + Margin(ttl): units granted and neither reported spent,
//     returned nor expired. An acquire is granted only if outstanding stays
//     at most max_outstanding (invariant L1).
//   - A report names a grant by id and epoch and carries its holder's
//     cumulative spend; a return does too and gives the rest back: Units −
//     Spent go back into the states (refund.go: never above what the
//     algorithm allows). A report or return whose epoch is older than the
//     owner's, or that names no outstanding grant of that epoch, is refused
//     and changes nothing (L2).
//   - An expired grant is dropped with no refund: units its holder did not
//     report are treated as spent, so a holder that crashed or was cut off
//     never makes the key admit more than its grants allowed (L3).
//   - A holder stops spending a grant at its own instant of asking plus the
//     ttl less Margin(ttl) (the skew margin); the owner counts the grant
//     outstanding until Expires + Margin(ttl) by its own clock (L4). So a
//     holder's clock may run slow, and a new owner's clock may be ahead of
//     the old owner's, by up to the margin each.
//
// The bound. With honest holders (a return carries the holder's true
// spend), every admission is either a strict decision of the owner (a
// debit) or a spend from a grant, and over any interval [t1, t2]
//
//	admitted(t1, t2) <= burst + rate*(t2 − t1) + max_outstanding
//
// for a token bucket (and the window algorithms' per-window equivalents):
// the debits and refunds inside the interval are bounded by the bucket's
// own envelope, and what is spent inside it from grants made before t1 is
// at most what was outstanding at t1 (TestBoundProperty checks it with
// failovers, reports lost and holders crashing). max_outstanding is the
// overshoot bound that `limitmesh policy explain` prints.
//
// lease imports kvstate, policies, keyrec and bugs (test switches, book.go).
package lease

import (
	"time"

	"github.com/limitmesh/limitmesh/policies"
)

// Params are a leased policy's grant parameters in the core's units.
type Params struct {
	Size           int64 // micro-units: the most one grant holds
	MaxOutstanding int64 // micro-units outstanding per key at most
	TTL            int64 // ns a grant may be spent
}

// ParamsOf returns the grant parameters of a leased policy's lease.
func ParamsOf(l policies.Lease) Params {
	return Params{Size: l.Size, MaxOutstanding: l.MaxOutstanding, TTL: int64(l.TTL)}
}

// MarginDivisor sets the skew margin: Margin(ttl) = ttl / MarginDivisor.
const MarginDivisor = 10

// Margin returns the skew margin of a grant of ttl ns: a tenth of it
// (200 ms for the default 2 s). A holder stops spending a grant Margin
// before its ttl has passed by its own clock, counted from the instant it
// sent its request; an owner counts the grant outstanding until Margin
// after its expiry by its own clock. Holders' clocks may so run up to
// Margin/ttl (10%) slow, and owners' clocks disagree by up to Margin,
// without a grant being spent while it is not counted.
func Margin(ttl int64) int64 { return ttl / MarginDivisor }

// HolderDeadline returns the instant (on the holder's clock) at which a
// holder that sent its request at sent stops spending a grant of ttl ns.
func HolderDeadline(sent int64, ttl int64) int64 { return sent + ttl - Margin(ttl) }

// MarginOf is Margin for a time.Duration.
func MarginOf(ttl time.Duration) time.Duration { return time.Duration(Margin(int64(ttl))) }
