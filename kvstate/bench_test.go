package kvstate

import (
	"testing"
	"time"

	"golang.org/x/time/rate"
)

// benchLimits are one limit per algorithm with the Acme contract's shape
// (10 units/s, burst 40; 40 per second for windows).
var benchLimits = []Limit{
	{Algorithm: TokenBucket, Rate: 10 * Unit, Burst: 40 * Unit},
	{Algorithm: GCRA, Rate: 10 * Unit, Burst: 40 * Unit},
	{Algorithm: FixedWindow, Limit: 40 * Unit, Window: Second},
	{Algorithm: SlidingWindow, Limit: 40 * Unit, Window: Second},
	{Algorithm: SlidingLog, Limit: 40 * Unit, Window: Second},
	{Algorithm: Concurrency, Limit: 40 * Unit, Window: Second},
	{Algorithm: Quota, Limit: 40 * Unit, Period: Month},
}

// BenchmarkDecide decides one unit every 10 ms (a mix of admissions and
// denials at steady state) and keeps the new state, as an owner does.
func BenchmarkDecide(b *testing.B) {
	for _, l := range benchLimits {
		b.Run(l.Algorithm.String(), func(b *testing.B) {
			var s State
			now := t0
			b.ReportAllocs()
			for b.Loop() {
				now += 10 * ms
				_, s = Decide(l, s, now, Unit)
			}
		})
	}
}

// BenchmarkDecideAll is one token bucket through DecideAll, reusing dst.
func BenchmarkDecideAll(b *testing.B) {
	limits := benchLimits[:1]
	states := make([]State, 1)
	dst := make([]State, 0, 1)
	now := t0
	b.ReportAllocs()
	for b.Loop() {
		now += 10 * ms
		_, dst = DecideAll(limits, states, now, Unit, dst)
		states, dst = dst, states
	}
}

// BenchmarkCodec encodes and decodes a one-limit token_bucket key state
// with reused buffers.
func BenchmarkCodec(b *testing.B) {
	_, s := Decide(benchLimits[0], State{}, t0, 3*Unit)
	states := []State{s}
	buf := make([]byte, 0, 64)
	out := make([]State, 0, 1)
	b.ReportAllocs()
	for b.Loop() {
		buf = AppendStates(buf[:0], states)
		var err error
		if out, err = DecodeStates(buf, out); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkXTimeRate is the reference: golang.org/x/time/rate's AllowN on
// the same traffic as BenchmarkDecide/token_bucket (it also takes a mutex).
func BenchmarkXTimeRate(b *testing.B) {
	lim := rate.NewLimiter(10, 40)
	now := time.Unix(0, t0)
	b.ReportAllocs()
	for b.Loop() {
		now = now.Add(10 * time.Millisecond)
		lim.AllowN(now, 1)
	}
}
