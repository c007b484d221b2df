package shadow

import (
	"context"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/usage"
)

// TestFirstSeqAt: the first message stored at or after an instant, or the
// next sequence when there is none, also while a message is being
// published during the look-up (a version that read the last sequence
// after the message get skipped such a message now and then).
func TestFirstSeqAt(t *testing.T) {
	s := startServer(t)
	_, js := connectJS(t, s)
	installation(t, js, "rl")
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	stream, err := js.Stream(ctx, usage.StreamName("rl"))
	if err != nil {
		t.Fatal(err)
	}
	subject := usage.Subject("rl", "acme-search")
	publish := func() uint64 {
		ack, err := js.Publish(ctx, subject, []byte("x"))
		if err != nil {
			t.Error(err)
			return 0
		}
		return ack.Sequence
	}

	if seq, err := firstSeqAt(ctx, js, stream, time.Now()); err != nil || seq != 1 {
		t.Fatalf("empty stream: %d, %v; want 1", seq, err)
	}
	first := publish()
	at := time.Now()
	second := publish()
	for _, c := range []struct {
		t    time.Time
		want uint64
	}{{at.Add(-time.Hour), first}, {at, second}, {time.Now(), second + 1}} {
		if seq, err := firstSeqAt(ctx, js, stream, c.t); err != nil || seq != c.want {
			t.Errorf("at %v: %d, %v; want %d", c.t, seq, err, c.want)
		}
	}

	for i := 0; i < 200 && !t.Failed(); i++ {
		from := time.Now()
		done := make(chan uint64)
		go func() { done <- publish() }()
		seq, err := firstSeqAt(ctx, js, stream, from)
		published := <-done
		if err != nil {
			t.Fatal(err)
		}
		// The concurrent message is the only one stored after from.
		if seq != published {
			m, _ := stream.GetMsg(ctx, published)
			t.Fatalf("round %d: %d, want %d (stored %v after the instant)", i, seq, published, m.Time.Sub(from))
		}
	}
}
