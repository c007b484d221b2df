package usage

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// MeasureLag counts the messages after the ledger consumer's
// acknowledgement floor and ages the oldest record of the first of them:
// the whole stream before the consumer exists, what is not acknowledged
// after, nothing once everything is; garbage is aged by its stream time.
func TestMeasureLag(t *testing.T) {
	ts := startServer(t)
	nc, js := connect(t, ts)
	ctx := testCtx(t)
	if _, err := MeasureLag(ctx, js, "rl", time.Now()); !errors.Is(err, jetstream.ErrStreamNotFound) {
		t.Fatalf("no stream: %v, want ErrStreamNotFound", err)
	}
	ensureStream(t, js)
	if l, err := MeasureLag(ctx, js, "rl", time.Now()); err != nil || l != (LedgerLag{}) {
		t.Fatalf("empty stream: %+v %v", l, err)
	}
	t0 := time.Date(2026, 12, 3, 10, 0, 0, 0, time.UTC)
	for i := range 3 {
		// Records out of order within a batch: the oldest counts.
		b := Batch{Node: "n1", Policy: "acme", Records: []Record{
			ledgerRecord(t, "acme", 1, t0.Add(time.Duration(i)*time.Second+time.Millisecond).UnixMicro(), 1, true),
			ledgerRecord(t, "acme", 2, t0.Add(time.Duration(i)*time.Second).UnixMicro(), 1, true),
		}}
		for j := range b.Records {
			b.Records[j].ID = fmt.Sprintf("n1.b.%d", 2*i+j)
		}
		if _, err := js.Publish(ctx, Subject("rl", "acme"), appendBatch(nil, &b)); err != nil {
			t.Fatal(err)
		}
	}
	now := t0.Add(10 * time.Second)
	if l, err := MeasureLag(ctx, js, "rl", now); err != nil || l != (LedgerLag{Pending: 3, Oldest: 10 * time.Second}) {
		t.Fatalf("no consumer: %+v %v, want 3 pending, 10s", l, err)
	}
	s, _ := js.Stream(ctx, StreamName("rl"))
	cons, err := s.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{Durable: LedgerConsumer, AckPolicy: jetstream.AckExplicitPolicy})
	if err != nil {
		t.Fatal(err)
	}
	if l, err := MeasureLag(ctx, js, "rl", now); err != nil || l != (LedgerLag{Pending: 3, Oldest: 10 * time.Second}) {
		t.Fatalf("nothing delivered: %+v %v", l, err)
	}
	batch, err := cons.Fetch(3)
	if err != nil {
		t.Fatal(err)
	}
	var msgs []jetstream.Msg
	for m := range batch.Messages() {
		msgs = append(msgs, m)
	}
	if len(msgs) != 3 {
		t.Fatalf("fetched %d messages", len(msgs))
	}
	// Delivered, not acknowledged: still behind.
	if l, err := MeasureLag(ctx, js, "rl", now); err != nil || l != (LedgerLag{Pending: 3, Oldest: 10 * time.Second}) {
		t.Fatalf("delivered: %+v %v", l, err)
	}
	for _, m := range msgs[:2] {
		if err := m.DoubleAck(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if l, err := MeasureLag(ctx, js, "rl", now); err != nil || l != (LedgerLag{Pending: 1, Oldest: 8 * time.Second}) {
		t.Fatalf("two acknowledged: %+v %v, want 1 pending, 8s", l, err)
	}
	if err := msgs[2].DoubleAck(ctx); err != nil {
		t.Fatal(err)
	}
	if l, err := MeasureLag(ctx, js, "rl", now); err != nil || l != (LedgerLag{}) {
		t.Fatalf("all acknowledged: %+v %v", l, err)
	}
	// Garbage: aged by the time the stream stored it.
	if err := nc.Publish(Subject("rl", "acme"), []byte("not a batch")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the garbage to be pending", func() bool {
		l, err := MeasureLag(ctx, js, "rl", time.Now().Add(time.Hour))
		return err == nil && l.Pending == 1 && l.Oldest > 59*time.Minute && l.Oldest < 61*time.Minute
	})
}
