package kvstate

import "testing"

func TestFixedWindowSteps(t *testing.T) {
	l := Limit{Algorithm: FixedWindow, Limit: 10 * Unit, Window: Second}
	const hour = 3600 * Second
	run(t, l, State{}, []step{
		// Empty window.
		{at: 0, cost: 0, allowed: true, remaining: 10 * Unit, reset: Second},
		// The whole limit just before the boundary...
		{at: 900 * ms, cost: 10 * Unit, allowed: true, remaining: 0, reset: 100 * ms},
		{at: 900 * ms, cost: 1, retry: 100 * ms, reset: 100 * ms},
		{at: Second - 1, cost: Unit, retry: 1, reset: 1},
		// ...and again exactly at it: 2L within 100 ms (§5).
		{at: Second, cost: 10 * Unit, allowed: true, remaining: 0, reset: Second},
		// A time before the stored window is inside it: no new window.
		{at: 999 * ms, cost: Unit, retry: 1001 * ms, reset: 1001 * ms},
		// More than the limit never fits.
		{at: 1500 * ms, cost: 11 * Unit, retry: Never, reset: 500 * ms},
		// An hour later, a fresh window.
		{at: hour + 250*ms, cost: 3 * Unit, allowed: true, remaining: 7 * Unit, reset: 750 * ms},
		{at: hour + 300*ms, cost: 7 * Unit, allowed: true, remaining: 0, reset: 700 * ms},
	})
}

func TestFixedWindowAlignment(t *testing.T) {
	// Windows align to multiples of Window since the epoch, also before it.
	for _, c := range []struct{ t, w, want int64 }{
		{0, 10, 0}, {9, 10, 0}, {10, 10, 10}, {-1, 10, -10}, {-10, 10, -10}, {-11, 10, -20},
		{minInt64, 3, minInt64}, {maxInt64, Second, maxInt64 - maxInt64%Second},
	} {
		if got := alignDown(c.t, c.w); got != c.want {
			t.Errorf("alignDown(%d, %d) = %d, want %d", c.t, c.w, got, c.want)
		}
	}
}

func TestSlidingWindowSteps(t *testing.T) {
	l := Limit{Algorithm: SlidingWindow, Limit: 10 * Unit, Window: Second}
	run(t, l, State{}, []step{
		{at: 500 * ms, cost: 10 * Unit, allowed: true, remaining: 0, reset: 500 * ms},
		// Nothing fits in this window; in the next, the previous 10 units
		// weigh (1e9-e)/1e9 and one micro-unit fits once
		// ceil(1e7*(1e9-e)/1e9) <= 1e7-1, at e = 100 ns.
		{at: 999 * ms, cost: 1, retry: ms + 100, reset: ms},
		{at: Second + 99, cost: 1, retry: 1, reset: Second - 99},
		{at: Second + 100, cost: 1, allowed: true, remaining: 0, reset: Second - 100},
		// At 1.1 s the estimate is 1 + ceil(1e7*0.9) = 9000001 micro-units;
		// one unit fits when the weighted previous count drops to 8999999.
		{at: 1100 * ms, cost: Unit, remaining: 999999, retry: 100, reset: 900 * ms},
		{at: 1100*ms + 100, cost: Unit, allowed: true, remaining: 0, reset: 900*ms - 100},
		// The whole limit must wait for a window whose previous count is 0.
		{at: 1200 * ms, cost: 10 * Unit, remaining: 999999, retry: 1800 * ms, reset: 800 * ms},
		// One ns before: the previous count (1000001) still weighs 1 (rounded up).
		{at: 3*Second - 1, cost: 10 * Unit, remaining: 10*Unit - 1, retry: 1, reset: 1},
		{at: 3 * Second, cost: 10 * Unit, allowed: true, remaining: 0, reset: Second},
		{at: 3 * Second, cost: 11 * Unit, retry: Never, reset: Second},
		// A time before the stored window counts as its start (full weight).
		{at: 2500 * ms, cost: 1, retry: 1500*ms + 100, reset: 1500 * ms},
	})
}
