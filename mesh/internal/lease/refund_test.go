package lease

import (
	"testing"

	"github.com/limitmesh/limitmesh/kvstate"
	"pgregory.net/rapid"
)

// TestRefundSteps: what each algorithm takes back of a grant's unspent
// units, and when it takes nothing.
func TestRefundSteps(t *testing.T) {
	tb := kvstate.Limit{Algorithm: kvstate.TokenBucket, Rate: 10 * u, Burst: 40 * u}
	gc := kvstate.Limit{Algorithm: kvstate.GCRA, Rate: 10 * u, Burst: 40 * u}
	fw := kvstate.Limit{Algorithm: kvstate.FixedWindow, Limit: 100 * u, Window: 60 * s}
	sw := kvstate.Limit{Algorithm: kvstate.SlidingWindow, Limit: 100 * u, Window: 60 * s}
	sl := kvstate.Limit{Algorithm: kvstate.SlidingLog, Limit: 100 * u, Window: 60 * s}
	qu := kvstate.Limit{Algorithm: kvstate.Quota, Limit: 100 * u, Period: kvstate.Day}
	cases := []struct {
		name      string
		l         kvstate.Limit
		grant     int64 // debited at 0
		at        int64 // refund instant
		back      int64
		took      int64
		remaining int64 // at the refund instant, after it
	}{
		{"bucket", tb, 30 * u, 0, 20 * u, 20 * u, 30 * u},
		{"bucket refilled meanwhile", tb, 30 * u, 1 * s, 20 * u, 20 * u, 40 * u},
		{"bucket capped at burst", tb, 30 * u, 2500 * ms, 20 * u, 5 * u, 40 * u},
		{"gcra", gc, 30 * u, 0, 20 * u, 20 * u, 30 * u},
		{"gcra capped at burst", gc, 30 * u, 2500 * ms, 20 * u, 5 * u, 40 * u},
		{"fixed window, same window", fw, 30 * u, 59 * s, 20 * u, 20 * u, 90 * u},
		{"fixed window, next window", fw, 30 * u, 61 * s, 20 * u, 0, 100 * u},
		{"sliding window, same window", sw, 30 * u, 30 * s, 20 * u, 20 * u, 90 * u},
		{"sliding window, previous window", sw, 30 * u, 90 * s, 20 * u, 20 * u, 95 * u},
		{"sliding window, long ago", sw, 30 * u, 180 * s, 20 * u, 0, 100 * u},
		{"sliding log", sl, 30 * u, 30 * s, 20 * u, 20 * u, 90 * u},
		{"sliding log, entry gone", sl, 30 * u, 61 * s, 20 * u, 0, 100 * u},
		{"quota, same day", qu, 30 * u, 3600 * s, 20 * u, 20 * u, 90 * u},
		{"quota, next day", qu, 30 * u, 86400 * s, 20 * u, 0, 100 * u},
	}
	for _, c := range cases {
		d, st := kvstate.Decide(c.l, kvstate.State{}, 0, c.grant)
		if !d.Allowed {
			t.Fatalf("%s: grant denied", c.name)
		}
		got, took := Refund(c.l, st, c.at, c.back, 0)
		if took != c.took {
			t.Errorf("%s: took %d, want %d", c.name, took, c.took)
		}
		if d, _ := kvstate.Decide(c.l, got, c.at, 0); d.Remaining != c.remaining {
			t.Errorf("%s: remaining %d, want %d", c.name, d.Remaining, c.remaining)
		}
	}
	// Never seen, another algorithm, nothing to give: unchanged.
	if st, took := Refund(tb, kvstate.State{}, 0, u, 0); took != 0 || st.Algorithm != 0 {
		t.Fatalf("refund into a never-seen state: %+v %d", st, took)
	}
	conc := kvstate.Limit{Algorithm: kvstate.Concurrency, Limit: 10 * u, Window: s}
	_, st := kvstate.Decide(conc, kvstate.State{}, 0, u)
	if _, took := Refund(conc, st, 0, u, 0); took != 0 {
		t.Fatal("concurrency refunded")
	}
}

// TestRefundProperty: a refund never leaves a limit holding more than it
// would had the grant been smaller by the refunded units from the start,
// and never takes back more than it was given.
func TestRefundProperty(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		alg := rapid.SampledFrom([]kvstate.Algorithm{kvstate.TokenBucket, kvstate.GCRA, kvstate.FixedWindow,
			kvstate.SlidingWindow, kvstate.SlidingLog, kvstate.Quota}).Draw(t, "alg")
		var l kvstate.Limit
		switch {
		case alg.Bucket():
			l = kvstate.Limit{Algorithm: alg, Rate: rapid.Int64Range(1, 100*u).Draw(t, "rate"),
				Burst:   rapid.Int64Range(1, 100*u).Draw(t, "burst"),
				RatePer: rapid.SampledFrom([]int64{0, 60 * s, 86400 * s}).Draw(t, "per")}
		case alg == kvstate.Quota:
			l = kvstate.Limit{Algorithm: alg, Limit: rapid.Int64Range(1, 100*u).Draw(t, "limit"), Period: kvstate.Hour}
		default:
			l = kvstate.Limit{Algorithm: alg, Limit: rapid.Int64Range(1, 100*u).Draw(t, "limit"),
				Window: rapid.Int64Range(1, 100*s).Draw(t, "window")}
		}
		now := rapid.Int64Range(0, 1000*s).Draw(t, "start")
		var st kvstate.State
		for i := range rapid.IntRange(0, 5).Draw(t, "traffic") {
			now += rapid.Int64Range(0, 10*s).Draw(t, "gap")
			if _, ns := kvstate.Decide(l, st, now, rapid.Int64Range(1, l.Capacity()).Draw(t, "cost")); ns.Algorithm != 0 {
				st = ns
			}
			_ = i
		}
		now += rapid.Int64Range(0, 10*s).Draw(t, "gap")
		g := rapid.Int64Range(1, l.Capacity()).Draw(t, "grant")
		d, granted := kvstate.Decide(l, st, now, g)
		if !d.Allowed {
			t.Skip("grant denied")
		}
		back := rapid.Int64Range(0, g).Draw(t, "back")
		at := now + rapid.Int64Range(0, 200*s).Draw(t, "later")
		got, took := Refund(l, granted, at, back, now)
		if took < 0 || took > back {
			t.Fatalf("took %d of %d", took, back)
		}
		ref := st
		if g > back {
			var ok kvstate.Decision
			ok, ref = kvstate.Decide(l, st, now, g-back)
			if !ok.Allowed {
				t.Fatalf("the smaller grant is denied")
			}
		}
		have, _ := kvstate.Decide(l, got, at, 0)
		want, _ := kvstate.Decide(l, ref, at, 0)
		if have.Remaining > want.Remaining {
			t.Fatalf("after the refund %d remain, had the grant been %d from the start %d", have.Remaining, g-back, want.Remaining)
		}
	})
}
