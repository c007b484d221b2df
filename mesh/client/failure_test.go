package client

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/jstest"
)

// TestEmergencyBucketSteps drives one emergency bucket (rate 2/s, burst 3)
// through a timeline, in micro-unit costs and nanosecond instants.
func TestEmergencyBucketSteps(t *testing.T) {
	const sec = int64(time.Second)
	b := emergencyBucket{perSecond: 2, capacity: 3e9, credit: 3e9, last: 0}
	steps := []struct {
		now, cost int64
		ok        bool
		remaining int64 // micro
		retry     int64 // ns
		never     bool
		reset     int64 // ns
	}{
		{0, 1e6, true, 2e6, 0, false, sec / 2},
		{0, 1e6, true, 1e6, 0, false, sec},
		{0, 1e6, true, 0, 0, false, 3 * sec / 2},
		{0, 1e6, false, 0, sec / 2, false, 3 * sec / 2},
		{sec/2 - 1, 1e6, false, 999_999, 1, false, sec + 1},       // 1 ns short
		{sec / 2, 1e6, true, 0, 0, false, 3 * sec / 2},            // refilled exactly one
		{sec / 2, 4e6, false, 0, 0, true, 3 * sec / 2},            // above burst: never
		{sec / 4, 500_000, false, 0, sec / 4, false, 3 * sec / 2}, // clock stepped back: no refill
		{100 * sec, 1, true, 2_999_999, 0, false, 500},            // long idle: capped at burst
		{100 * sec, 2_999_999, true, 0, 0, false, 3 * sec / 2},    // exactly depleted
	}
	for i, s := range steps {
		ok, remaining, retry, never, reset := b.take(s.now, s.cost)
		if ok != s.ok || remaining != s.remaining || retry != s.retry || never != s.never || reset != s.reset {
			t.Fatalf("step %d (now %d, cost %d): got ok=%v remaining=%d retry=%d never=%v reset=%d; want %+v",
				i, s.now, s.cost, ok, remaining, retry, never, reset, s)
		}
	}
}

func TestFailClosed(t *testing.T) {
	s := startServer(t)
	nc := jstest.Connect(t, s)
	failClosed := OnUnavailable(func(string, map[string]string) Failure { return FailClosed() })
	d := map[string]string{"tenant": "acme"}

	check := func(t *testing.T, c *Client, cause error) {
		t.Helper()
		res, err := c.Decide(context.Background(), d, 1)
		if err != nil {
			t.Fatalf("Decide: %v, want a fail-closed result", err)
		}
		if res.Allowed || res.Source != SourceFailClosed || res.RetryAfter != FailClosedRetryAfter || !errors.Is(res.Err, cause) {
			t.Fatalf("Decide = %+v, want a fail-closed denial caused by %v", res, cause)
		}
	}
	t.Run("no responders", func(t *testing.T) {
		check(t, newClient(t, nc, failClosed), ErrNoResponders)
	})
	t.Run("503", func(t *testing.T) {
		sub := jstest.Connect(t, s)
		rsp := startResponder(t, sub, "rl503", func(seenRequest) answer {
			return answer{Code: 503, Symbol: "unavailable", Message: "store unreachable"}
		})
		check(t, newClient(t, nc, failClosed, Prefix("rl503")), ErrUnavailable)
		rsp.stop(sub)
	})
	t.Run("timeout", func(t *testing.T) {
		c := newClient(t, nc, failClosed, Timeout(50*time.Millisecond), Prefix("silent"))
		silentResponder(t, c)
		check(t, c, ErrTimeout)
	})
	t.Run("400 is not masked", func(t *testing.T) {
		sub := jstest.Connect(t, s)
		startResponder(t, sub, "rl400", func(seenRequest) answer {
			return answer{Code: 400, Symbol: "bad_request", Message: "missing plan"}
		})
		c := newClient(t, nc, failClosed, Prefix("rl400"))
		res, err := c.Decide(context.Background(), d, 1)
		if !errors.Is(err, ErrInvalidRequest) || res != nil {
			t.Fatalf("Decide = %+v, %v; want ErrInvalidRequest", res, err)
		}
	})
	t.Run("500 is not masked", func(t *testing.T) {
		sub := jstest.Connect(t, s)
		startResponder(t, sub, "rl500", func(seenRequest) answer {
			return answer{Code: 500, Symbol: "internal", Message: "bug"}
		})
		c := newClient(t, nc, failClosed, Prefix("rl500"))
		res, err := c.Decide(context.Background(), d, 1)
		if !errors.Is(err, ErrInternal) || res != nil {
			t.Fatalf("Decide = %+v, %v; want ErrInternal", res, err)
		}
	})
}

// TestFailOpenBucket: with no responders, the emergency bucket admits exactly
// burst, then refills at its rate on the injected clock.
func TestFailOpenBucket(t *testing.T) {
	s := startServer(t)
	nc := jstest.Connect(t, s)
	clock := newFakeClock()
	c := newClient(t, nc, Clock(clock.Now),
		OnUnavailable(func(string, map[string]string) Failure { return FailOpenBucket(1, 3) }))
	ctx := context.Background()
	a := map[string]string{"tenant": "a"}

	decide := func(d map[string]string, opts ...DecideOption) *Result {
		t.Helper()
		res, err := c.Decide(ctx, d, 1, opts...)
		if err != nil {
			t.Fatalf("Decide: %v", err)
		}
		if res.Source != SourceEmergency || !errors.Is(res.Err, ErrNoResponders) {
			t.Fatalf("Decide = %+v, want an emergency result caused by no responders", res)
		}
		return res
	}
	for i := range 3 {
		if res := decide(a); !res.Allowed || res.Remaining != microDecimal(int64(2-i)*1e6) {
			t.Fatalf("request %d: %+v, want admitted with %d left", i, res, 2-i)
		}
	}
	res := decide(a)
	if res.Allowed || res.RetryAfter != time.Second || res.ResetAfter != 3*time.Second {
		t.Fatalf("request 4: %+v, want denied, retry after 1s, reset after 3s", res)
	}
	// Other keys have their own bucket.
	if res := decide(map[string]string{"tenant": "b"}); !res.Allowed {
		t.Fatalf("other key: %+v, want admitted", res)
	}
	clock.Advance(999 * time.Millisecond)
	if res := decide(a); res.Allowed || res.RetryAfter != time.Millisecond {
		t.Fatalf("after 999ms: %+v, want denied, retry after 1ms", res)
	}
	clock.Advance(time.Millisecond)
	if res := decide(a); !res.Allowed {
		t.Fatalf("after 1s: %+v, want admitted", res)
	}
	if res := decide(a); res.Allowed {
		t.Fatalf("second after 1s: %+v, want denied", res)
	}
	// Fractional costs spend exactly: 1.5 s refill 1.5 units, two halves and one 0.5 fit, a fourth 0.5 not.
	clock.Advance(1500 * time.Millisecond)
	for i, want := range []bool{true, true, true, false} {
		if res := decide(a, Cost("0.5")); res.Allowed != want {
			t.Fatalf("half %d: %+v, want allowed=%v", i, res, want)
		}
	}
	// A cost above the burst can never be admitted.
	clock.Advance(time.Hour)
	if res := decide(a, Cost("3.000001")); res.Allowed || !res.Never {
		t.Fatalf("cost above burst: %+v, want never", res)
	}
}

// TestFailurePerPolicy: the failure function sees the policy that last
// decided the descriptor, remembered from the service's answers, and
// chooses the behaviour per policy.
func TestFailurePerPolicy(t *testing.T) {
	s := startServer(t)
	nc := jstest.Connect(t, s)
	sub := jstest.Connect(t, s)
	rsp := startResponder(t, sub, "rl", func(r seenRequest) answer {
		return reply(true, r.Descriptor["tenant"]+"-policy", 1, "5", 0, 0)
	})
	seen := make(chan string, 16)
	c := newClient(t, nc, Clock(newFakeClock().Now), OnUnavailable(func(policy string, d map[string]string) Failure {
		seen <- policy
		if policy == "open-policy" || d["tier"] == "free" {
			return FailOpenBucket(1, 1)
		}
		if policy == "" {
			return ReturnError()
		}
		return FailClosed()
	}))
	ctx := context.Background()
	open := map[string]string{"tenant": "open"}
	closed := map[string]string{"tenant": "closed"}
	for _, d := range []map[string]string{open, closed} {
		if res, err := c.Decide(ctx, d, 1); err != nil || res.Source != SourceService {
			t.Fatalf("Decide(%v) with the service up: %+v, %v", d, res, err)
		}
	}
	rsp.stop(sub)

	tests := []struct {
		d       map[string]string
		policy  string
		source  Source
		allowed bool
		err     error
	}{
		{open, "open-policy", SourceEmergency, true, nil},
		{open, "open-policy", SourceEmergency, false, nil},
		{closed, "closed-policy", SourceFailClosed, false, nil},
		{map[string]string{"tenant": "new", "tier": "free"}, "", SourceEmergency, true, nil},
		{map[string]string{"tenant": "new"}, "", 0, false, ErrNoResponders},
	}
	for i, tt := range tests {
		res, err := c.Decide(ctx, tt.d, 1)
		if got := <-seen; got != tt.policy {
			t.Errorf("case %d: failure function saw policy %q, want %q", i, got, tt.policy)
		}
		if tt.err != nil {
			if !errors.Is(err, tt.err) || res != nil {
				t.Errorf("case %d: %+v, %v; want error %v", i, res, err, tt.err)
			}
			continue
		}
		if err != nil || res.Source != tt.source || res.Allowed != tt.allowed || res.Policy != tt.policy {
			t.Errorf("case %d: %+v, %v; want source %v allowed %v policy %q", i, res, err, tt.source, tt.allowed, tt.policy)
		}
	}
}

// TestEmergencyBucketsBounded: at most MaxEmergencyBuckets keys are kept;
// the least recently used one is evicted (and starts full again).
func TestEmergencyBucketsBounded(t *testing.T) {
	s := startServer(t)
	c := newClient(t, jstest.Connect(t, s), Clock(newFakeClock().Now), MaxEmergencyBuckets(2),
		OnUnavailable(func(string, map[string]string) Failure { return FailOpenBucket(1, 1) }))
	ctx := context.Background()
	allowed := func(tenant string) bool {
		t.Helper()
		res, err := c.Decide(ctx, map[string]string{"tenant": tenant}, 1)
		if err != nil {
			t.Fatal(err)
		}
		return res.Allowed
	}
	steps := []struct {
		tenant string
		want   bool
	}{
		{"a", true}, {"a", false}, // a exhausted
		{"b", true},  // a, b kept
		{"a", false}, // a used again: most recent
		{"c", true},  // evicts b
		{"a", false}, // a still kept and exhausted
		{"b", true},  // b evicted earlier: a fresh, full bucket (evicts c)
	}
	for i, st := range steps {
		if got := allowed(st.tenant); got != st.want {
			t.Fatalf("step %d (%s): allowed = %v, want %v", i, st.tenant, got, st.want)
		}
		if n := c.keys.len(); n > 2 {
			t.Fatalf("step %d: %d keys kept, want <= 2", i, n)
		}
	}
}

func TestFailOpenBucketInvalidParameters(t *testing.T) {
	for _, f := range []Failure{FailOpenBucket(0, 1), FailOpenBucket(1, 0), FailOpenBucket(-1, 5), FailOpenBucket(1, MaxCost+1)} {
		if f != FailClosed() {
			t.Errorf("invalid FailOpenBucket = %+v, want FailClosed", f)
		}
	}
	if f := FailOpenBucket(MaxCost, MaxCost); f.kind != failOpenBucket {
		t.Errorf("FailOpenBucket(MaxCost, MaxCost) = %+v, want an emergency bucket", f)
	}
}

func TestDescriptorKeyInjective(t *testing.T) {
	pairs := [][2]map[string]string{
		{{"a": "b:c"}, {"a": "b", "c": ""}},
		{{"ab": "c"}, {"a": "bc"}},
		{{"a": "1", "b": "2"}, {"a": "12"}},
	}
	for _, p := range pairs {
		if descriptorKey(p[0]) == descriptorKey(p[1]) {
			t.Errorf("descriptorKey(%v) == descriptorKey(%v)", p[0], p[1])
		}
	}
	if descriptorKey(map[string]string{"x": "1", "y": "2"}) != descriptorKey(map[string]string{"y": "2", "x": "1"}) {
		t.Error("descriptorKey depends on insertion order")
	}
}

func TestMicroDecimal(t *testing.T) {
	for m, want := range map[int64]Decimal{0: "0", 1: "0.000001", 1_500_000: "1.5", 12_000_000: "12", 2_000_050: "2.00005"} {
		if got := microDecimal(m); got != want {
			t.Errorf("microDecimal(%d) = %q, want %q", m, got, want)
		}
		if back, ok := want.Micro(); !ok || back != m {
			t.Errorf("%q.Micro() = %d, %v; want %d", want, back, ok, m)
		}
	}
}

// TestFailOpenBucketConcurrent: concurrent requests for one key during an
// outage, with the clock standing still, admit exactly burst.
func TestFailOpenBucketConcurrent(t *testing.T) {
	s := startServer(t)
	c := newClient(t, jstest.Connect(t, s), Clock(newFakeClock().Now),
		OnUnavailable(func(string, map[string]string) Failure { return FailOpenBucket(1, 25) }))
	const workers, each = 8, 20
	admitted := make(chan int, workers)
	for range workers {
		go func() {
			n := 0
			for range each {
				res, err := c.Decide(context.Background(), map[string]string{"tenant": "acme"}, 1)
				if err == nil && res.Allowed {
					n++
				}
			}
			admitted <- n
		}()
	}
	total := 0
	for range workers {
		total += <-admitted
	}
	if total != 25 {
		t.Fatalf("admitted %d of %d concurrent requests, want exactly the burst 25", total, workers*each)
	}
}
