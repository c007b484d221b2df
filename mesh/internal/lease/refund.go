package lease

import (
	"math/big"

	"github.com/limitmesh/limitmesh/kvstate"
)

// Refund gives units micro-units of a grant made at grantedAt back to one
// limit's state s at now, as far as the algorithm allows, and returns the
// new state and the micro-units it took back. A refund never makes the
// limit hold more than it would have, had the grant never been made:
//
//	token_bucket  tokens += units, capped at burst (the refill meanwhile
//	              is already counted)
//	gcra          the same credit, the theoretical arrival time moved
//	              back by units/rate (rounded so as to add no credit
//	              beyond the exact amount), never before now
//	fixed_window  the window's count −= units, if the grant was made in
//	              the current window (a past window's units are gone)
//	sliding_window the same for the current window, or for the previous
//	              one if the grant was made then
//	sliding_log   the grant's own entry (made at grantedAt) shrinks, if
//	              it is still in the log
//	quota         the period's spend −= units, if the grant was made in
//	              the current period
//	concurrency   nothing (leased policies have no concurrency limits)
//
// It never mutates s. A state of another algorithm (never seen) is full
// or empty already: nothing to give back.
func Refund(l kvstate.Limit, s kvstate.State, now, units, grantedAt int64) (kvstate.State, int64) {
	if units <= 0 || s.Algorithm != l.Algorithm || l.Validate() != nil {
		return s, 0
	}
	a := kvstate.Advance(l, s, now)
	switch l.Algorithm {
	case kvstate.TokenBucket:
		// Tokens + units with the fraction kept, unless that passes the
		// burst (a full bucket has no fraction): then full.
		if gap := l.Burst - a.Tokens; units < gap || units == gap && a.Frac == 0 {
			a.Tokens += units
			return a, units
		}
		back := l.Burst - a.Tokens
		a.Tokens, a.Frac = l.Burst, 0
		return a, back
	case kvstate.GCRA:
		return refundGCRA(l, a, units)
	case kvstate.FixedWindow, kvstate.Quota:
		if windowOf(l, grantedAt) != a.WindowStart {
			return a, 0
		}
		back := min(units, a.Count)
		a.Count -= back
		return a, back
	case kvstate.SlidingWindow:
		switch windowOf(l, grantedAt) {
		case a.WindowStart:
			back := min(units, a.Count)
			a.Count -= back
			return a, back
		case a.WindowStart - l.Window:
			back := min(units, a.Prev)
			a.Prev -= back
			return a, back
		}
		return a, 0
	case kvstate.SlidingLog:
		log := append([]kvstate.LogEntry(nil), a.Log...)
		var back int64
		for i := len(log) - 1; i >= 0 && back < units; i-- {
			if log[i].At != grantedAt {
				continue
			}
			take := min(units-back, log[i].Cost)
			log[i].Cost -= take
			back += take
		}
		kept := log[:0]
		for _, e := range log {
			if e.Cost > 0 {
				kept = append(kept, e)
			}
		}
		if len(kept) == 0 {
			kept = nil
		}
		a.Log = kept
		return a, back
	}
	return s, 0
}

// windowOf returns the start of the window (or quota period) of l that
// holds t: a fresh state advanced to t starts there.
func windowOf(l kvstate.Limit, t int64) int64 {
	return kvstate.Advance(l, kvstate.State{}, t).WindowStart
}

// refundGCRA moves an advanced gcra state's theoretical arrival time back
// by units×P/Rate ns (P = RatePer, a second when 0), exactly in ticks:
// TAT + TATFrac/Rate ns is the debt's end; it never goes below the
// state's Last (a full bucket).
func refundGCRA(l kvstate.Limit, a kvstate.State, units int64) (kvstate.State, int64) {
	per := l.RatePer
	if per == 0 {
		per = kvstate.Second
	}
	rate := big.NewInt(l.Rate)
	// debt in ticks of 1/Rate ns: (TAT − Last)×Rate + TATFrac.
	debt := new(big.Int).Mul(big.NewInt(a.TAT-a.Last), rate)
	debt.Add(debt, big.NewInt(a.TATFrac))
	if a.TAT < a.Last || debt.Sign() <= 0 {
		return a, 0 // full
	}
	give := new(big.Int).Mul(big.NewInt(units), big.NewInt(per))
	if give.Cmp(debt) >= 0 {
		// Back to full: what was missing, in micro-units (rounded down).
		back := new(big.Int).Quo(debt, big.NewInt(per)).Int64()
		a.TAT, a.TATFrac = a.Last, 0
		return a, back
	}
	debt.Sub(debt, give)
	q, r := new(big.Int).QuoRem(debt, rate, new(big.Int))
	a.TAT = a.Last + q.Int64()
	a.TATFrac = r.Int64()
	return a, units
}
