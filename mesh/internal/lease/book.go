package lease

import (
	"github.com/limitmesh/limitmesh/internal/bugs"
	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
)

// The owner's side: acquires, reports and returns applied to a key's
// record. Each function changes rec in place (the owner's own record; its
// slices are replaced, never written through, so a record shared with a
// pending write stays intact) and reports whether rec changed.

// Outcome is the result of an acquire.
type Outcome uint8

const (
	// Granted: a grant was made (AcquireResult.Grant).
	Granted Outcome = iota + 1
	// Exhausted: the key's limits do not hold Min units now; RetryAfter
	// is when they would, with no other traffic (kvstate.Never: Min is
	// above a limit's capacity). A holder may deny locally until then.
	Exhausted
	// Full: no grant can hold Min units now: max_outstanding (or
	// keyrec.MaxGrants) leaves no room for them, or Min is above the
	// grant size. The limits may have them: the holder decides remotely
	// (strict). RetryAfter is when the earliest outstanding grant stops
	// counting.
	Full
)

var outcomeNames = [...]string{Granted: "granted", Exhausted: "exhausted", Full: "full"}

// String returns the outcome's wire word ("granted", "exhausted", "full").
func (o Outcome) String() string {
	if int(o) < len(outcomeNames) && outcomeNames[o] != "" {
		return outcomeNames[o]
	}
	return "unknown"
}

// AcquireReq is a holder's request for a grant.
type AcquireReq struct {
	Holder string // the holder's id (1..keyrec.MaxHolderBytes bytes)
	Want   int64  // micro-units wanted (> 0); a grant holds at most min(Want, Size)
	Min    int64  // the least worth granting (> 0; raised to at most Want)
}

// AcquireResult is what an acquire did.
type AcquireResult struct {
	Outcome Outcome
	Grant   keyrec.Grant // Granted: the grant made
	// Remaining is the micro-units left in the key's limits (the least)
	// after the grant, or now when none was made.
	Remaining  int64
	RetryAfter int64 // ns; see Outcome
}

// Outstanding returns the micro-units outstanding at now among gs: Units −
// Spent of each grant that still counts (now < Expires + margin).
func Outstanding(gs []keyrec.Grant, now, margin int64) int64 {
	var sum int64
	for i := range gs {
		if now < gs[i].Expires+margin {
			sum += gs[i].Units - gs[i].Spent
		}
	}
	return sum
}

// Prune drops the grants of rec that no longer count at now (expired
// more than margin ago), with no refund (L3). It reports whether it
// dropped any.
func Prune(rec *keyrec.Record, now, margin int64) bool {
	keep := 0
	for i := range rec.Grants {
		if now < rec.Grants[i].Expires+margin {
			keep++
		}
	}
	if keep == len(rec.Grants) {
		return false
	}
	gs := make([]keyrec.Grant, 0, keep)
	for _, g := range rec.Grants {
		if now < g.Expires+margin {
			gs = append(gs, g)
		}
	}
	if len(gs) == 0 {
		gs = nil
	}
	rec.Grants = gs
	return true
}

// Acquire makes a grant for req at now in the owner's epoch, if the key's
// limits (whose states are rec.States, in limits' order) hold at least
// req.Min units and max_outstanding leaves room for them: the grant holds
// min(req.Want, p.Size, what the limits hold, the room), is debited from
// every limit at once, and is added to rec with the next id. It reports
// whether rec changed (a grant made, or expired grants pruned). When
// req.Min is a whole number of units, so is the grant.
func Acquire(p Params, limits []kvstate.Limit, rec *keyrec.Record, now int64, epoch uint64, req AcquireReq) (AcquireResult, bool) {
	margin := Margin(p.TTL)
	changed := Prune(rec, now, margin)
	want := min(req.Want, p.Size, p.MaxOutstanding)
	least := max(req.Min, 1)
	if want <= 0 || len(req.Holder) == 0 || len(req.Holder) > keyrec.MaxHolderBytes {
		return AcquireResult{Outcome: Exhausted, RetryAfter: kvstate.Never}, changed
	}
	room := p.MaxOutstanding - Outstanding(rec.Grants, now, margin)
	if room < least || least > want || len(rec.Grants) >= keyrec.MaxGrants {
		if least <= want {
			// No room, and when the limits lack the units too the key
			// is exhausted: its holders deny here until they come back,
			// rather than send every request to the owner (full).
			if probe, _ := kvstate.DecideAll(limits, rec.States, now, least, nil); !probe.Allowed {
				return AcquireResult{Outcome: Exhausted, Remaining: probe.Remaining, RetryAfter: probe.RetryAfter}, changed
			}
		}
		d, _ := kvstate.DecideAll(limits, rec.States, now, 0, nil)
		return AcquireResult{Outcome: Full, Remaining: d.Remaining, RetryAfter: firstRelease(rec.Grants, now, margin)}, changed
	}
	probe, _ := kvstate.DecideAll(limits, rec.States, now, least, nil)
	if !probe.Allowed {
		return AcquireResult{Outcome: Exhausted, Remaining: probe.Remaining, RetryAfter: probe.RetryAfter}, changed
	}
	units := min(want, room, probe.Remaining+least)
	if least%kvstate.Unit == 0 {
		// A holder of whole units gets whole units: a fraction left in a
		// grant serves none of its requests and only counts against
		// max_outstanding until the grant ends.
		units -= units % kvstate.Unit
	}
	d, states := kvstate.DecideAll(limits, rec.States, now, units, nil)
	if !d.Allowed {
		// Remaining rounds down, so this is not expected; the least
		// always fits (the probe admitted it).
		units = least
		d, states = kvstate.DecideAll(limits, rec.States, now, units, nil)
	}
	rec.States = states
	rec.GrantSeq++
	g := keyrec.Grant{ID: rec.GrantSeq, Epoch: epoch, Holder: req.Holder, Units: units, At: now, Expires: now + p.TTL}
	gs := make([]keyrec.Grant, 0, len(rec.Grants)+1)
	rec.Grants = append(append(gs, rec.Grants...), g)
	return AcquireResult{Outcome: Granted, Grant: g, Remaining: d.Remaining}, true
}

// firstRelease returns the ns from now until the first grant of gs stops
// counting (1 when none does).
func firstRelease(gs []keyrec.Grant, now, margin int64) int64 {
	var first int64
	for i := range gs {
		if at := gs[i].Expires + margin - now; at > 0 && (first == 0 || at < first) {
			first = at
		}
	}
	return max(first, 1)
}

// ReportReq is a holder's report of a grant: its cumulative spend, and
// whether the holder gives the grant back (a return).
type ReportReq struct {
	ID     uint64
	Epoch  uint64
	Spent  int64 // cumulative micro-units spent from the grant
	Return bool  // the holder stops spending it: the rest goes back
}

// Report applies a report or return at now in the owner's epoch. The
// spend recorded is the largest reported (reports may arrive out of
// order); a return then refunds Units − that spend into every limit
// (Refund) and removes the grant. It returns the micro-units refunded
// (the most any limit took back), whether rec changed, and an error
// wrapping ErrStaleEpoch, ErrUnknownGrant or ErrBadSpend for a refused
// report, which changes nothing but pruning.
func Report(p Params, limits []kvstate.Limit, rec *keyrec.Record, now int64, epoch uint64, req ReportReq) (refunded int64, changed bool, err error) {
	changed = Prune(rec, now, Margin(p.TTL))
	if req.Epoch < epoch && !bugs.Planted(bugs.StaleEpochReport) {
		return 0, changed, ErrStaleEpoch
	}
	at := -1
	for i := range rec.Grants {
		if rec.Grants[i].ID == req.ID && rec.Grants[i].Epoch == req.Epoch {
			at = i
			break
		}
	}
	if at < 0 {
		return 0, changed, ErrUnknownGrant
	}
	g := rec.Grants[at]
	if req.Spent < 0 || req.Spent > g.Units {
		return 0, changed, ErrBadSpend
	}
	spent := max(g.Spent, req.Spent)
	gs := make([]keyrec.Grant, 0, len(rec.Grants))
	gs = append(gs, rec.Grants[:at]...)
	if !req.Return {
		if spent == g.Spent {
			return 0, changed, nil
		}
		g.Spent = spent
		gs = append(gs, g)
		rec.Grants = append(gs, rec.Grants[at+1:]...)
		return 0, true, nil
	}
	gs = append(gs, rec.Grants[at+1:]...)
	if len(gs) == 0 {
		gs = nil
	}
	rec.Grants = gs
	back := g.Units - spent
	if bugs.Planted(bugs.RefundSpent) {
		back = g.Units
	}
	if back > 0 {
		states := make([]kvstate.State, len(limits))
		for i, l := range limits {
			var s kvstate.State
			if i < len(rec.States) {
				s = rec.States[i]
			}
			var r int64
			states[i], r = Refund(l, s, now, back, g.At)
			refunded = max(refunded, r)
		}
		rec.States = states
	}
	return refunded, true, nil
}
