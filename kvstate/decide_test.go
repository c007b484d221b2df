package kvstate

import (
	"reflect"
	"testing"
)

func TestDecideAllSteps(t *testing.T) {
	limits := []Limit{
		{Algorithm: TokenBucket, Rate: 10 * Unit, Burst: 40 * Unit},
		{Algorithm: FixedWindow, Limit: 45 * Unit, Window: 60 * Second},
	}
	// 40 at once: both admit; the bucket has the least left.
	d, states := DecideAll(limits, nil, t0, 40*Unit, nil)
	if want := (Decision{Allowed: true, Remaining: 0, ResetAfter: 4 * Second}); d != want {
		t.Fatalf("first: %+v, want %+v", d, want)
	}
	// 1 s later the bucket has 10 but the window only 5: the window denies 6
	// and nothing is spent; the retry is the window's (59 s).
	before := cloneStates(states)
	d, next := DecideAll(limits, states, t0+Second, 6*Unit, nil)
	if want := (Decision{Allowed: false, Remaining: 5 * Unit, RetryAfter: 59 * Second, ResetAfter: 59 * Second}); d != want {
		t.Fatalf("second: %+v, want %+v", d, want)
	}
	if !reflect.DeepEqual(next, before) || !reflect.DeepEqual(states, before) {
		t.Fatalf("a denial spent: %+v", next)
	}
	// A cost above one limit's capacity: Never wins over any finite retry.
	d, _ = DecideAll(limits, states, t0+Second, 41*Unit, nil)
	if d.Allowed || d.RetryAfter != Never {
		t.Fatalf("over capacity: %+v", d)
	}
	// 5 fit both: spent in both.
	d, next = DecideAll(limits, states, t0+Second, 5*Unit, nil)
	if want := (Decision{Allowed: true, Remaining: 0, ResetAfter: 59 * Second}); d != want {
		t.Fatalf("third: %+v, want %+v", d, want)
	}
	if next[0].Tokens != 5*Unit || next[1].Count != 45*Unit {
		t.Fatalf("not spent in all: %+v", next)
	}
	// No limits: admitted.
	if d, out := DecideAll(nil, nil, t0, Unit, nil); !d.Allowed || len(out) != 0 {
		t.Fatalf("no limits: %+v %v", d, out)
	}
	// In place (dst = states[:0]): a denial still returns the inputs.
	in := cloneStates(next)
	d, out := DecideAll(limits, next, t0+Second, 10*Unit, next[:0])
	if d.Allowed || !reflect.DeepEqual(out, in) || !reflect.DeepEqual(next, in) {
		t.Fatalf("in place: %+v %+v", d, out)
	}
}

func TestZeroAllocs(t *testing.T) {
	for _, l := range []Limit{
		{Algorithm: TokenBucket, Rate: 10 * Unit, Burst: 40 * Unit},
		{Algorithm: TokenBucket, Rate: 1000 * Unit, Burst: 40 * Unit, RatePer: 86400 * Second},
		{Algorithm: GCRA, Rate: 10 * Unit, Burst: 40 * Unit},
		{Algorithm: GCRA, Rate: 1000 * Unit, Burst: 40 * Unit, RatePer: 86400 * Second},
		{Algorithm: FixedWindow, Limit: 40 * Unit, Window: Second},
		{Algorithm: SlidingWindow, Limit: 40 * Unit, Window: Second},
		{Algorithm: Quota, Limit: 40 * Unit, Period: Month},
	} {
		alg := l.Algorithm
		var s State
		now := t0
		if n := testing.AllocsPerRun(100, func() {
			now += 10 * ms
			_, s = Decide(l, s, now, Unit)
		}); n != 0 {
			t.Errorf("Decide %s: %v allocs", alg, n)
		}
		limits := []Limit{l}
		states := make([]State, 1)
		dst := make([]State, 0, 1)
		if n := testing.AllocsPerRun(100, func() {
			now += 10 * ms
			_, dst = DecideAll(limits, states, now, Unit, dst)
			states, dst = dst, states
		}); n != 0 {
			t.Errorf("DecideAll %s with dst reuse: %v allocs", alg, n)
		}
	}
}

func TestRebase(t *testing.T) {
	for _, alg := range []Algorithm{TokenBucket, GCRA} {
		t.Run(alg.String(), func(t *testing.T) {
			old := Limit{Algorithm: alg, Rate: 10 * Unit, Burst: 40 * Unit}
			_, s := Decide(old, State{}, t0, 40*Unit)
			probe := func(l Limit, s State, at int64) int64 {
				d, _ := Decide(l, s, at, 0)
				return d.Remaining
			}
			// Lowering the burst at t0+1s: 10 units refilled under the old
			// rate, clamped to 5.
			low := Limit{Algorithm: alg, Rate: 1 * Unit, Burst: 5 * Unit}
			r := Rebase(old, low, s, t0+Second)
			if got := probe(low, r, t0+Second); got != 5*Unit {
				t.Fatalf("lowered: %d left, want 5 units", got)
			}
			// Raising it adds nothing; the new rate (1/s) refills after.
			high := Limit{Algorithm: alg, Rate: 1 * Unit, Burst: 100 * Unit}
			r = Rebase(old, high, s, t0+Second)
			if got := probe(high, r, t0+Second); got != 10*Unit {
				t.Fatalf("raised: %d left, want 10 units", got)
			}
			if got := probe(high, r, t0+3*Second); got != 12*Unit {
				t.Fatalf("raised, 2 s later: %d left, want 12 units", got)
			}
			// Another algorithm starts fresh.
			other := Limit{Algorithm: FixedWindow, Limit: Unit, Window: Second}
			if r := Rebase(old, other, s, t0); !reflect.DeepEqual(r, State{}) {
				t.Fatalf("algorithm change kept state %+v", r)
			}
		})
	}
	// Windows keep their counts; a new width re-aligns the window.
	old := Limit{Algorithm: FixedWindow, Limit: 10 * Unit, Window: Second}
	_, s := Decide(old, State{}, t0+1500*ms, 3*Unit)
	nw := Limit{Algorithm: FixedWindow, Limit: 5 * Unit, Window: 60 * Second}
	r := Rebase(old, nw, s, t0+1700*ms)
	if r.WindowStart != t0 || r.Count != 3*Unit {
		t.Fatalf("fixed window rebase: %+v", r)
	}
}
