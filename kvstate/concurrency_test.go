package kvstate

import (
	"reflect"
	"strings"
	"testing"
)

func TestConcurrencySteps(t *testing.T) {
	l := Limit{Algorithm: Concurrency, Limit: 2 * Unit, Window: 10 * Second}
	var s State
	type acq struct {
		at      int64
		op      string // "acquire", "release", "decide"
		id      string
		cost    int64
		want    Decision
		holders []string // ids holding after the step, in expiry order
	}
	for i, st := range []acq{
		{0, "acquire", "a", Unit, Decision{Allowed: true, Remaining: Unit, ResetAfter: 10 * Second}, []string{"a"}},
		{Second, "acquire", "b", Unit, Decision{Allowed: true, Remaining: 0, ResetAfter: 10 * Second}, []string{"a", "b"}},
		// Full: c waits for a's hold to expire at 10 s.
		{2 * Second, "acquire", "c", Unit, Decision{RetryAfter: 8 * Second, ResetAfter: 9 * Second}, []string{"a", "b"}},
		// More than the limit never fits.
		{2 * Second, "acquire", "c", 3 * Unit, Decision{RetryAfter: Never, ResetAfter: 9 * Second}, []string{"a", "b"}},
		// a retries with the same id: renewed, counted once.
		{2 * Second, "acquire", "a", Unit, Decision{Allowed: true, Remaining: 0, ResetAfter: 10 * Second}, []string{"b", "a"}},
		// Releasing b gives its slot back; unknown ids are a no-op.
		{3 * Second, "release", "b", 0, Decision{}, []string{"a"}},
		{3 * Second, "release", "zz", 0, Decision{}, []string{"a"}},
		{3 * Second, "acquire", "c", Unit, Decision{Allowed: true, Remaining: 0, ResetAfter: 10 * Second}, []string{"a", "c"}},
		// a crashes without releasing: its hold expires at 12 s exactly.
		{12*Second - 1, "decide", "", Unit, Decision{RetryAfter: 1, ResetAfter: Second + 1}, []string{"a", "c"}},
		{12 * Second, "decide", "", Unit, Decision{Allowed: true, Remaining: 0, ResetAfter: 10 * Second}, []string{"c", ""}},
		// A later release of the expired a drops nothing but expired holds.
		{13 * Second, "release", "a", 0, Decision{}, []string{""}},
	} {
		before := cloneState(s)
		var d Decision
		var ns State
		switch st.op {
		case "acquire":
			d, ns = Acquire(l, s, t0+st.at, st.id, st.cost)
		case "decide":
			d, ns = Decide(l, s, t0+st.at, st.cost)
		case "release":
			ns = Release(s, t0+st.at, st.id)
		}
		if !reflect.DeepEqual(s, before) {
			t.Fatalf("step %d mutated its input", i)
		}
		if d != st.want {
			t.Fatalf("step %d (%s %q at %d): got %+v, want %+v", i, st.op, st.id, st.at, d, st.want)
		}
		var ids []string
		for _, h := range ns.Holds {
			ids = append(ids, h.ID)
		}
		if !reflect.DeepEqual(ids, st.holders) {
			t.Fatalf("step %d: holders %q, want %q", i, ids, st.holders)
		}
		s = ns
	}
}

func TestAcquireRejects(t *testing.T) {
	l := Limit{Algorithm: Concurrency, Limit: Unit, Window: Second}
	if d, _ := Acquire(l, State{}, t0, strings.Repeat("x", MaxHoldID+1), 1); d.Allowed || d.RetryAfter != Never {
		t.Fatalf("over-long id: %+v", d)
	}
	tb := Limit{Algorithm: TokenBucket, Rate: Unit, Burst: Unit}
	if d, _ := Acquire(tb, State{}, t0, "a", 1); d.Allowed || d.RetryAfter != Never {
		t.Fatalf("acquire on a token bucket: %+v", d)
	}
	// Release on a state of another algorithm returns it unchanged.
	s := State{Algorithm: TokenBucket, Tokens: 3}
	if got := Release(s, t0, "a"); !reflect.DeepEqual(got, s) {
		t.Fatalf("Release changed a token bucket state: %+v", got)
	}
}
