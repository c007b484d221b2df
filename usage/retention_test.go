package usage

import (
	"bytes"
	"fmt"
	"log/slog"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
)

// CheckRetention on a stream of 1000 messages over 100 s (10 a second):
// the headroom is what goes before the first unread message plus the room
// left, at the stream's rate, or what max age leaves it, whichever is less;
// near below a tenth of the window.
func TestCheckRetention(t *testing.T) {
	t0 := time.Date(2026, 12, 3, 10, 0, 0, 0, time.UTC)
	// full: 1000 messages of 1000 bytes in a stream of max 1 MB.
	full := RetentionInput{Now: t0.Add(100 * time.Second), FirstSeq: 1001, LastSeq: 2001, Msgs: 1000, Bytes: 1_000_000,
		FirstTime: t0, LastTime: t0.Add(100 * time.Second), MaxAge: 24 * time.Hour, MaxBytes: 1_000_000}
	with := func(f func(*RetentionInput)) RetentionInput {
		in := full
		f(&in)
		return in
	}
	inf := math.Inf(1)
	for _, tc := range []struct {
		name             string
		in               RetentionInput
		window, headroom float64
		lost             uint64
		near             bool
	}{
		{"caught up", with(func(in *RetentionInput) { in.Next = 2002 }), 100, 100, 0, false},
		{"full, 50 messages ahead of the oldest", with(func(in *RetentionInput) { in.Next = 1051 }), 100, 5, 0, true},
		{"full, 100 ahead: a tenth exactly", with(func(in *RetentionInput) { in.Next = 1101 }), 100, 10, 0, false},
		{"full, 99 ahead", with(func(in *RetentionInput) { in.Next = 1100 }), 100, 9.9, 0, true},
		{"full, half way", with(func(in *RetentionInput) { in.Next = 1501 }), 100, 50, 0, false},
		{"at the oldest", with(func(in *RetentionInput) { in.Next = 1001 }), 100, 0, 0, true},
		{"discarded unread", with(func(in *RetentionInput) { in.Next = 990 }), 100, 0, 11, true},
		{"a tenth full, nothing read", with(func(in *RetentionInput) { in.MaxBytes = 10_000_000; in.Next = 1001 }), 1000, 900, 0, false},
		{"max msgs", with(func(in *RetentionInput) { in.MaxBytes = 0; in.MaxMsgs = 2000; in.Next = 1001 }), 200, 100, 0, false},
		{"max msgs, the tighter", with(func(in *RetentionInput) { in.MaxBytes = 10_000_000; in.MaxMsgs = 1000; in.Next = 1051 }), 100, 5, 0, true},
		{"max age, message time known", with(func(in *RetentionInput) {
			in.MaxBytes, in.MaxAge, in.Next, in.NextTime = 0, 200*time.Second, 1051, t0.Add(5*time.Second)
		}), 200, 105, 0, false},
		{"max age, near", with(func(in *RetentionInput) {
			in.MaxBytes, in.MaxAge, in.Next, in.NextTime, in.Now = 0, 200*time.Second, 1051, t0.Add(5*time.Second), t0.Add(190*time.Second)
		}), 200, 15, 0, true},
		{"max age, time estimated from the rate", with(func(in *RetentionInput) { in.MaxBytes, in.MaxAge, in.Next = 0, 200*time.Second, 1501 }), 200, 150, 0, false},
		{"max age before max bytes", with(func(in *RetentionInput) { in.MaxAge, in.Next = 60*time.Second, 1501 }), 60, 10, 0, false},
		{"past max age", with(func(in *RetentionInput) {
			in.MaxBytes, in.MaxAge, in.Next, in.Now = 0, 60*time.Second, 1101, t0.Add(time.Hour)
		}), 60, 0, 0, true},
		{"no limits", with(func(in *RetentionInput) { in.MaxBytes, in.MaxAge, in.Next = 0, 0, 1001 }), inf, inf, 0, false},
		{"empty stream", RetentionInput{Now: t0, FirstSeq: 5, LastSeq: 4, MaxAge: time.Hour, MaxBytes: 1000, Next: 5}, 3600, 3600, 0, false},
		{"one message: no rate, max age only", RetentionInput{Now: t0.Add(10 * time.Second), FirstSeq: 7, LastSeq: 7, Msgs: 1, Bytes: 1000,
			FirstTime: t0, LastTime: t0, MaxAge: time.Hour, MaxBytes: 1000, Next: 7}, 3600, 3590, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := CheckRetention(tc.in)
			if !nearlyEqual(r.Window, tc.window) || !nearlyEqual(r.Headroom, tc.headroom) || r.Lost != tc.lost || r.Near() != tc.near {
				t.Errorf("got window %g headroom %g lost %d near %v, want %g %g %d %v",
					r.Window, r.Headroom, r.Lost, r.Near(), tc.window, tc.headroom, tc.lost, tc.near)
			}
		})
	}
}

// nearlyEqual compares seconds computed in floating point.
func nearlyEqual(a, b float64) bool {
	if math.IsInf(b, 1) {
		return math.IsInf(a, 1)
	}
	return math.Abs(a-b) < 1e-9*max(1, math.Abs(b))
}

// A ledger consumer that lags in a small usage stream is warned about
// (metric and counter) before its unread messages are discarded, and
// again once they are; a caught-up one is not; the shadow consumer is not
// measured while nothing reads it.
func TestRetentionWarning(t *testing.T) {
	ts := startServer(t)
	_, js := connect(t, ts)
	ctx := testCtx(t)
	// About 40 messages of ~100 bytes fit.
	if _, err := EnsureStream(ctx, js, StreamConfig{Prefix: "rl", MaxBytes: 6000}); err != nil {
		t.Fatal(err)
	}
	s, err := js.Stream(ctx, StreamName("rl"))
	if err != nil {
		t.Fatal(err)
	}
	publish := func(n int) {
		t.Helper()
		for i := range n {
			if _, err := js.Publish(ctx, Subject("rl", "acme"), fmt.Appendf(nil, "%0100d", i)); err != nil {
				t.Fatal(err)
			}
		}
	}
	cons, err := s.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{Durable: LedgerConsumer, AckPolicy: jetstream.AckExplicitPolicy})
	if err != nil {
		t.Fatal(err)
	}
	// readAll acknowledges everything there is, until the consumer's ack
	// floor is the stream's last message (a fetch that finds nothing
	// does not say that: on a busy machine it can come back empty before
	// the consumer has delivered what is there).
	readAll := func() {
		t.Helper()
		deadline := time.Now().Add(time.Minute)
		for {
			b, err := cons.FetchNoWait(100)
			if err != nil {
				t.Fatal(err)
			}
			n := 0
			for m := range b.Messages() {
				if err := m.DoubleAck(ctx); err != nil {
					t.Fatal(err)
				}
				n++
			}
			if n > 0 {
				continue
			}
			ci, err := cons.Info(ctx)
			if err != nil {
				t.Fatal(err)
			}
			si, err := s.Info(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if ci.NumPending == 0 && ci.NumAckPending == 0 && ci.AckFloor.Stream >= si.State.LastSeq {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("the consumer did not catch up: %+v, stream %+v", ci, si.State)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	reg := prometheus.NewRegistry()
	m := newRetentionMetrics()
	for _, c := range m.collectors() {
		reg.MustRegister(c)
	}
	var logs bytes.Buffer
	w := newRetentionWatch(js, "rl", m, slog.New(slog.NewTextHandler(&logs, nil)))
	ledger := map[string]string{"consumer": LedgerConsumer}
	// check runs the watch once and returns the ledger's gauge and
	// warnings, and what MeasureRetention says at the same state.
	check := func() (headroom, warnings float64, r Retention) {
		t.Helper()
		w.check(ctx, time.Now())
		r, err := MeasureRetention(ctx, js, "rl", LedgerConsumer, time.Now(), false)
		if err != nil {
			t.Fatal(err)
		}
		return counterValue(t, reg, "limitmesh_usage_retention_headroom_seconds", ledger),
			counterValue(t, reg, "limitmesh_usage_retention_warnings_total", ledger), r
	}

	// Filled up, every message read.
	publish(100)
	readAll()
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.FirstSeq == 1 {
		t.Fatalf("the stream discarded nothing: %+v", info.State)
	}
	held := int(info.State.Msgs)
	if h, n, r := check(); h <= 0 || n != 0 || r.Headroom != r.Window {
		t.Fatalf("caught up: headroom %g, %g warnings, %+v; want the whole window, no warning", h, n, r)
	}

	// The consumer stops; a few unread messages are far from the oldest.
	publish(5)
	if h, n, r := check(); n != 0 || h <= 0 || r.Headroom < 0.5*r.Window {
		t.Fatalf("5 unread: headroom %g, %g warnings, %+v; want no warning", h, n, r)
	}
	// Its first unread message becomes one of the oldest tenth.
	publish(held * 85 / 100)
	if h, n, r := check(); n != 1 || r.Lost != 0 || !(r.Headroom < NearFraction*r.Window) || h != r.Headroom {
		t.Fatalf("unread near the oldest: headroom %g, %g warnings, %+v; want 1 warning, nothing lost", h, n, r)
	}
	if !strings.Contains(logs.String(), "near the oldest") {
		t.Fatalf("no warning logged:\n%s", logs.String())
	}
	// Discarded before it read them.
	publish(held)
	if h, n, r := check(); h != 0 || n != 2 || r.Lost == 0 {
		t.Fatalf("unread discarded: headroom %g, %g warnings, %+v; want 0, 2 warnings, some lost", h, n, r)
	}
	// Caught up again.
	readAll()
	if h, n, _ := check(); h <= 0 || n != 2 {
		t.Fatalf("caught up again: headroom %g, %g warnings; want > 0, still 2", h, n)
	}

	// The shadow consumer: idle (nothing waiting, nothing unacknowledged)
	// far behind, not measured.
	if _, err := s.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{Durable: ShadowConsumer, AckPolicy: jetstream.AckAllPolicy}); err != nil {
		t.Fatal(err)
	}
	shadow := map[string]string{"consumer": ShadowConsumer}
	w.check(ctx, time.Now())
	if n := counterValue(t, reg, "limitmesh_usage_retention_warnings_total", shadow); n != 0 {
		t.Fatalf("idle shadow consumer: %g warnings", n)
	}
	if _, err := MeasureRetention(ctx, js, "rl", ShadowConsumer, time.Now(), true); err == nil {
		t.Fatal("idle shadow consumer measured")
	}
}
