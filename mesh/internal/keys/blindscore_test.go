package keys

import "testing"

// TestBlindScore: a new table tries blind creates; the score falls by the
// votes against them and rises by those for them, within ±blindScoreMax,
// so after a long run of losses it takes as many wins to try again.
func TestBlindScore(t *testing.T) {
	var b blindScore
	b.v.Store(blindScoreStart)
	steps := []struct {
		vote  int64
		times int
		want  int64
	}{
		{0, 0, blindScoreStart},
		{-2, 2, 0},                // two lost blind creates
		{1, 1, 1},                 // a first read finds the key absent
		{-1, 100, -blindScoreMax}, // a handoff of existing keys: bounded below
		{1, blindScoreMax, 0},
		{1, 100, blindScoreMax}, // new keys: bounded above
	}
	for i, s := range steps {
		for range s.times {
			b.vote(s.vote)
		}
		if got := b.v.Load(); got != s.want {
			t.Fatalf("step %d: score %d, want %d", i, got, s.want)
		}
		if b.allows() != (s.want > 0) {
			t.Fatalf("step %d: allows %v at score %d", i, b.allows(), s.want)
		}
	}
}
