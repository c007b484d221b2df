package kvstate

// Token bucket and GCRA: one exact rational model, two state encodings.
//
// A bucket's Rate is micro-units per P ns, where P is the limit's RatePer
// (Second when 0). Credit is counted in ticks of 1/P micro-unit, in 128
// bits, so that Rate x elapsed (ns) is an exact number of ticks and nothing
// is rounded away (with P = Second a tick is a nano-micro-unit):
//
//	token_bucket: credit(now) = min(Burst*P, Tokens*P + Frac + max(0, now-Last)*Rate)
//	gcra:         credit(now) = Burst*P - max(0, (TAT-now)*Rate + TATFrac)
//
// A request of cost c is admitted iff credit >= c*P, which then spends
// c*P. Both encodings describe the same credit at every instant, so the
// two algorithms make the same decisions (a property test checks it).
// Remaining is floor(credit/P) micro-units; RetryAfter and ResetAfter are
// ceil(ticks missing / Rate) ns.

// per returns the span P (ns) a bucket limit's Rate counts over: the
// number of ticks in one micro-unit.
func (l Limit) per() uint64 {
	if l.RatePer > 0 {
		return uint64(l.RatePer)
	}
	return nano
}

// bucketFull returns a bucket limit's capacity in ticks.
func bucketFull(l *Limit) u128 { return mul64(uint64(l.Burst), l.per()) }

// divmodPer returns x/p and x%p, with the constant-divisor fast path for
// the common p = 1e9.
func divmodPer(x u128, p uint64) (u128, uint64) {
	if p == nano && x.hi == 0 {
		return u128{0, x.lo / nano}, x.lo % nano
	}
	return x.divmod(p)
}

// rescale converts credit from ticks of 1/from to ticks of 1/to of a
// micro-unit, rounding down (never creating credit). c/from must fit in
// 64 bits, which holds for any credit of at most a Burst.
func rescale(c u128, from, to uint64) u128 {
	if from == to {
		return c
	}
	q, r := c.divmod(from)
	f, _ := mul64(r, to).divmod(from)
	return mul64(q.lo, to).add(f)
}

// bucketDecide decides cost against credit (ticks, at most the limit's
// capacity) and returns the decision and the credit left. l must be
// usable. lag is how far the caller's now is behind the instant the credit
// is as of (a clock stepping backwards): RetryAfter and ResetAfter count
// from the caller's now, so they include it. The credit left is
// d.Remaining micro-units plus frac ticks.
func bucketDecide(l *Limit, credit u128, cost int64, lag uint64) (d Decision, after u128, frac uint64) {
	rate, p := uint64(l.Rate), l.per()
	full := bucketFull(l)
	d.Allowed = true
	after = credit
	switch {
	case cost <= 0:
		// A probe: admitted, spends nothing.
	case cost > l.Burst:
		d.Allowed = false
		d.RetryAfter = Never
	default:
		need := mul64(uint64(cost), p)
		if credit.less(need) {
			d.Allowed = false
			d.RetryAfter = need.sub(credit).divCeil(rate).add(from64(lag)).int64()
		} else {
			after = credit.sub(need)
		}
	}
	q, frac := divmodPer(after, p)
	d.Remaining = q.int64() // at most Burst
	if debt := full.sub(after); debt.hi != 0 || debt.lo != 0 {
		d.ResetAfter = debt.divCeil(rate).add(from64(lag)).int64()
	}
	return d, after, frac
}

// tbCredit returns a token_bucket state's credit at now and the instant the
// new state is as of (the later of now and the state's Last). A state of
// another algorithm (the zero State included) is a never-seen key: full.
func tbCredit(l *Limit, s *State, now int64) (u128, int64) {
	full := bucketFull(l)
	if s.Algorithm != TokenBucket {
		return full, now
	}
	p := l.per()
	tokens, frac := s.Tokens, s.Frac
	if tokens < 0 {
		tokens = 0
	}
	if frac < 0 || uint64(frac) >= p {
		frac = 0
	}
	c := mul64(uint64(tokens), p).add(from64(uint64(frac)))
	c = c.add(mul64(span(s.Last, now), uint64(l.Rate))).min(full)
	return c, max(s.Last, now)
}

// tbState returns the token_bucket state of l holding credit at last.
func tbState(l *Limit, credit u128, last int64) State {
	q, r := divmodPer(credit, l.per())
	return State{Algorithm: TokenBucket, Tokens: q.int64(), Frac: int64(r), Last: last}
}

// decideTokenBucket decides against *s and writes the state to store to
// *out (pointers: State is large, and the hot path avoids copying it).
func decideTokenBucket(l *Limit, s *State, now, cost int64, out *State) Decision {
	credit, last := tbCredit(l, s, now)
	d, _, frac := bucketDecide(l, credit, cost, span(now, last))
	if !d.Allowed || cost <= 0 {
		*out = *s
		return d
	}
	*out = State{Algorithm: TokenBucket, Tokens: d.Remaining, Frac: int64(frac), Last: last}
	return d
}

// gcraCredit returns a gcra state's credit and the effective instant: the
// later of now and the latest instant the state has seen, so that a clock
// stepping backwards neither adds nor removes credit.
func gcraCredit(l *Limit, s *State, now int64) (u128, int64) {
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
func gcraState(l *Limit, credit u128, eff int64) State {
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
func decideGCRA(l *Limit, s *State, now, cost int64, out *State) Decision {
	credit, eff := gcraCredit(l, s, now)
	d, after, _ := bucketDecide(l, credit, cost, span(now, eff))
	if !d.Allowed || cost <= 0 {
		*out = *s
		return d
	}
	*out = gcraState(l, after, eff)
	return d
}

// Headroom returns what a token_bucket or gcra limit l's state s lacks at
// now to be full, in micro-units rounded down: adding it (or less) to the
// bucket never passes its burst, fraction included. It is 0 for a full
// bucket, an unusable limit and every other algorithm. A reservation's
// owner uses it to give back only the units the bucket would still hold,
// had they never been taken (keys/reserve.go).
func Headroom(l Limit, s State, now int64) int64 {
	if !l.usable() {
		return 0
	}
	var c u128
	switch l.Algorithm {
	case TokenBucket:
		c, _ = tbCredit(&l, &s, now)
	case GCRA:
		c, _ = gcraCredit(&l, &s, now)
	default:
		return 0
	}
	full := bucketFull(&l)
	if !c.less(full) {
		return 0
	}
	q, _ := divmodPer(full.sub(c), l.per())
	return q.int64()
}
