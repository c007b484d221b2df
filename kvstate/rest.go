package kvstate

// Retention: when a stored state stops mattering.
//
// A state is at rest at instant t when deciding any request at t or later
// against it gives the same Decision as deciding against the zero State
// (a never-seen key), and, when the request is admitted, the same next
// State. A key whose states are all at rest can be dropped without
// changing any decision; before then dropping it would hand the key
// capacity it does not have (a half-empty bucket coming back full, a
// window or quota period forgetting what it counted).

// RestAt returns the earliest instant (Unix ns) at and after which s, a
// state of limit l, is at rest: the bucket is full again (and the clock
// has reached the state's latest instant), the windows have rolled over so
// that nothing counts, the sliding log's entries have expired, the quota
// period has ended, the concurrency holds have expired. It returns
// math.MinInt64 when s is at rest at every instant (a never-seen state, a
// state of another algorithm, an empty log or hold list, or an unusable
// limit) and math.MaxInt64 when it never comes to rest within the int64
// range. It never mutates s and never allocates.
func RestAt(l Limit, s State) int64 {
	if !l.usable() || s.Algorithm != l.Algorithm {
		return minInt64
	}
	switch l.Algorithm {
	case TokenBucket:
		c, _ := tbCredit(&l, &s, s.Last) // the credit at Last
		debt := bucketFull(&l).sub(c)
		return satAdd(s.Last, debt.divCeil(uint64(l.Rate)).int64())
	case GCRA:
		if s.TAT == maxInt64 {
			return maxInt64 // saturated: reads as empty at every instant
		}
		// Full at eff iff TAT < eff, or TAT == eff with no fractional debt.
		at, frac := s.TAT, s.TATFrac
		if frac < 0 || frac >= l.Rate {
			frac = l.Rate - 1 // as gcraCredit reads it
		}
		if frac != 0 {
			at = satAdd(at, 1)
		}
		return max(at, s.Last)
	case FixedWindow:
		if s.Count <= 0 && alignDown(s.WindowStart, l.Window) == s.WindowStart {
			return s.WindowStart
		}
		return satAdd(alignDown(s.WindowStart, l.Window), l.Window)
	case SlidingWindow:
		start := s.WindowStart
		if alignDown(start, l.Window) != start {
			return satAdd(alignDown(start, l.Window), l.Window)
		}
		switch {
		case s.Count > 0:
			// The current count is weighed through the next window.
			return satAdd(satAdd(start, l.Window), l.Window)
		case s.Prev > 0:
			return satAdd(start, l.Window)
		}
		return start
	case SlidingLog:
		if n := len(s.Log); n > 0 {
			return satAdd(s.Log[n-1].At, l.Window) // entries are oldest first
		}
	case Concurrency:
		if n := len(s.Holds); n > 0 {
			return s.Holds[n-1].Expires // holds are in order of expiry
		}
	case Quota:
		start, end := periodBounds(l.Period, s.WindowStart)
		if s.Count <= 0 && start == s.WindowStart {
			return start
		}
		return end
	}
	return minInt64
}

// RestSpan returns the longest time (ns) a state of l can take to come to
// rest after the decision that last changed it, for a clock that does not
// step back: a state that Decide returns at t (from a state written at or
// before t) is at rest by t + RestSpan. Buckets take the time to fill from
// empty (ceil(Burst*RatePer/Rate)), fixed windows and sliding logs one
// Window, sliding windows two, concurrency limits the hold expiry (Window),
// quotas the longest period (1 h, 1 day, 7 days, 31 days). It saturates at
// math.MaxInt64 and is 0 for an unusable limit. Prefer [RestAt] with the
// actual state: it is exact, also when the clock steps back.
func RestSpan(l Limit) int64 {
	if !l.usable() {
		return 0
	}
	switch l.Algorithm {
	case TokenBucket, GCRA:
		return bucketFull(&l).divCeil(uint64(l.Rate)).int64()
	case SlidingWindow:
		return satAdd(l.Window, l.Window)
	case Quota:
		switch l.Period {
		case Hour:
			return hourNs
		case Day:
			return dayNs
		case Week:
			return weekNs
		}
		return 31 * dayNs
	}
	return l.Window
}

// Refill returns the micro-units a bucket limit refills in span ns,
// rounded up and saturated at math.MaxInt64: ceil(Rate*span/RatePer). A
// bucket admits at most Burst + Refill(t2-t1) over any interval [t1, t2]
// (the contract's envelope). It is 0 for other algorithms and for span <= 0.
func (l Limit) Refill(span int64) int64 {
	if !l.Algorithm.Bucket() || !l.usable() || span <= 0 {
		return 0
	}
	return mul64(uint64(l.Rate), uint64(span)).divCeil(l.per()).int64()
}
