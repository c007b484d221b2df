package fence

import "testing"

const L = Lease(3000) // ns, so that the steps read as small numbers

// TestRuleTimeline walks one holder and one contender through a lease on
// one clock: the holder's write is sent at 100 and lands; the contender
// observes it at 130.
func TestRuleTimeline(t *testing.T) {
	const sent, seen = 100, 130
	steps := []struct {
		now                int64
		renew, acts, claim bool
	}{
		{now: 100, acts: true},
		{now: 1099, acts: true},
		{now: 1100, renew: true, acts: true}, // L/3 after the send
		{now: 2099, renew: true, acts: true},
		{now: 2100, renew: true}, // 2L/3: fenced
		{now: 3099, renew: true},
		{now: 3129, renew: true},
		{now: 3130, renew: true, claim: true}, // L after the observation
		{now: 9999, renew: true, claim: true},
	}
	for _, s := range steps {
		if got := s.now >= L.RenewAt(sent); got != s.renew {
			t.Errorf("t=%d: renew due %v, want %v", s.now, got, s.renew)
		}
		if got := L.Acts(sent, s.now); got != s.acts {
			t.Errorf("t=%d: holder acts %v, want %v", s.now, got, s.acts)
		}
		if got := L.Free(seen, s.now); got != s.claim {
			t.Errorf("t=%d: contender may claim %v, want %v", s.now, got, s.claim)
		}
	}
}

func TestRetryDelays(t *testing.T) {
	if got := L.RetryPause(); got != 187 {
		t.Errorf("RetryPause = %d, want L/16 = 187", got)
	}
	for _, s := range []struct {
		fails int
		want  int64
	}{{1, 93}, {2, 186}, {3, 372}, {4, 744}, {5, 750}, {40, 750}} {
		if got := L.Backoff(s.fails); got != s.want {
			t.Errorf("Backoff(%d) = %d, want %d", s.fails, got, s.want)
		}
	}
}

// clock is a node's monotonic clock: it reads offset + rate·t at real
// instant t (rate in parts per million of real time).
type clock struct{ offset, ppm int64 }

func (c clock) at(t int64) int64 { return c.offset + t*c.ppm/1_000_000 }

// TestRuleClockRates: with clocks whose rates differ, the holder stops
// acting before the contender may claim, while the contender's clock runs
// less than 3/2 as fast as the holder's (rates within 20% of each other:
// I1 of docs/protocol.md); beyond that the rule no longer separates them,
// which the test must see (the check is not vacuous).
//
// Real time: the holder sends its last renewal at 0, the entry holds it
// from 40, the contender observes it at 90; nothing is written after.
// The clocks' offsets are arbitrary: no reading of one is compared with a
// reading of the other.
func TestRuleClockRates(t *testing.T) {
	const lease = Lease(3_000_000_000) // 3 s
	const sendAt, seenAt = 0, 90
	for _, c := range []struct {
		name              string
		holder, contender clock
		overlap           bool
	}{
		{"same rate", clock{5, 1_000_000}, clock{-7_000, 1_000_000}, false},
		{"holder 10% slow, contender 10% fast", clock{0, 900_000}, clock{1 << 40, 1_100_000}, false},
		{"holder 20% slow, contender 19% fast", clock{0, 800_000}, clock{0, 1_190_000}, false},
		{"holder fast, contender slow", clock{0, 1_200_000}, clock{0, 800_000}, false},
		{"ratio 1.49", clock{0, 1_000_000}, clock{0, 1_490_000}, false},
		{"ratio 1.51", clock{0, 1_000_000}, clock{0, 1_510_000}, true},
		{"holder 25% slow, contender 25% fast", clock{0, 750_000}, clock{0, 1_250_000}, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			sent, seen := c.holder.at(sendAt), c.contender.at(seenAt)
			overlap := int64(-1)
			// Real instants every 100 µs over two leases.
			for rt := int64(0); rt < 2*int64(lease); rt += 100_000 {
				if lease.Acts(sent, c.holder.at(rt)) && lease.Free(seen, c.contender.at(rt)) {
					overlap = rt
					break
				}
			}
			if got := overlap >= 0; got != c.overlap {
				t.Fatalf("holder acting while the contender may claim: %v (first at real %d ns), want %v", got, overlap, c.overlap)
			}
		})
	}
}
