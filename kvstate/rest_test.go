package kvstate

import (
	"math"
	"reflect"
	"testing"

	"pgregory.net/rapid"
)

// sameAsFresh reports whether deciding cost at t against s gives what a
// never-seen state gives: the same Decision and, when admitted, the same
// next State (a denial or a probe returns each its own input).
func sameAsFresh(l Limit, s State, t, cost int64) (bool, Decision, Decision) {
	d, ns := Decide(l, s, t, cost)
	fd, fns := Decide(l, State{}, t, cost)
	if d != fd {
		return false, d, fd
	}
	if d.Allowed && cost > 0 && !reflect.DeepEqual(ns, fns) {
		return false, d, fd
	}
	return true, d, fd
}

// TestRestAt: after random traffic, any request at any instant at or
// after RestAt decides as against a never-seen state; 1 ns before
// RestAt, some request (a probe, one micro-unit or the whole capacity)
// does not.
func TestRestAt(t *testing.T) {
	for _, alg := range allAlgorithms {
		t.Run(alg.String(), func(t *testing.T) {
			rapid.Check(t, func(t *rapid.T) {
				l := genLimit(t, alg)
				var s State
				for _, a := range genArrivals(t, l.Capacity(), rapid.Bool().Draw(t, "backwards")) {
					_, s = Decide(l, s, a.now, a.cost)
				}
				at := RestAt(l, s)
				if at == math.MaxInt64 {
					return
				}
				after := rapid.OneOf(rapid.Just(int64(0)), rapid.Int64Range(0, 1000), rapid.Int64Range(0, 40*dayT)).Draw(t, "after")
				now := satAdd(at, after)
				if at == math.MinInt64 {
					now = rapid.Int64Range(t0-dayT, t0+40*dayT).Draw(t, "now")
				}
				for _, cost := range []int64{0, 1, l.Capacity(), rapid.Int64Range(1, l.Capacity()+1).Draw(t, "cost")} {
					if ok, d, fd := sameAsFresh(l, s, now, cost); !ok {
						t.Fatalf("state %+v, RestAt %d: at %d cost %d decides %+v, fresh %+v", s, at, now, cost, d, fd)
					}
				}
				if at == math.MinInt64 {
					return
				}
				differs := false
				for _, cost := range []int64{0, 1, l.Capacity()} {
					if ok, _, _ := sameAsFresh(l, s, at-1, cost); !ok {
						differs = true
					}
				}
				if !differs {
					t.Fatalf("state %+v is already at rest at %d, 1 ns before RestAt", s, at-1)
				}
			})
		})
	}
}

func TestRestAtSteps(t *testing.T) {
	tb := Limit{Algorithm: TokenBucket, Rate: 3 * Unit, Burst: 2 * Unit}
	_, s := Decide(tb, State{}, t0, 2*Unit)
	// 2 units at 3/s refill in 666666666.7 ns.
	if got := RestAt(tb, s); got != t0+666666667 {
		t.Errorf("token_bucket: %d", got-t0)
	}
	// A 1000/d bucket drained of 1000 rests a day later, to the ns.
	daily := Limit{Algorithm: TokenBucket, Rate: 1000 * Unit, Burst: 1000 * Unit, RatePer: dayT}
	_, s = Decide(daily, State{}, t0, 1000*Unit)
	if got := RestAt(daily, s); got != t0+dayT {
		t.Errorf("1000/d: %d", got-t0)
	}
	g := Limit{Algorithm: GCRA, Rate: 3 * Unit, Burst: 2 * Unit}
	_, s = Decide(g, State{}, t0, 2*Unit)
	if got := RestAt(g, s); got != t0+666666667 {
		t.Errorf("gcra: %d", got-t0)
	}
	fw := Limit{Algorithm: FixedWindow, Limit: Unit, Window: Second}
	_, s = Decide(fw, State{}, t0+300*ms, 1)
	if got := RestAt(fw, s); got != t0+Second {
		t.Errorf("fixed_window: %d", got-t0)
	}
	sw := Limit{Algorithm: SlidingWindow, Limit: Unit, Window: Second}
	_, s = Decide(sw, State{}, t0+300*ms, 1)
	if got := RestAt(sw, s); got != t0+2*Second {
		t.Errorf("sliding_window: %d", got-t0)
	}
	sl := Limit{Algorithm: SlidingLog, Limit: Unit, Window: Second}
	_, s = Decide(sl, State{}, t0+300*ms, 1)
	if got := RestAt(sl, s); got != t0+1300*ms {
		t.Errorf("sliding_log: %d", got-t0)
	}
	c := Limit{Algorithm: Concurrency, Limit: Unit, Window: Second}
	_, s = Decide(c, State{}, t0+300*ms, 1)
	if got := RestAt(c, s); got != t0+1300*ms {
		t.Errorf("concurrency: %d", got-t0)
	}
	q := Limit{Algorithm: Quota, Limit: Unit, Period: Month}
	_, s = Decide(q, State{}, utc(2024, 2, 10, 0, 0, 0, 0), 1)
	if got := RestAt(q, s); got != utc(2024, 3, 1, 0, 0, 0, 0) {
		t.Errorf("quota: %d", got)
	}
	// At rest at every instant, or never.
	if got := RestAt(tb, State{}); got != math.MinInt64 {
		t.Errorf("never seen: %d", got)
	}
	if got := RestAt(g, State{Algorithm: GCRA, TAT: math.MaxInt64}); got != math.MaxInt64 {
		t.Errorf("saturated gcra: %d", got)
	}
	if got := RestAt(Limit{Algorithm: TokenBucket}, State{Algorithm: TokenBucket}); got != math.MinInt64 {
		t.Errorf("unusable limit: %d", got)
	}
}

func TestRestSpan(t *testing.T) {
	for _, c := range []struct {
		l    Limit
		want int64
	}{
		{Limit{Algorithm: TokenBucket, Rate: 10 * Unit, Burst: 40 * Unit}, 4 * Second},
		{Limit{Algorithm: GCRA, Rate: 3 * Unit, Burst: 1 * Unit}, 333333334},
		{Limit{Algorithm: TokenBucket, Rate: 1000 * Unit, Burst: 40 * Unit, RatePer: dayT}, 3456 * Second},
		{Limit{Algorithm: FixedWindow, Limit: Unit, Window: Second}, Second},
		{Limit{Algorithm: SlidingWindow, Limit: Unit, Window: Second}, 2 * Second},
		{Limit{Algorithm: SlidingLog, Limit: Unit, Window: Second}, Second},
		{Limit{Algorithm: Concurrency, Limit: Unit, Window: Second}, Second},
		{Limit{Algorithm: Quota, Limit: Unit, Period: Hour}, 3600 * Second},
		{Limit{Algorithm: Quota, Limit: Unit, Period: Week}, 7 * dayT},
		{Limit{Algorithm: Quota, Limit: Unit, Period: Month}, 31 * dayT},
		{Limit{Algorithm: TokenBucket, Rate: 1, Burst: math.MaxInt64}, math.MaxInt64},
		{Limit{}, 0},
	} {
		if got := RestSpan(c.l); got != c.want {
			t.Errorf("RestSpan(%+v) = %d, want %d", c.l, got, c.want)
		}
	}
	// The bound holds for states Decide returns with a clock that never
	// steps back.
	for _, alg := range allAlgorithms {
		t.Run(alg.String(), func(t *testing.T) {
			rapid.Check(t, func(t *rapid.T) {
				l := genLimit(t, alg)
				var s State
				for _, a := range genArrivals(t, l.Capacity(), false) {
					d, ns := Decide(l, s, a.now, a.cost)
					if d.Allowed && a.cost > 0 {
						if at := RestAt(l, ns); at > satAdd(a.now, RestSpan(l)) {
							t.Fatalf("decided at %d, at rest at %d, more than RestSpan %d later", a.now, at, RestSpan(l))
						}
					}
					s = ns
				}
			})
		})
	}
}

func TestRefill(t *testing.T) {
	for _, c := range []struct {
		l          Limit
		span, want int64
	}{
		{Limit{Algorithm: TokenBucket, Rate: 10 * Unit, Burst: Unit}, 600 * ms, 6 * Unit},
		{Limit{Algorithm: GCRA, Rate: 3 * Unit, Burst: Unit}, 1, 1}, // 0.003 rounded up
		{Limit{Algorithm: TokenBucket, Rate: 1000 * Unit, Burst: Unit, RatePer: dayT}, 3600 * Second, 41666667},
		{Limit{Algorithm: TokenBucket, Rate: 1000 * Unit, Burst: Unit, RatePer: dayT}, dayT, 1000 * Unit},
		{Limit{Algorithm: TokenBucket, Rate: math.MaxInt64, Burst: Unit}, 2 * Second, math.MaxInt64},
		{Limit{Algorithm: TokenBucket, Rate: Unit, Burst: Unit}, -5, 0},
		{Limit{Algorithm: FixedWindow, Limit: Unit, Window: Second}, Second, 0},
	} {
		if got := c.l.Refill(c.span); got != c.want {
			t.Errorf("Refill(%+v, %d) = %d, want %d", c.l, c.span, got, c.want)
		}
	}
}
