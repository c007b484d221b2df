package kvstate

// Decide decides a request of cost micro-units at now (Unix ns) against one
// limit and returns the decision and the state to store.
//
// s is the limit's stored state; a state of another algorithm (the zero
// State included) is a never-seen key, which starts full (buckets) or empty
// (windows, logs, holds). An admitted request returns the new state with
// cost spent; a denial spends nothing and returns s itself, so a caller
// need not write it back. A cost <= 0 is a probe: admitted, spending
// nothing, reporting Remaining and ResetAfter. Decide never mutates s, never
// reads a clock and, for token_bucket, gcra, the windows and quota, never
// allocates.
//
// On a concurrency limit Decide acquires an anonymous hold: it is
// Acquire(l, s, now, "", cost), whose slots come back when the hold expires
// after l.Window. Use [Acquire] and [Release] with a holder id to give
// slots back early.
//
// A limit that is not usable (unknown algorithm, or a non-positive field the
// algorithm needs; see [Limit.Validate]) is denied with RetryAfter [Never]
// and s is returned unchanged.
func Decide(l Limit, s State, now, cost int64) (d Decision, ns State) {
	d = decideInto(&l, &s, now, cost, &ns)
	return d, ns
}

// DecideTo is [Decide] through pointers, for callers that keep many
// states: it writes the new state to *out and returns the decision. *l
// and *s are only read; out must not alias s.
func DecideTo(l *Limit, s *State, now, cost int64, out *State) Decision {
	return decideInto(l, s, now, cost, out)
}

// decideInto is Decide writing the new state to *out. *s is only read;
// out may not alias s. Pointers keep the large State from being copied on
// the hot path.
func decideInto(l *Limit, s *State, now, cost int64, out *State) Decision {
	if !l.usable() {
		*out = *s
		return Decision{RetryAfter: Never}
	}
	var d Decision
	switch l.Algorithm {
	case TokenBucket:
		return decideTokenBucket(l, s, now, cost, out)
	case GCRA:
		return decideGCRA(l, s, now, cost, out)
	case Quota:
		return decideQuota(l, s, now, cost, out)
	case FixedWindow:
		return decideFixedWindow(l, s, now, cost, out)
	case SlidingWindow:
		return decideSlidingWindow(l, s, now, cost, out)
	case SlidingLog:
		d, *out = decideSlidingLog(*l, *s, now, cost)
	case Concurrency:
		d, *out = Acquire(*l, *s, now, "", cost)
	default:
		*out = *s
		d = Decision{RetryAfter: Never}
	}
	return d
}

// DecideAll decides one request against every limit of a key: it is admitted
// only if every limit admits it, and then it spends in all of them; a
// denial spends in none and the returned states are the inputs unchanged.
// states[i] belongs to limits[i]; a states slice shorter than limits means
// "never seen" (the zero State) for the missing ones. The new states are
// appended to dst[:0]: pass a reused slice to avoid allocating (one
// token_bucket or gcra limit then decides with no allocation). dst may be
// states itself (states[:0]); any other overlap of dst and states is not
// supported.
//
// The merged Decision: Allowed is true iff every limit admits (and true for
// no limits); Remaining is the least Remaining, unspent when denied;
// ResetAfter is that limit's; RetryAfter is the largest RetryAfter among the
// denying limits, or [Never] if any of them is Never. DecideAll never
// mutates limits or states.
func DecideAll(limits []Limit, states []State, now, cost int64, dst []State) (Decision, []State) {
	return decideAll(limits, states, now, cost, nil, dst)
}

// HoldSpec names the hold a reservation takes in concurrency limits: its
// holder id and expiry (CONTRACT §10).
type HoldSpec struct {
	ID      string
	Expires int64
}

// DecideAllHold is [DecideAll] for a reservation: a concurrency limit
// takes a hold named h.ID until h.Expires (at most its window) instead of
// an anonymous one, so [Release] and [Extend] find it.
func DecideAllHold(limits []Limit, states []State, now, cost int64, h HoldSpec, dst []State) (Decision, []State) {
	return decideAll(limits, states, now, cost, &h, dst)
}

func decideAll(limits []Limit, states []State, now, cost int64, h *HoldSpec, dst []State) (Decision, []State) {
	if len(states) > 0 && cap(dst) > 0 && &dst[:1][0] == &states[0] {
		dst = nil // deciding in place: keep the inputs for a denial
	}
	dst = dst[:0]
	out := Decision{Allowed: true}
	var never State
	for i := range limits {
		s := &never
		if i < len(states) {
			s = &states[i]
		}
		dst = append(dst, State{})
		var d Decision
		if h != nil && limits[i].Algorithm == Concurrency {
			d, dst[i] = AcquireUntil(limits[i], *s, now, h.ID, cost, h.Expires)
		} else {
			d = decideInto(&limits[i], s, now, cost, &dst[i])
		}
		if !d.Allowed {
			if out.Allowed || out.RetryAfter != Never && (d.RetryAfter == Never || d.RetryAfter > out.RetryAfter) {
				out.RetryAfter = d.RetryAfter
			}
			out.Allowed = false
		}
		if i == 0 || d.Remaining < out.Remaining {
			out.Remaining, out.ResetAfter = d.Remaining, d.ResetAfter
		}
	}
	if out.Allowed {
		return out, dst
	}
	// Denied: nothing is spent. A probe (cost 0) reports each limit's
	// unspent Remaining and ResetAfter, which for a denying limit are the
	// ones its denial reported.
	for i, l := range limits {
		var s State
		if i < len(states) {
			s = states[i]
		}
		dst[i] = s
		d, _ := Decide(l, s, now, 0)
		if i == 0 || d.Remaining < out.Remaining {
			out.Remaining, out.ResetAfter = d.Remaining, d.ResetAfter
		}
	}
	return out, dst
}

// Advance returns the state as of now with no traffic: buckets refilled,
// windows rolled, expired log entries and holds dropped. A never-seen state
// becomes the fresh state at now. It never mutates s; the result decides
// exactly as s does at now and later. An unusable limit returns s.
func Advance(l Limit, s State, now int64) State {
	if !l.usable() {
		return s
	}
	switch l.Algorithm {
	case TokenBucket:
		c, last := tbCredit(&l, &s, now)
		return tbState(&l, c, last)
	case GCRA:
		c, eff := gcraCredit(&l, &s, now)
		return gcraState(&l, c, eff)
	case FixedWindow:
		start, count := fwView(&l, &s, now)
		return State{Algorithm: FixedWindow, WindowStart: start, Count: count}
	case SlidingWindow:
		start, cur, prev := swView(&l, &s, now)
		return State{Algorithm: SlidingWindow, WindowStart: start, Count: cur, Prev: prev}
	case SlidingLog:
		live, _, _ := logLive(l, s, now)
		if len(live) == 0 {
			live = nil
		}
		return State{Algorithm: SlidingLog, Log: live}
	case Concurrency:
		live, _ := liveHolds(s, now)
		if len(live) == 0 {
			live = nil
		}
		return State{Algorithm: Concurrency, Holds: live}
	case Quota:
		start, _, spent := quotaView(&l, &s, now)
		return State{Algorithm: Quota, WindowStart: start, Count: spent}
	}
	return s
}

// Rebase moves a limit's state from old to new parameters at instant at
// (§28): it advances s under old up to at, then clamps to the new capacity.
// Lowering a bucket's burst clamps its stored tokens; raising it adds no
// tokens (they refill under the new rate); after at the new rate applies
// (a change of RatePer converts the credit exactly, rounding down to the
// new tick). Window counts, log entries and holds are kept (a window
// change re-aligns the current window to the new width at the same
// instant). A quota with the same period keeps the units spent in its
// current period: what is left is the new limit less them, at least 0
// (the spent units are not cut down to the new limit, so lowering then
// raising a limit within one period never admits more than the highest
// limit, and the state keeps agreeing with a ledger of what was spent). A
// quota whose period changes, an algorithm change, a never-seen state or
// an unusable limit starts fresh: the zero State. It never mutates s.
func Rebase(old, new Limit, s State, at int64) State {
	if old.Algorithm != new.Algorithm || s.Algorithm != old.Algorithm || !old.usable() || !new.usable() {
		return State{}
	}
	if new.Algorithm == Quota && new.Period != old.Period {
		return State{}
	}
	a := Advance(old, s, at)
	switch new.Algorithm {
	case TokenBucket:
		c, last := tbCredit(&old, &a, at)
		return tbState(&new, rescale(c, old.per(), new.per()).min(bucketFull(&new)), last)
	case GCRA:
		c, eff := gcraCredit(&old, &a, at)
		return gcraState(&new, rescale(c, old.per(), new.per()).min(bucketFull(&new)), eff)
	case FixedWindow, SlidingWindow:
		if new.Window != old.Window {
			a.WindowStart = alignDown(max(at, a.WindowStart), new.Window)
		}
	}
	return a
}
