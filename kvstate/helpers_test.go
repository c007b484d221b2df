package kvstate

import (
	"reflect"
	"testing"
)

// t0 is the start of the step-table timelines: a realistic Unix instant,
// aligned to a whole minute so that 1 s, 10 s and 60 s windows start there.
const t0 = 1_700_000_040 * Second

const ms = Second / 1000

// step is one request of a step table: at t0+at, cost micro-units, and the
// expected decision.
type step struct {
	at        int64
	cost      int64
	allowed   bool
	remaining int64
	retry     int64
	reset     int64
}

// run decides each step in order against l, starting from s, checking every
// field of every decision, and returns the final state.
func run(t *testing.T, l Limit, s State, steps []step) State {
	t.Helper()
	for i, st := range steps {
		before := cloneState(s)
		d, ns := Decide(l, s, t0+st.at, st.cost)
		want := Decision{Allowed: st.allowed, Remaining: st.remaining, RetryAfter: st.retry, ResetAfter: st.reset}
		if d != want {
			t.Fatalf("step %d (t0%+d ns, cost %d):\n got %+v\nwant %+v", i, st.at, st.cost, d, want)
		}
		if !reflect.DeepEqual(s, before) {
			t.Fatalf("step %d: Decide mutated its input state", i)
		}
		if !d.Allowed && !reflect.DeepEqual(ns, s) {
			t.Fatalf("step %d: a denial changed the state: %+v -> %+v", i, s, ns)
		}
		s = ns
	}
	return s
}

// cloneState returns a deep copy of s.
func cloneState(s State) State {
	c := s
	if s.Log != nil {
		c.Log = append([]LogEntry(nil), s.Log...)
	}
	if s.Holds != nil {
		c.Holds = append([]Hold(nil), s.Holds...)
	}
	return c
}

func cloneStates(ss []State) []State {
	if ss == nil {
		return nil
	}
	out := make([]State, len(ss))
	for i, s := range ss {
		out[i] = cloneState(s)
	}
	return out
}

var allAlgorithms = []Algorithm{TokenBucket, GCRA, FixedWindow, SlidingWindow, SlidingLog, Concurrency, Quota}

// MaxQuotaTest is the largest quota limit the tests draw: 1e12 units, the
// most a policy allows.
const MaxQuotaTest = 1_000_000_000_000 * Unit
