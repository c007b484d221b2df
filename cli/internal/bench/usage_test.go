package bench

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// usageCost: the bytes the stream took over the decisions, exact while
// it discarded nothing and estimated from the messages added and their
// mean size once it did; the hours its limits hold at that many bytes per
// decision and decisions per second.
func TestUsageCost(t *testing.T) {
	lim := jetstream.StreamConfig{MaxAge: 24 * time.Hour, MaxBytes: 1 << 30}
	mark := func(first, last, msgs, bytes uint64, cfg jetstream.StreamConfig) usageStreamMark {
		return usageStreamMark{firstSeq: first, lastSeq: last, msgs: msgs, bytes: bytes, cfg: cfg}
	}
	for _, tc := range []struct {
		name          string
		before, after usageStreamMark
		decisions     int64
		perSec        float64
		bpd, hours    float64 // hours -1: unbounded
		estimated     bool
	}{
		{"empty stream", mark(0, 0, 0, 0, lim), mark(1, 100, 100, 1_000_000, lim), 20_000, 10_000, 50, 0.597, false},
		{"stream with history", mark(1, 100, 100, 1_000_000, lim), mark(1, 200, 200, 1_500_000, lim), 10_000, 1000, 50, 5.965, false},
		{"full: estimated", mark(1, 100, 100, 1_000_000, lim), mark(51, 200, 150, 1_500_000, lim), 10_000, 1000, 100, 2.983, true},
		{"max age binds", mark(0, 0, 0, 0, lim), mark(1, 10, 10, 1000, lim), 10, 1, 100, 24, false},
		{"max msgs binds", mark(0, 0, 0, 0, jetstream.StreamConfig{MaxMsgs: 3600}), mark(1, 10, 10, 1000, jetstream.StreamConfig{MaxMsgs: 3600}),
			100, 10, 10, 1, false},
		{"no limits", mark(0, 0, 0, 0, jetstream.StreamConfig{}), mark(1, 10, 10, 1000, jetstream.StreamConfig{}), 10, 1, 100, -1, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			u := usageCost(tc.before, tc.after, tc.decisions, tc.perSec)
			if u.BytesPerDecision == nil || *u.BytesPerDecision != tc.bpd || u.Estimated != tc.estimated {
				t.Fatalf("bytes per decision %v (estimated %v), want %v (%v)", u.BytesPerDecision, u.Estimated, tc.bpd, tc.estimated)
			}
			switch {
			case tc.hours < 0 && u.RetentionHours != nil:
				t.Errorf("retention %v h, want unbounded", *u.RetentionHours)
			case tc.hours >= 0 && (u.RetentionHours == nil || *u.RetentionHours != tc.hours):
				t.Errorf("retention %v h, want %v", u.RetentionHours, tc.hours)
			}
		})
	}
	if u := usageCost(mark(0, 0, 0, 0, lim), mark(0, 0, 0, 0, lim), 0, 0); u.BytesPerDecision != nil {
		t.Errorf("no decisions: %v bytes per decision", *u.BytesPerDecision)
	}
}

func TestStatusKB(t *testing.T) {
	status := []byte("Name:\tlimitmesh\nVmPeak:\t 2345678 kB\nVmHWM:\t  987654 kB\nVmRSS:\t  123 kB\nThreads:\t12\n")
	for _, tc := range []struct {
		field string
		kb    int64
		ok    bool
	}{{"VmHWM", 987654, true}, {"VmRSS", 123, true}, {"Threads", 0, false}, {"VmSwap", 0, false}} {
		if kb, ok := statusKB(status, tc.field); kb != tc.kb || ok != tc.ok {
			t.Errorf("%s: %d %v, want %d %v", tc.field, kb, ok, tc.kb, tc.ok)
		}
	}
}
