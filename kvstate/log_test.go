package kvstate

import "testing"

func TestSlidingLogSteps(t *testing.T) {
	l := Limit{Algorithm: SlidingLog, Limit: 3 * Unit, Window: Second}
	run(t, l, State{}, []step{
		{at: 0, cost: Unit, allowed: true, remaining: 2 * Unit, reset: Second},
		{at: 100 * ms, cost: Unit, allowed: true, remaining: Unit, reset: Second},
		{at: 200 * ms, cost: Unit, allowed: true, remaining: 0, reset: Second},
		// Full: the oldest entry (t0) expires at t0+1s.
		{at: 300 * ms, cost: Unit, retry: 700 * ms, reset: 900 * ms},
		{at: Second - 1, cost: Unit, retry: 1, reset: 200*ms + 1},
		// Expiry at the exact boundary: an entry at t counts while t > now-W.
		{at: Second, cost: Unit, allowed: true, remaining: 0, reset: Second},
		{at: Second, cost: 4 * Unit, retry: Never, reset: Second},
		// Two units need the two oldest entries (100 ms, 200 ms) gone.
		{at: Second, cost: 2 * Unit, retry: 200 * ms, reset: Second},
		// A time before the newest entry is treated as its instant.
		{at: 500 * ms, cost: Unit, retry: 600 * ms, reset: 1500 * ms},
		// At 1.2 s the entries at 100 ms and 200 ms have both expired.
		{at: 1200 * ms, cost: 2 * Unit, allowed: true, remaining: 0, reset: Second},
	})
}

func TestSlidingLogFull(t *testing.T) {
	// A limit far above MaxLogEntries micro-units: the entry cap binds.
	l := Limit{Algorithm: SlidingLog, Limit: 100 * MaxLogEntries, Window: Second}
	s := State{Algorithm: SlidingLog}
	for i := range MaxLogEntries - 1 {
		s.Log = append(s.Log, LogEntry{At: t0 + int64(i), Cost: 1})
	}
	d, s := Decide(l, s, t0+MaxLogEntries-1, 1)
	if !d.Allowed || len(s.Log) != MaxLogEntries {
		t.Fatalf("last entry: %+v, %d entries", d, len(s.Log))
	}
	now := t0 + MaxLogEntries
	d, s2 := Decide(l, s, now, 1)
	if d.Allowed || d.RetryAfter != t0+Second-now {
		t.Fatalf("full log: %+v, want a denial until the oldest expires (%d)", d, t0+Second-now)
	}
	d, s2 = Decide(l, s2, now+d.RetryAfter, 1)
	if !d.Allowed || len(s2.Log) != MaxLogEntries {
		t.Fatalf("after the oldest expired: %+v, %d entries", d, len(s2.Log))
	}
}
