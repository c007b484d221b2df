package kvstate

import (
	"testing"
	"time"

	"golang.org/x/time/rate"
	"pgregory.net/rapid"
)

// TestTokenBucketMatchesXTimeRate cross-checks token_bucket against
// golang.org/x/time/rate on sequences where x/time/rate's float64
// arithmetic is exact: power-of-two rates, gaps in multiples of 1/8 s and
// integral costs. Both must make the same Allow decisions (non-decreasing
// times: x/time/rate moves its clock back with the caller's).
func TestTokenBucketMatchesXTimeRate(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		r := int64(1) << rapid.IntRange(0, 4).Draw(t, "log2 rate")
		burst := rapid.IntRange(1, 20).Draw(t, "burst")
		l := Limit{Algorithm: TokenBucket, Rate: r * Unit, Burst: int64(burst) * Unit}
		ref := rate.NewLimiter(rate.Limit(r), burst)
		var s State
		now := t0
		for i := range rapid.IntRange(1, 100).Draw(t, "n") {
			now += rapid.Int64Range(0, 16).Draw(t, "eighths") * Second / 8
			n := rapid.IntRange(1, burst+1).Draw(t, "cost")
			d, ns := Decide(l, s, now, int64(n)*Unit)
			want := ref.AllowN(time.Unix(0, now), n)
			if d.Allowed != want {
				t.Fatalf("request %d (t0%+d ns, cost %d): kvstate %v, x/time/rate %v", i, now-t0, n, d.Allowed, want)
			}
			s = ns
		}
	})
}
