package kvstate

import (
	"math"
	"math/big"
	"reflect"
	"testing"

	"pgregory.net/rapid"
)

// genBucketLimit draws a bucket limit that Validate accepts, from tiny to
// int64-sized rates, per second or per a longer span (N/m, N/h, N/d or any
// span). The rate is raised where needed so that the limit is also a valid
// gcra limit (the equivalence test decides it as both).
func genBucketLimit(t *rapid.T, alg Algorithm) Limit {
	rate := rapid.OneOf(
		rapid.Int64Range(1, 1000),
		rapid.Int64Range(1, 100*Unit),
		rapid.Int64Range(1, math.MaxInt64),
	).Draw(t, "rate")
	burst := rapid.OneOf(
		rapid.Int64Range(1, 1000),
		rapid.Int64Range(1, 100*Unit),
		rapid.Int64Range(1, 4_000*Unit),
	).Draw(t, "burst")
	per := rapid.OneOf(
		rapid.Just(int64(0)),
		rapid.SampledFrom([]int64{Second, 60 * Second, 3600 * Second, 86400 * Second}),
		rapid.Int64Range(1, 1000*86400*Second),
	).Draw(t, "per")
	l := Limit{Algorithm: alg, Rate: rate, Burst: burst, RatePer: per}
	// The gcra span bound: Burst*per/Rate <= MaxGCRASpan.
	if minRate := bucketFull(&l).divCeil(uint64(MaxGCRASpan)); from64(uint64(l.Rate)).less(minRate) {
		l.Rate = minRate.int64()
	}
	if err := l.Validate(); err != nil {
		t.Fatalf("generated an invalid limit: %v", err)
	}
	return l
}

// genWindowLimit draws a window, log or concurrency limit.
func genWindowLimit(t *rapid.T, alg Algorithm) Limit {
	return Limit{
		Algorithm: alg,
		Limit:     rapid.OneOf(rapid.Int64Range(1, 20), rapid.Int64Range(1, 100*Unit)).Draw(t, "limit"),
		Window:    rapid.OneOf(rapid.Int64Range(1, 1000), rapid.Int64Range(1, 100*Second)).Draw(t, "window"),
	}
}

// genQuotaLimit draws a quota limit, from a few micro-units to 1e12 units.
func genQuotaLimit(t *rapid.T) Limit {
	return Limit{
		Algorithm: Quota,
		Limit:     rapid.OneOf(rapid.Int64Range(1, 20), rapid.Int64Range(1, 100*Unit), rapid.Int64Range(1, MaxQuotaTest)).Draw(t, "limit"),
		Period:    Period(rapid.IntRange(int(Hour), int(Month)).Draw(t, "period")),
	}
}

func genLimit(t *rapid.T, alg Algorithm) Limit {
	switch {
	case alg.Bucket():
		return genBucketLimit(t, alg)
	case alg == Quota:
		return genQuotaLimit(t)
	}
	return genWindowLimit(t, alg)
}

// arrival is one request of a generated sequence.
type arrival struct{ now, cost int64 }

// genArrivals draws up to 80 requests starting at t0. Gaps range from 0 to
// weeks; with backwards set, some step back in time. Costs range up to a
// little over capacity.
func genArrivals(t *rapid.T, capacity int64, backwards bool) []arrival {
	gaps := []*rapid.Generator[int64]{
		rapid.Just(int64(0)),
		rapid.Int64Range(0, 1000),
		rapid.Int64Range(0, Second),
		rapid.Int64Range(0, 3600*Second),
		rapid.Int64Range(0, 20*24*3600*Second),
	}
	if backwards {
		gaps = append(gaps, rapid.Int64Range(-10*Second, -1))
	}
	gap := rapid.OneOf(gaps...)
	cost := rapid.OneOf(
		rapid.Int64Range(1, max(capacity/8, 1)),
		rapid.Int64Range(1, capacity+capacity/4+1),
	)
	n := rapid.IntRange(1, 80).Draw(t, "n")
	out := make([]arrival, n)
	now := t0
	for i := range out {
		now += gap.Draw(t, "gap")
		out[i] = arrival{now, cost.Draw(t, "cost")}
	}
	return out
}

// TestBucketEnvelope checks the token-bucket contract (§4) for token_bucket
// and gcra: over every interval of admission instants, the admitted cost is
// at most burst + rate*(t2-t1), exactly (in ticks of 1/RatePer micro-unit). The instant of an
// admission is its effective time: the caller's now, or the latest
// admission's instant if now is earlier (a clock stepping back is treated
// as standing still).
func TestBucketEnvelope(t *testing.T) {
	for _, alg := range []Algorithm{TokenBucket, GCRA} {
		t.Run(alg.String(), func(t *testing.T) {
			rapid.Check(t, func(t *rapid.T) {
				l := genBucketLimit(t, alg)
				type adm struct{ at, cost int64 }
				var admitted []adm
				var s State
				for _, a := range genArrivals(t, l.Burst, true) {
					d, ns := Decide(l, s, a.now, a.cost)
					if d.Allowed {
						at := a.now
						if k := len(admitted); k > 0 && admitted[k-1].at > at {
							at = admitted[k-1].at
						}
						admitted = append(admitted, adm{at, a.cost})
					}
					s = ns
				}
				per := big.NewInt(int64(l.per()))
				burst := new(big.Int).Mul(big.NewInt(l.Burst), per)
				rate := big.NewInt(l.Rate)
				for i := range admitted {
					sum := new(big.Int)
					for j := i; j < len(admitted); j++ {
						sum.Add(sum, new(big.Int).Mul(big.NewInt(admitted[j].cost), per))
						bound := new(big.Int).Mul(rate, big.NewInt(admitted[j].at-admitted[i].at))
						bound.Add(bound, burst)
						if sum.Cmp(bound) > 0 {
							t.Fatalf("admitted %v nano-micro in [%d, %d], bound %v", sum, admitted[i].at, admitted[j].at, bound)
						}
					}
				}
			})
		})
	}
}

// TestTokenBucketEqualsGCRA: the two encodings of the one exact model make
// identical decisions, also when the clock steps back.
func TestTokenBucketEqualsGCRA(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		lt := genBucketLimit(t, TokenBucket)
		lg := lt
		lg.Algorithm = GCRA
		var st, sg State
		for i, a := range genArrivals(t, lt.Burst, rapid.Bool().Draw(t, "backwards")) {
			dt, nst := Decide(lt, st, a.now, a.cost)
			dg, nsg := Decide(lg, sg, a.now, a.cost)
			if dt != dg {
				t.Fatalf("request %d (now %d, cost %d): token_bucket %+v, gcra %+v", i, a.now, a.cost, dt, dg)
			}
			st, sg = nst, nsg
		}
	})
}

// TestRetryAfterExact: a denial's RetryAfter r (not Never) is exact for
// every algorithm: retried r later with no traffic between, the request is
// admitted, and r-1 later it is still denied.
func TestRetryAfterExact(t *testing.T) {
	for _, alg := range allAlgorithms {
		t.Run(alg.String(), func(t *testing.T) {
			rapid.Check(t, func(t *rapid.T) {
				l := genLimit(t, alg)
				var s State
				denials := 0
				for _, a := range genArrivals(t, l.Capacity(), rapid.Bool().Draw(t, "backwards")) {
					before := cloneState(s)
					d, ns := Decide(l, s, a.now, a.cost)
					if !reflect.DeepEqual(s, before) {
						t.Fatal("Decide mutated its input")
					}
					if !d.Allowed && d.RetryAfter != Never {
						denials++
						if d.RetryAfter <= 0 {
							t.Fatalf("denied with RetryAfter %d", d.RetryAfter)
						}
						if d2, _ := Decide(l, s, a.now+d.RetryAfter, a.cost); !d2.Allowed {
							t.Fatalf("denied at %d with RetryAfter %d, still denied then: %+v", a.now, d.RetryAfter, d2)
						}
						if d.RetryAfter > 1 {
							if d2, _ := Decide(l, s, a.now+d.RetryAfter-1, a.cost); d2.Allowed {
								t.Fatalf("denied at %d with RetryAfter %d, admitted 1 ns earlier", a.now, d.RetryAfter)
							}
						}
					}
					if d.RetryAfter == Never && a.cost <= l.Capacity() {
						t.Fatalf("Never for cost %d within capacity %d", a.cost, l.Capacity())
					}
					if d.Allowed != (d.RetryAfter == 0) {
						t.Fatalf("inconsistent decision %+v", d)
					}
					s = ns
				}
			})
		})
	}
}

// TestSlidingLogTrailingWindow: no trailing window of the sliding log ever
// holds more than Limit (non-decreasing times).
func TestSlidingLogTrailingWindow(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		l := genWindowLimit(t, SlidingLog)
		type adm struct{ at, cost int64 }
		var admitted []adm
		var s State
		for _, a := range genArrivals(t, l.Limit, false) {
			d, ns := Decide(l, s, a.now, a.cost)
			if d.Allowed {
				admitted = append(admitted, adm{a.now, a.cost})
				var sum int64
				for _, e := range admitted {
					if e.at > a.now-l.Window {
						sum += e.cost
					}
				}
				if sum > l.Limit {
					t.Fatalf("%d in the window ending at %d, limit %d", sum, a.now, l.Limit)
				}
			}
			s = ns
		}
	})
}

// TestFixedWindowPerWindow: no aligned window ever admits more than Limit
// (non-decreasing times).
func TestFixedWindowPerWindow(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		l := genWindowLimit(t, FixedWindow)
		perWindow := map[int64]int64{}
		var s State
		for _, a := range genArrivals(t, l.Limit, false) {
			d, ns := Decide(l, s, a.now, a.cost)
			if d.Allowed {
				w := a.now / l.Window // t0 > 0: floor division
				perWindow[w] += a.cost
				if perWindow[w] > l.Limit {
					t.Fatalf("window %d admitted %d, limit %d", w, perWindow[w], l.Limit)
				}
			}
			s = ns
		}
	})
}

// refLog is a deliberately naive sliding log: every admission is kept
// forever and every question is answered by a full scan.
type refLog struct {
	l   Limit
	all []LogEntry
}

func (r *refLog) liveAt(t int64) (sum int64, n int) {
	for _, e := range r.all {
		if e.At > t-r.l.Window {
			sum += e.Cost
			n++
		}
	}
	return sum, n
}

func (r *refLog) decide(now, cost int64) Decision {
	eff := now
	if k := len(r.all); k > 0 && r.all[k-1].At > eff {
		eff = r.all[k-1].At
	}
	fits := func(t int64) bool {
		sum, n := r.liveAt(t)
		return sum+cost <= r.l.Limit && n < MaxLogEntries
	}
	var d Decision
	if cost <= r.l.Limit && fits(eff) {
		d.Allowed = true
		r.all = append(r.all, LogEntry{eff, cost})
	} else if cost > r.l.Limit {
		d.RetryAfter = Never
	} else {
		// Try every instant at which some entry expires, earliest first.
		for _, e := range r.all {
			if at := e.At + r.l.Window; at > eff && fits(at) {
				d.RetryAfter = at - now
				break
			}
		}
	}
	sum, n := r.liveAt(eff)
	d.Remaining = r.l.Limit - sum
	if n > 0 {
		d.ResetAfter = r.all[len(r.all)-1].At + r.l.Window - now
	}
	return d
}

func TestSlidingLogAgainstReference(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		l := genWindowLimit(t, SlidingLog)
		ref := &refLog{l: l}
		var s State
		for i, a := range genArrivals(t, l.Limit, rapid.Bool().Draw(t, "backwards")) {
			d, ns := Decide(l, s, a.now, a.cost)
			want := ref.decide(a.now, a.cost)
			if d != want {
				t.Fatalf("request %d (now %d, cost %d): got %+v, reference %+v", i, a.now, a.cost, d, want)
			}
			s = ns
		}
	})
}

// TestDecideAllProperties: DecideAll admits iff every limit admits, then
// spends in all (each new state is what Decide returns); a denial spends in
// none; the merged decision follows the documented rules; inputs are never
// mutated.
func TestDecideAllProperties(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		n := rapid.IntRange(1, 4).Draw(t, "limits")
		limits := make([]Limit, n)
		for i := range limits {
			limits[i] = genLimit(t, rapid.SampledFrom(allAlgorithms).Draw(t, "alg"))
		}
		capacity := int64(math.MaxInt64)
		for _, l := range limits {
			capacity = min(capacity, l.Capacity())
		}
		var states []State // shorter than limits at first: never seen
		var dst []State
		for _, a := range genArrivals(t, capacity, rapid.Bool().Draw(t, "backwards")) {
			inLimits := append([]Limit(nil), limits...)
			inStates := cloneStates(states)
			got, out := DecideAll(limits, states, a.now, a.cost, dst)
			if !reflect.DeepEqual(limits, inLimits) || !reflect.DeepEqual(states, inStates) {
				t.Fatal("DecideAll mutated its inputs")
			}
			want := Decision{Allowed: true}
			var singles []Decision
			anyNever, maxRetry := false, int64(0)
			for i, l := range limits {
				var s State
				if i < len(states) {
					s = states[i]
				}
				d, _ := Decide(l, s, a.now, a.cost)
				singles = append(singles, d)
				if !d.Allowed {
					want.Allowed = false
					if d.RetryAfter == Never {
						anyNever = true
					}
					maxRetry = max(maxRetry, d.RetryAfter)
				}
			}
			if anyNever {
				want.RetryAfter = Never
			} else {
				want.RetryAfter = maxRetry
			}
			for i, l := range limits {
				var s State
				if i < len(states) {
					s = states[i]
				}
				d, ns := Decide(l, s, a.now, a.cost)
				if !want.Allowed {
					d, _ = Decide(l, s, a.now, 0) // unspent view
					if !reflect.DeepEqual(out[i], s) {
						t.Fatalf("denied, yet limit %d's state changed: %+v -> %+v", i, s, out[i])
					}
				} else if !reflect.DeepEqual(out[i], ns) {
					t.Fatalf("admitted, yet limit %d's state %+v is not Decide's %+v", i, out[i], ns)
				}
				if i == 0 || d.Remaining < want.Remaining {
					want.Remaining, want.ResetAfter = d.Remaining, d.ResetAfter
				}
			}
			if got != want {
				t.Fatalf("merged %+v, want %+v (singles %+v)", got, want, singles)
			}
			if len(out) != len(limits) {
				t.Fatalf("%d states for %d limits", len(out), len(limits))
			}
			states, dst = out, states
		}
	})
}

// TestAdvanceEquivalent: advancing a state to now changes no decision at
// now or later, and never mutates its input.
func TestAdvanceEquivalent(t *testing.T) {
	for _, alg := range allAlgorithms {
		t.Run(alg.String(), func(t *testing.T) {
			rapid.Check(t, func(t *rapid.T) {
				l := genLimit(t, alg)
				var s State
				for _, a := range genArrivals(t, l.Capacity(), false) {
					before := cloneState(s)
					adv := Advance(l, s, a.now)
					if !reflect.DeepEqual(s, before) {
						t.Fatal("Advance mutated its input")
					}
					later := a.now + rapid.Int64Range(0, 2*Second).Draw(t, "later")
					for _, at := range []int64{a.now, later} {
						d1, _ := Decide(l, s, at, a.cost)
						d2, _ := Decide(l, adv, at, a.cost)
						if d1 != d2 {
							t.Fatalf("at %d: from state %+v, from advanced %+v", at, d1, d2)
						}
					}
					_, s = Decide(l, s, a.now, a.cost)
				}
			})
		})
	}
}

func TestU128AgainstBig(t *testing.T) {
	toBig := func(x u128) *big.Int {
		b := new(big.Int).SetUint64(x.hi)
		return b.Lsh(b, 64).Or(b, new(big.Int).SetUint64(x.lo))
	}
	maxU := toBig(u128max)
	clamp := func(b *big.Int) *big.Int {
		if b.Cmp(maxU) > 0 {
			return maxU
		}
		if b.Sign() < 0 {
			return new(big.Int)
		}
		return b
	}
	word := rapid.OneOf(rapid.Uint64(), rapid.Uint64Range(0, 1<<20), rapid.Just(uint64(math.MaxUint64)), rapid.Just(uint64(0)))
	rapid.Check(t, func(t *rapid.T) {
		x := u128{word.Draw(t, "xh"), word.Draw(t, "xl")}
		y := u128{word.Draw(t, "yh"), word.Draw(t, "yl")}
		a, b := word.Draw(t, "a"), word.Draw(t, "b")
		d := rapid.OneOf(rapid.Uint64Range(1, math.MaxUint64), rapid.Uint64Range(1, 1000), rapid.Just(uint64(nano))).Draw(t, "d")
		bx, by, bd := toBig(x), toBig(y), new(big.Int).SetUint64(d)
		check := func(name string, got u128, want *big.Int) {
			if toBig(got).Cmp(want) != 0 {
				t.Fatalf("%s: got %v, want %v", name, toBig(got), want)
			}
		}
		check("mul64", mul64(a, b), new(big.Int).Mul(new(big.Int).SetUint64(a), new(big.Int).SetUint64(b)))
		check("add", x.add(y), clamp(new(big.Int).Add(bx, by)))
		check("sub", x.sub(y), clamp(new(big.Int).Sub(bx, by)))
		q, r := x.divmod(d)
		wq, wr := new(big.Int).QuoRem(bx, bd, new(big.Int))
		check("divmod q", q, wq)
		if r != wr.Uint64() {
			t.Fatalf("divmod r: %d, want %v", r, wr)
		}
		qn, rn := x.divmodNano()
		wq, wr = new(big.Int).QuoRem(bx, big.NewInt(nano), new(big.Int))
		check("divmodNano q", qn, wq)
		if rn != wr.Uint64() {
			t.Fatalf("divmodNano r: %d, want %v", rn, wr)
		}
		wc := new(big.Int).Add(bx, new(big.Int).Sub(bd, big.NewInt(1)))
		check("divCeil", x.divCeil(d), clamp(wc.Quo(wc, bd)))
		if x.less(y) != (bx.Cmp(by) < 0) {
			t.Fatal("less")
		}
		wi := bx
		if wi.Cmp(big.NewInt(math.MaxInt64)) > 0 {
			wi = big.NewInt(math.MaxInt64)
		}
		if x.int64() != wi.Int64() {
			t.Fatalf("int64: %d, want %v", x.int64(), wi)
		}
	})
}
