package kvstate

// Token bucket and GCRA: one exact rational model, two state encodings.
//
// Credit is counted in nano-micro-units (1e-9 micro-unit) in 128 bits, so
// that rate (micro-units/s) x elapsed (ns) is an exact integer and nothing
// is rounded away:
//
//	token_bucket: credit(now) = min(Burst*1e9, Tokens*1e9 + Frac + max(0, now-Last)*Rate)
//	gcra:         credit(now) = Burst*1e9 - max(0, (TAT-now)*Rate + TATFrac)
//
// A request of cost c is admitted iff credit >= c*1e9, which then spends
// c*1e9. Both encodings describe the same credit at every instant, so the
// two algorithms make the same decisions (a property test checks it).

// bucketFull returns a bucket limit's capacity in nano-micro-units.
func bucketFull(l Limit) u128 { return mul64(uint64(l.Burst), nano) }

// bucketDecide decides cost against credit (nano-micro-units, at most the
// limit's capacity) and returns the decision and the credit left. l must be
// usable. lag is how far the caller's now is behind the instant the credit
// is as of (a clock stepping backwards): RetryAfter and ResetAfter count
// from the caller's now, so they include it.
func bucketDecide(l Limit, credit u128, cost int64, lag uint64) (Decision, u128) {
	rate := uint64(l.Rate)
	full := bucketFull(l)
	d := Decision{Allowed: true}
	after := credit
	switch {
	case cost <= 0:
		// A probe: admitted, spends nothing.
	case cost > l.Burst:
		d.Allowed = false
		d.RetryAfter = Never
	default:
		need := mul64(uint64(cost), nano)
		if credit.less(need) {
			d.Allowed = false
			d.RetryAfter = need.sub(credit).divCeil(rate).add(from64(lag)).int64()
		} else {
			after = credit.sub(need)
		}
	}
	q, _ := after.divmodNano()
	d.Remaining = q.int64()
	if debt := full.sub(after); debt.hi != 0 || debt.lo != 0 {
		d.ResetAfter = debt.divCeil(rate).add(from64(lag)).int64()
	}
	return d, after
}

// tbCredit returns a token_bucket state's credit at now and the instant the
// new state is as of (the later of now and the state's Last). A state of
// another algorithm (the zero State included) is a never-seen key: full.
func tbCredit(l Limit, s *State, now int64) (u128, int64) {
	full := bucketFull(l)
	if s.Algorithm != TokenBucket {
		return full, now
	}
	tokens, frac := s.Tokens, s.Frac
	if tokens < 0 {
		tokens = 0
	}
	if frac < 0 || frac >= nano {
		frac = 0
	}
	c := mul64(uint64(tokens), nano).add(from64(uint64(frac)))
	c = c.add(mul64(span(s.Last, now), uint64(l.Rate))).min(full)
	return c, max(s.Last, now)
}

// tbState returns the token_bucket state holding credit at last.
func tbState(credit u128, last int64) State {
	q, r := credit.divmodNano()
	return State{Algorithm: TokenBucket, Tokens: q.int64(), Frac: int64(r), Last: last}
}

// decideTokenBucket decides against *s and writes the state to store to
// *out (pointers: State is large, and the hot path avoids copying it).
func decideTokenBucket(l Limit, s *State, now, cost int64, out *State) Decision {
	credit, last := tbCredit(l, s, now)
	d, after := bucketDecide(l, credit, cost, span(now, last))
	if !d.Allowed || cost <= 0 {
		*out = *s
		return d
	}
	q, r := after.divmodNano()
	*out = State{Algorithm: TokenBucket, Tokens: q.int64(), Frac: int64(r), Last: last}
	return d
}

// gcraCredit returns a gcra state's credit and the effective instant: the
// later of now and the latest instant the state has seen, so that a clock
// stepping backwards neither adds nor removes credit.
func gcraCredit(l Limit, s *State, now int64) (u128, int64) {
	full := bucketFull(l)
	if s.Algorithm != GCRA {
		return full, now
	}
	eff := max(now, s.Last)
	if s.TAT == maxInt64 {
		return u128{}, eff // saturated: treated as empty, never as credit
	}
	if s.TAT < eff {
		return full, eff
	}
	frac := s.TATFrac
	if frac < 0 || frac >= l.Rate {
		frac = l.Rate - 1 // out of range: assume the most debt
	}
	debt := mul64(span(eff, s.TAT), uint64(l.Rate)).add(from64(uint64(frac)))
	return full.sub(debt), eff
}

// gcraState returns the gcra state whose credit at eff is credit: the
// theoretical arrival time is eff + (full-credit)/Rate exactly. A TAT beyond
// the int64 range (possible only for limits Validate rejects, or after the
// year 2116 with the longest accepted span) saturates at math.MaxInt64,
// which gcraCredit reads as an empty bucket: saturation can deny, never
// admit more than the exact model.
func gcraState(l Limit, credit u128, eff int64) State {
	rate := uint64(l.Rate)
	q, r := bucketFull(l).sub(credit).divmod(rate)
	s := State{Algorithm: GCRA, Last: eff}
	if room := span(eff, maxInt64); q.hi != 0 || q.lo > room {
		s.TAT, s.TATFrac = maxInt64, int64(rate-1)
		return s
	}
	s.TAT = int64(uint64(eff) + q.lo)
	s.TATFrac = int64(r)
	return s
}

// decideGCRA decides against *s and writes the state to store to *out.
func decideGCRA(l Limit, s *State, now, cost int64, out *State) Decision {
	credit, eff := gcraCredit(l, s, now)
	d, after := bucketDecide(l, credit, cost, span(now, eff))
	if !d.Allowed || cost <= 0 {
		*out = *s
		return d
	}
	*out = gcraState(l, after, eff)
	return d
}
