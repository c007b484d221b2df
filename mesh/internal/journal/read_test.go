package journal

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/jstest"
	"github.com/nats-io/nats.go/jetstream"
)

// journalReadStream starts an embedded server with a journal-like stream
// holding, interleaved with another subject's, msgs messages on j.a
// ("a1", "a2", ...); it returns the stream and the sequence of the last
// j.a message.
func journalReadStream(t *testing.T, msgs int) (jetstream.Stream, uint64) {
	return journalReadStreamWith(t, msgs, jetstream.StreamConfig{Name: "J", Subjects: []string{"j.*"}})
}

func journalReadStreamWith(t *testing.T, msgs int, cfg jetstream.StreamConfig) (jetstream.Stream, uint64) {
	t.Helper()
	js := jstest.StartJetStream(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := js.CreateStream(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	var last uint64
	for i := 1; i <= msgs; i++ {
		ack, err := js.Publish(ctx, "j.a", fmt.Appendf(nil, "a%d", i))
		if err != nil {
			t.Fatal(err)
		}
		last = ack.Sequence
		if i%3 == 0 {
			if _, err := js.Publish(ctx, "j.b", []byte("b")); err != nil {
				t.Fatal(err)
			}
		}
	}
	return s, last
}

// readAll reads j.a from sequence 1 to upto with j and checks that it got
// every message, in order, once.
func readAll(t *testing.T, s *JetStreamStream, msgs int, upto uint64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var got []string
	var prev uint64
	err := s.readRange(ctx, "j.a", 1, upto, func(seq uint64, data []byte) error {
		if seq <= prev {
			return fmt.Errorf("sequence %d after %d", seq, prev)
		}
		prev = seq
		got = append(got, string(data))
		return nil
	})
	if err != nil {
		t.Fatalf("readRange: %v", err)
	}
	if len(got) != msgs {
		t.Fatalf("read %d messages, want %d (last %q)", len(got), msgs, got[len(got)-1])
	}
	for i, g := range got {
		if want := fmt.Sprintf("a%d", i+1); g != want {
			t.Fatalf("message %d is %q, want %q", i, g, want)
		}
	}
}

// TestReadRangeConsumer: a range longer than the leader reads goes
// through an ordered consumer and ends on upto.
func TestReadRangeConsumer(t *testing.T) {
	const msgs = 3 * readRangeDirect
	s, upto := journalReadStream(t, msgs)
	readAll(t, &JetStreamStream{stream: s, timeout: 5 * time.Second, log: slog.New(slog.DiscardHandler)}, msgs, upto)
}

// TestReadRangeLaggingReplica: the server may place the consumer on a
// follower that lags: it reports nothing pending well before the fence, and
// an adoption that stopped there would miss a hot key's latest records.
// readRange finishes with leader reads, so it still reads up to upto.
func TestReadRangeLaggingReplica(t *testing.T) {
	const msgs = 4 * readRangeDirect
	s, upto := journalReadStream(t, msgs)
	for _, lagged := range []int{0, 1, 17, readRangeDirect} {
		t.Run(fmt.Sprintf("replica behind by all but %d", lagged), func(t *testing.T) {
			st := &JetStreamStream{stream: s, timeout: 5 * time.Second, log: slog.New(slog.DiscardHandler)}
			st.consumerRead = func(ctx context.Context, subj string, seq, upto uint64, f func(uint64, []byte) error) (uint64, bool, error) {
				// A replica that holds only lagged more messages of
				// subj: it delivers them and reports nothing pending.
				next, _, err := st.readRangeLeader(ctx, subj, seq, upto, lagged, f)
				return next, false, err
			}
			readAll(t, st, msgs, upto)
		})
	}
}

// TestReadRangeStaleLeader: a stream leader cut off from the others keeps
// answering reads, after the partition heals too, until it learns it was
// replaced, with the messages it had then. A read of a range whose end
// (a fence or barrier just appended through the current leader) such a
// replica lacks fails rather than end early: before, it ended "done" and
// an adoption forgot a hot key's latest records. Here the stream stands in
// for the stale leader: it lacks the last messages up to upto.
func TestReadRangeStaleLeader(t *testing.T) {
	for _, msgs := range []int{0, 5, 3 * readRangeDirect} {
		for _, missing := range []uint64{1, 40} {
			t.Run(fmt.Sprintf("%d messages, %d missing", msgs, missing), func(t *testing.T) {
				s, last := journalReadStream(t, msgs)
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				st := &JetStreamStream{stream: s, timeout: 2 * time.Second, log: slog.New(slog.DiscardHandler)}
				read := 0
				err := st.readRange(ctx, "j.a", 1, last+missing, func(uint64, []byte) error {
					read++
					return nil
				})
				if !errors.Is(err, ErrReadIncomplete) {
					t.Fatalf("readRange to %d on a stream ending at %d: %v after %d messages, want ErrReadIncomplete",
						last+missing, last, err, read)
				}
				if read != msgs {
					t.Fatalf("read %d messages before failing, want the %d there", read, msgs)
				}
			})
		}
	}
}

// TestReadRangeConsumerFails: when no consumer can be made (here the
// stream's consumer limit is reached; in a cluster, no leader or a replica
// cut off), readRange reads on from the leader: the read still completes
// (before, the read failed and so did the adoption), and it never waits on
// a consumer beyond its context (nats.go's ordered consumer, used before,
// retries its re-creation on every Fetch without end: an adoption's read
// held the journal reads up for minutes).
func TestReadRangeConsumerFails(t *testing.T) {
	const msgs = 3 * readRangeDirect
	s, upto := journalReadStreamWith(t, msgs, jetstream.StreamConfig{Name: "J", Subjects: []string{"j.*"}, MaxConsumers: 1})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := s.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: "taken", AckPolicy: jetstream.AckNonePolicy}); err != nil {
		t.Fatal(err)
	}
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		readAll(t, &JetStreamStream{stream: s, timeout: 2 * time.Second, log: slog.New(slog.DiscardHandler)}, msgs, upto)
	}()
	select {
	case <-finished:
	case <-time.After(30 * time.Second):
		t.Fatal("readRange did not return within 30s with no consumer to be had")
	}
}
