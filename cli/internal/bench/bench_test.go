package bench

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh"
)

func TestInterleave(t *testing.T) {
	for _, tc := range []struct {
		echo, decide time.Duration
		rounds       int
	}{
		{10 * time.Second, 10 * time.Second, 5},
		{time.Second, 3 * time.Second, 1},
		{10*time.Second + 7, 7 * time.Second, 3}, // not divisible: 7 ns over 3 slices
		{5 * time.Millisecond, 5 * time.Millisecond, 5},
		{time.Second, time.Second, 1000},
	} {
		plan := interleave(tc.echo, tc.decide, tc.rounds)
		if len(plan) != 2*tc.rounds {
			t.Fatalf("%v: %d slices, want %d", tc, len(plan), 2*tc.rounds)
		}
		var sum [2]time.Duration
		lo := [2]time.Duration{math.MaxInt64, math.MaxInt64}
		var hi [2]time.Duration
		for i, sl := range plan {
			// echo, decide, echo, decide, ...: round i/2+1 of each.
			if sl.decide != (i%2 == 1) || sl.round != i/2+1 {
				t.Fatalf("%v: slice %d is %+v", tc, i, sl)
			}
			p := 0
			if sl.decide {
				p = 1
			}
			sum[p] += sl.d
			lo[p], hi[p] = min(lo[p], sl.d), max(hi[p], sl.d)
		}
		if sum[0] != tc.echo || sum[1] != tc.decide {
			t.Errorf("%v: slices add up to echo %v, decide %v", tc, sum[0], sum[1])
		}
		if hi[0]-lo[0] > 1 || hi[1]-lo[1] > 1 {
			t.Errorf("%v: slices not equal: echo %v..%v, decide %v..%v", tc, lo[0], hi[0], lo[1], hi[1])
		}
	}
	// One round is the two phases back to back.
	got := interleave(2*time.Second, 3*time.Second, 1)
	if want := []benchSlice{{round: 1, d: 2 * time.Second}, {decide: true, round: 1, d: 3 * time.Second}}; !slices.Equal(got, want) {
		t.Errorf("one round: %+v, want %+v", got, want)
	}
}

// TestPhasesShareKeySequence checks that worker i of either phase draws
// stream i of --seed and sends through load slot i: the phases' load is
// the same whatever the rounds, as a phase makes its workers once and
// every slice continues them.
func TestPhasesShareKeySequence(t *testing.T) {
	d, err := newKeyDist(1000, 1.1)
	if err != nil {
		t.Fatal(err)
	}
	load := []*inboxConn{{slots: []*inboxSlot{{idx: 0}, {idx: 1}}}, {slots: []*inboxSlot{{idx: 0}}}}
	r := &benchRun{c: &Config{Concurrency: 3, Seed: 7}, dist: d, load: load}
	echo, decide := r.newPhase("echo", "e", nil), r.newPhase("decide", "d", []keyTally{})
	for i, slot := range []*inboxSlot{load[0].slots[0], load[1].slots[0], load[0].slots[1]} {
		if echo.workers[i].slot != slot || decide.workers[i].slot != slot {
			t.Errorf("worker %d does not send through its load slot", i)
		}
		want := d.picker(7, uint64(i))
		for range 200 {
			k := want.next()
			if e, dk := echo.workers[i].pick.next(), decide.workers[i].pick.next(); e != k || dk != k {
				t.Fatalf("worker %d: echo key %d, decide key %d, want %d", i, e, dk, k)
			}
		}
	}
}

func TestBenchPlanBodyAndReplies(t *testing.T) {
	c := &Config{Mode: Strict, Rate: "2.5/s", Burst: "7.5", Cost: "0.25"}
	c.Prefix = "rl"
	p, err := newBenchPlan(c, "abcd0123")
	if err != nil {
		t.Fatal(err)
	}
	if p.limit.Rate != 2_500_000 || p.limit.Burst != 7_500_000 || p.cost != 250_000 {
		t.Errorf("limit %+v cost %d: want rate 2.5 units/s, burst 7.5, cost 0.25 in micro-units", p.limit, p.cost)
	}
	var req struct {
		Descriptor map[string]string `json:"descriptor"`
		Cost       json.RawMessage   `json:"cost"`
	}
	body := p.appendBody(nil, 42)
	if err := json.Unmarshal(body, &req); err != nil {
		t.Fatalf("%s: %v", body, err)
	}
	if req.Descriptor["bench_run"] != "abcd0123" || req.Descriptor["key"] != "k42" || string(req.Cost) != `"0.25"` {
		t.Errorf("body %s", body)
	}

	reply := func(allowed bool, policy string) string {
		return fmt.Sprintf(`{"allowed":%v,"policy":%q,"revision":3,"remaining":0,"retry_after_ms":1,"reset_after_ms":2}`, allowed, policy)
	}
	for _, tc := range []struct {
		body        string
		allowed, ok bool
	}{
		{reply(true, p.policyName), true, true},
		{reply(false, p.policyName), false, true},
		{reply(true, ""), false, false},                                     // no policy applied yet
		{reply(true, p.policyName+"x"), false, false},                       // another policy
		{reply(false, "other"), false, false},                               // another policy
		{`{"policy": "` + p.policyName + `", "allowed": true}`, true, true}, // another layout
		{`{"error":"unavailable","message":"x"}`, false, false},
		{`not json`, false, false},
	} {
		allowed, ok := p.scanReply([]byte(tc.body))
		if allowed != tc.allowed || ok != tc.ok {
			t.Errorf("scanReply(%s) = %v, %v; want %v, %v", tc.body, allowed, ok, tc.allowed, tc.ok)
		}
	}
}

func TestHistIndexBuckets(t *testing.T) {
	// Every value lies in its bucket, buckets are in value order and a
	// bucket is under 1/128 of its values wide.
	r := rand.New(rand.NewPCG(1, 2))
	values := []int64{0, 1, 255, 256, 257, 511, 512, 1000, 1 << 40, math.MaxInt64 - 1, math.MaxInt64}
	for range 10000 {
		values = append(values, r.Int64N(1<<uint(r.IntN(62)+1)))
	}
	for _, v := range values {
		i := histIndex(v)
		if i < 0 || i >= histBuckets {
			t.Fatalf("histIndex(%d) = %d: out of 0..%d", v, i, histBuckets-1)
		}
		hi := histUpper(i)
		lo := int64(0)
		if i > 0 {
			lo = histUpper(i-1) + 1
		}
		if v < lo || v > hi {
			t.Fatalf("%d in bucket %d = [%d, %d]", v, i, lo, hi)
		}
		if v >= histExact && float64(hi-lo+1) > float64(lo)/128 {
			t.Fatalf("bucket %d = [%d, %d] is wider than 1/128 of %d", i, lo, hi, lo)
		}
		if v < histExact && lo != hi {
			t.Fatalf("%d is not exact: bucket [%d, %d]", v, lo, hi)
		}
	}
	if histIndex(math.MaxInt64) != histBuckets-1 || histUpper(histBuckets-1) != math.MaxInt64 {
		t.Errorf("the last bucket must end at MaxInt64")
	}
	if histIndex(-5) != 0 {
		t.Errorf("a negative duration must count as 0")
	}
}

func TestHistQuantiles(t *testing.T) {
	var small latencyHist
	for v := int64(1); v <= 100; v++ {
		small.record(v)
	}
	for _, tc := range []struct {
		q    float64
		want int64
	}{{0.01, 1}, {0.5, 50}, {0.99, 99}, {0.999, 100}, {1, 100}} {
		if got := small.quantile(tc.q); got != tc.want {
			t.Errorf("1..100: quantile(%v) = %d, want %d (exact below 256)", tc.q, got, tc.want)
		}
	}

	// Microsecond to millisecond latencies, recorded in a shuffled order over
	// two histograms and merged: the answer is at or above the exact order
	// statistic and within 0.8% of it.
	const n = 100_000
	vals := make([]int64, n)
	for i := range vals {
		vals[i] = int64(i+1) * 1000 // 1 us .. 100 ms
	}
	r := rand.New(rand.NewPCG(3, 4))
	r.Shuffle(n, func(i, j int) { vals[i], vals[j] = vals[j], vals[i] })
	var a, b latencyHist
	for i, v := range vals {
		if i%3 == 0 {
			a.record(v)
		} else {
			b.record(v)
		}
	}
	a.merge(&b)
	if a.n != n || a.max != n*1000 {
		t.Fatalf("merged n %d max %d", a.n, a.max)
	}
	for _, q := range []float64{0.5, 0.9, 0.99, 0.999, 1} {
		exact := int64(math.Ceil(q*n)) * 1000
		got := a.quantile(q)
		if got < exact || float64(got-exact) > float64(exact)/128 {
			t.Errorf("quantile(%v) = %d, exact %d", q, got, exact)
		}
	}
	var empty latencyHist
	if empty.quantile(0.99) != 0 {
		t.Errorf("an empty histogram's quantile must be 0")
	}
}

func TestAllowanceAndOvershoot(t *testing.T) {
	l := kvstate.Limit{Algorithm: kvstate.TokenBucket, Rate: 1000 * kvstate.Unit, Burst: 100 * kvstate.Unit}
	for _, tc := range []struct {
		span, want int64
	}{
		{0, 100 * kvstate.Unit},
		{-5, 100 * kvstate.Unit}, // a span is never negative
		{int64(time.Millisecond), 101 * kvstate.Unit},
		{int64(time.Second), 1100 * kvstate.Unit},
		{1, 100*kvstate.Unit + 1}, // 1 ns at 1000/s is 1 micro-unit
	} {
		if got := allowance(l, tc.span); got != tc.want {
			t.Errorf("allowance(span %d) = %d, want %d", tc.span, got, tc.want)
		}
	}
	// Rounded up: 3 micro-units/s for 1 ns is 3e-9 micro-units -> 1.
	if got := allowance(kvstate.Limit{Rate: 3, Burst: 0}, 1); got != 1 {
		t.Errorf("allowance rounds up: got %d, want 1", got)
	}
	if got := allowance(kvstate.Limit{Rate: math.MaxInt64, Burst: 1}, math.MaxInt64); got != math.MaxInt64 {
		t.Errorf("allowance must saturate, got %d", got)
	}

	tally := make([]keyTally, 4)
	for i := range tally {
		tally[i].first.Store(math.MaxInt64)
	}
	ms := int64(time.Millisecond)
	// Key 0: 101 units over 1 ms: exactly the allowance.
	for i := range 101 {
		tally[0].add(kvstate.Unit, int64(i)*ms/100, ms)
	}
	// Key 1: 103.5 units over 1 ms: 2.5 over.
	for range 207 {
		tally[1].add(kvstate.Unit/2, 0, ms)
	}
	// Key 2: 150 units, first sent at 10 ms, last received at 20 ms: 110 allowed.
	tally[2].add(50*kvstate.Unit, 15*ms, 20*ms)
	tally[2].add(100*kvstate.Unit, 10*ms, 12*ms)
	// Key 3: nothing admitted.
	micro, keys := overshoot(l, tally)
	if want := 5*kvstate.Unit/2 + 40*kvstate.Unit; micro != want || keys != 2 {
		t.Errorf("overshoot = %d micro-units on %d keys, want %d on 2", micro, keys, want)
	}
}

// TestInboxLateReply checks that a reply arriving after its request timed
// out is never taken for the next request's reply, and that a subject with
// no responders fails at once.
func TestInboxLateReply(t *testing.T) {
	emb, err := mesh.StartEmbedded(mesh.EmbeddedConfig{DataDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(emb.Shutdown)
	responder, err := emb.Connect()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(responder.Close)
	// The responder holds the first request; on the second it answers the
	// first (late) and then the second.
	var held *nats.Msg
	if _, err := responder.Subscribe("slow", func(m *nats.Msg) {
		if held == nil {
			held = m
			return
		}
		_ = held.Respond([]byte("late"))
		_ = m.Respond(append([]byte("re:"), m.Data...))
	}); err != nil {
		t.Fatal(err)
	}
	if err := responder.Flush(); err != nil {
		t.Fatal(err)
	}
	nc, err := emb.Connect()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	c, err := newInboxConn(nc, 2)
	if err != nil {
		t.Fatal(err)
	}
	s := c.slots[1]
	if _, err := s.request("slow", []byte("a"), 50*time.Millisecond); !errors.Is(err, nats.ErrTimeout) {
		t.Fatalf("first request: %v, want a timeout", err)
	}
	m, err := s.request("slow", []byte("b"), 10*time.Second)
	if err != nil {
		t.Fatalf("second request: %v", err)
	}
	if string(m.Data) != "re:b" {
		t.Fatalf("second request got %q, want re:b", m.Data)
	}
	if _, err := c.slots[0].request("nobody", []byte("x"), 10*time.Second); !errors.Is(err, nats.ErrNoResponders) {
		t.Errorf("request to a subject with no responders: %v", err)
	}
}

// The bench worker's own per-request work, which the echo baseline pays
// too: it must stay far below a NATS round trip.
func BenchmarkWorkerOverhead(b *testing.B) {
	c := &Config{Mode: Strict, Rate: "1000/s", Burst: "100", Cost: "1"}
	c.Prefix = "rl"
	p, err := newBenchPlan(c, "abcd0123")
	if err != nil {
		b.Fatal(err)
	}
	d, err := newKeyDist(10000, 1.1)
	if err != nil {
		b.Fatal(err)
	}
	pick := d.picker(1, 0)
	reply := []byte(`{"allowed":true,"policy":"` + p.policyName + `","revision":3,"remaining":99,"retry_after_ms":0,"reset_after_ms":1}`)
	var (
		h    latencyHist
		body []byte
	)
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		body = p.appendBody(body[:0], pick.next())
		if allowed, ok := p.scanReply(reply); !allowed || !ok {
			b.Fatal("reply not recognised")
		}
		h.record(int64(i % 5_000_000))
	}
}
