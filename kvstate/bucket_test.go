package kvstate

import (
	"math"
	"reflect"
	"testing"
)

// year100 is 100 years of 365 days in ns.
const year100 = 100 * 365 * 24 * 3600 * Second

// bucketSteps is a timeline for a bucket of rate 3 units/s and burst 2
// units. Expected values are derived by hand from the exact model: credit in
// nano-micro-units, 3 units/s = 3e6 micro-units/s = 3e6 nano-micro per ns.
var bucketSteps = []step{
	// Full: a never-seen key probes as full (cost 0 spends nothing).
	{at: 0, cost: 0, allowed: true, remaining: 2 * Unit},
	// Two units at once drain it; each refills in 1e15/3e6 = 333333333.3 ns.
	{at: 0, cost: Unit, allowed: true, remaining: Unit, reset: 333333334},
	{at: 0, cost: Unit, allowed: true, remaining: 0, reset: 666666667},
	// Exactly depleted: denied, retry after one unit's refill, rounded up.
	{at: 0, cost: Unit, retry: 333333334, reset: 666666667},
	// Time stepping back 1 s creates nothing, and the retry counts from the
	// caller's (earlier) clock.
	{at: -Second, cost: Unit, retry: Second + 333333334, reset: Second + 666666667},
	// Fractional refill: 333333333 ns give 999999.999 micro-units.
	{at: 333333333, cost: Unit, remaining: 999999, retry: 1, reset: 333333334},
	// One ns later there are 1000000.002: admitted, 0.002 kept (not lost).
	{at: 333333334, cost: Unit, allowed: true, remaining: 0, reset: 666666666},
	// Equal time: nothing refills; the kept 0.002 shortens the retry.
	{at: 333333334, cost: Unit, retry: 333333333, reset: 666666666},
	// A cost above the burst can never be admitted.
	{at: 333333334, cost: 3 * Unit, retry: Never, reset: 666666666},
	// A cost equal to the burst waits for a full bucket.
	{at: 333333334, cost: 2 * Unit, retry: 666666666, reset: 666666666},
	// A century idle refills to the burst and no further.
	{at: year100, cost: 2 * Unit, allowed: true, remaining: 0, reset: 666666667},
	// A fractional cost: one micro-unit refills in 333.3 ns.
	{at: year100, cost: 1, retry: 334, reset: 666666667},
	{at: year100 + 333, cost: 1, retry: 1, reset: 666666334},
	{at: year100 + 334, cost: 1, allowed: true, remaining: 0, reset: 666666666},
}

func TestBucketSteps(t *testing.T) {
	for _, alg := range []Algorithm{TokenBucket, GCRA} {
		t.Run(alg.String(), func(t *testing.T) {
			l := Limit{Algorithm: alg, Rate: 3 * Unit, Burst: 2 * Unit}
			run(t, l, State{}, bucketSteps)
		})
	}
}

// TestBucketStateExact pins the stored representation of the fractional
// credit: nothing is rounded away between decisions.
func TestBucketStateExact(t *testing.T) {
	l := Limit{Algorithm: TokenBucket, Rate: 3 * Unit, Burst: 2 * Unit}
	s := run(t, l, State{}, bucketSteps[:7])
	want := State{Algorithm: TokenBucket, Tokens: 0, Frac: 2_000_000, Last: t0 + 333333334}
	if !reflect.DeepEqual(s, want) {
		t.Fatalf("token bucket state %+v, want %+v", s, want)
	}
	lg := Limit{Algorithm: GCRA, Rate: 3 * Unit, Burst: 2 * Unit}
	g := run(t, lg, State{}, bucketSteps[:7])
	// Debt 2e15-2e6 nano-micro = 666666666 ns x 3e6 exactly: TAT = now + 666666666.
	if g.Algorithm != GCRA || g.TAT != t0+333333334+666666666 || g.TATFrac != 0 || g.Last != t0+333333334 {
		t.Fatalf("gcra state %+v", g)
	}
}

// TestBucketExtremes decides with rates, bursts and instants at the int64
// limits: nothing overflows and the results stay exact or saturate.
func TestBucketExtremes(t *testing.T) {
	const maxI = math.MaxInt64
	const minI = math.MinInt64
	for _, alg := range []Algorithm{TokenBucket, GCRA} {
		t.Run(alg.String(), func(t *testing.T) {
			huge := Limit{Algorithm: alg, Rate: maxI, Burst: maxI}
			// Fresh at the last representable instant: full.
			d, s := Decide(huge, State{}, maxI, maxI)
			if !d.Allowed || d.Remaining != 0 {
				t.Fatalf("fresh huge bucket: %+v", d)
			}
			if alg == TokenBucket {
				// MaxInt64 micro-units at MaxInt64 micro-units/s refill in 1 s.
				if d.ResetAfter != Second {
					t.Fatalf("reset %d, want 1e9", d.ResetAfter)
				}
				d, _ = Decide(huge, s, maxI, 1)
				if d.Allowed || d.RetryAfter != 1 || d.ResetAfter != Second {
					t.Fatalf("drained huge bucket: %+v", d)
				}
			} else {
				// The TAT (now + 1 s) saturates: the bucket reads empty,
				// never as extra credit.
				d, _ = Decide(huge, s, maxI, 1)
				if d.Allowed {
					t.Fatalf("saturated gcra admitted: %+v", d)
				}
			}

			// Idle from the first to the last representable instant.
			d, s = Decide(huge, State{}, minI, maxI)
			if !d.Allowed {
				t.Fatal("fresh bucket at MinInt64 denied")
			}
			d, _ = Decide(huge, s, maxI, maxI)
			if !d.Allowed || d.Remaining != 0 {
				t.Fatalf("after 584 years idle: %+v", d)
			}

			// The slowest rate with the largest burst: refilling takes
			// longer than int64 ns can say, so the figures saturate.
			slow := Limit{Algorithm: alg, Rate: 1, Burst: maxI}
			d, s = Decide(slow, State{}, 0, maxI)
			if !d.Allowed || d.ResetAfter != maxI {
				t.Fatalf("slow bucket: %+v", d)
			}
			d, _ = Decide(slow, s, 0, 1)
			if d.Allowed || d.RetryAfter != Second {
				t.Fatalf("slow bucket, one micro-unit: %+v", d)
			}
			d, _ = Decide(slow, s, 0, maxI)
			if d.Allowed || d.RetryAfter != maxI {
				t.Fatalf("slow bucket, whole burst: %+v", d)
			}
		})
	}
}

func TestInvalidLimitsFailClosed(t *testing.T) {
	for _, l := range []Limit{
		{},
		{Algorithm: TokenBucket, Rate: 0, Burst: Unit},
		{Algorithm: TokenBucket, Rate: Unit, Burst: -1},
		{Algorithm: GCRA, Rate: -5, Burst: Unit},
		{Algorithm: TokenBucket, Rate: Unit, Burst: Unit, RatePer: -1},
		{Algorithm: Quota, Limit: Unit, Window: Second},
		{Algorithm: FixedWindow, Limit: Unit},
		{Algorithm: SlidingWindow, Window: Second},
		{Algorithm: SlidingLog, Limit: -Unit, Window: Second},
		{Algorithm: Concurrency, Limit: Unit, Window: 0},
		{Algorithm: 99, Rate: Unit, Burst: Unit, Limit: Unit, Window: Second},
	} {
		if err := l.Validate(); err == nil {
			t.Errorf("Validate(%+v) = nil", l)
		}
		s := State{Algorithm: l.Algorithm, Tokens: 5}
		d, ns := Decide(l, s, t0, Unit)
		if d.Allowed || d.RetryAfter != Never || !reflect.DeepEqual(ns, s) {
			t.Errorf("Decide(%+v) = %+v, %+v; want a Never denial and the state unchanged", l, d, ns)
		}
	}
}

func TestValidate(t *testing.T) {
	ok := []Limit{
		{Algorithm: TokenBucket, Rate: 1, Burst: math.MaxInt64},
		{Algorithm: GCRA, Rate: 10 * Unit, Burst: 40 * Unit},
		{Algorithm: GCRA, Rate: 1, Burst: MaxGCRASpan / Second},
		{Algorithm: FixedWindow, Limit: 1, Window: 1},
		{Algorithm: SlidingWindow, Limit: Unit, Window: Second},
		{Algorithm: SlidingLog, Limit: Unit, Window: Second},
		{Algorithm: Concurrency, Limit: Unit, Window: Second},
	}
	for _, l := range ok {
		if err := l.Validate(); err != nil {
			t.Errorf("Validate(%+v) = %v", l, err)
		}
	}
	// A day's rate: the span is Burst*RatePer/Rate.
	daily := Limit{Algorithm: GCRA, Rate: 1000, Burst: 40 * Unit, RatePer: 86400 * Second}
	if err := daily.Validate(); err != nil {
		t.Errorf("Validate(%+v) = %v", daily, err)
	}
	daily.Rate = 1
	if err := daily.Validate(); err == nil {
		t.Errorf("Validate(%+v) accepted a span over MaxGCRASpan", daily)
	}
	// One micro-unit more than MaxGCRASpan allows.
	bad := Limit{Algorithm: GCRA, Rate: 1, Burst: MaxGCRASpan/Second + 1}
	if err := bad.Validate(); err == nil {
		t.Errorf("Validate(%+v) accepted a span over MaxGCRASpan", bad)
	}
	tb := bad
	tb.Algorithm = TokenBucket
	if err := tb.Validate(); err != nil {
		t.Errorf("token_bucket has no span bound: %v", err)
	}
}

// TestRatePerSteps: a rate counted over a day or an hour is exact, not
// rounded to micro-units per second (1000/d would be 11574 micro-units/s,
// and one unit would take 86.4004 s instead of 86.4 s).
func TestRatePerSteps(t *testing.T) {
	for _, alg := range []Algorithm{TokenBucket, GCRA} {
		t.Run(alg.String(), func(t *testing.T) {
			daily := Limit{Algorithm: alg, Rate: 1000 * Unit, Burst: 10 * Unit, RatePer: 86400 * Second}
			run(t, daily, State{}, []step{
				{at: 0, cost: 10 * Unit, allowed: true, remaining: 0, reset: 864 * Second},
				{at: 0, cost: Unit, retry: 86400 * ms, reset: 864 * Second},
				{at: 86400*ms - 1, cost: Unit, remaining: Unit - 1, retry: 1, reset: 777600*ms + 1},
				{at: 86400 * ms, cost: Unit, allowed: true, remaining: 0, reset: 864 * Second},
				// A day idle refills the whole burst, no more.
				{at: 86400*ms + 86400*Second, cost: 10 * Unit, allowed: true, remaining: 0, reset: 864 * Second},
			})
			// 2.5/h: one micro-unit every 1.44 ms exactly.
			hourly := Limit{Algorithm: alg, Rate: 2_500_000, Burst: 1, RatePer: 3600 * Second}
			run(t, hourly, State{}, []step{
				{at: 0, cost: 1, allowed: true, remaining: 0, reset: 1440 * 1000},
				{at: 1440*1000 - 1, cost: 1, retry: 1, reset: 1},
				{at: 1440 * 1000, cost: 1, allowed: true, remaining: 0, reset: 1440 * 1000},
			})
		})
	}
}

// TestRebaseRatePer: moving between a per-second and a per-day rate keeps
// the credit exactly when it is representable, and rounds it down (never
// up) otherwise.
func TestRebaseRatePer(t *testing.T) {
	for _, alg := range []Algorithm{TokenBucket, GCRA} {
		t.Run(alg.String(), func(t *testing.T) {
			perSec := Limit{Algorithm: alg, Rate: 10 * Unit, Burst: 40 * Unit}
			perDay := Limit{Algorithm: alg, Rate: 864_000 * Unit, Burst: 40 * Unit, RatePer: 86400 * Second} // the same 10/s
			_, s := Decide(perSec, State{}, t0, 40*Unit)
			r := Rebase(perSec, perDay, s, t0+Second)
			for _, at := range []int64{t0 + Second, t0 + 1500*ms, t0 + 3*Second + 1} {
				d1, _ := Decide(perSec, s, at, 0)
				d2, _ := Decide(perDay, r, at, 0)
				if d1 != d2 {
					t.Fatalf("at t0%+d: per second %+v, per day %+v", at-t0, d1, d2)
				}
			}
			// 1000 micro-units/day for a day less 1 ns refill
			// 999.99999999998843 micro-units, which the per-second tick
			// (1e-9) cannot hold: it is rounded down to 999.999999999,
			// whose refill to 40 units at 10/s takes 3999900000.0000001 ns.
			slow := Limit{Algorithm: alg, Rate: 1000, Burst: 40 * Unit, RatePer: 86400 * Second}
			_, s = Decide(slow, State{}, t0, 40*Unit)
			back := Rebase(slow, perSec, s, t0+86400*Second-1)
			if d, _ := Decide(perSec, back, t0+86400*Second-1, 0); d.Remaining != 999 || d.ResetAfter != 3999900001 {
				t.Fatalf("rounded: %+v", d)
			}
		})
	}
}
