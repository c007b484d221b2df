package journal

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/jstest"
	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/ownership"
	"github.com/limitmesh/limitmesh/mesh/internal/rt"
	"github.com/nats-io/nats.go/jetstream"
)

// views is a View that serves every partition in epoch 1.
type views struct{}

func (views) Serving(int) bool { return true }
func (views) Epoch(int) uint64 { return 1 }

const testParts = 64

// testJournal returns a journal of node "me" (prefix rl, testParts
// partitions, none held) on a fresh server with the state bucket rl_state
// and the journal stream RL_JOURNAL, and the bucket and JetStream.
func testJournal(t *testing.T) (*Journal, jetstream.KeyValue, jetstream.JetStream) {
	t.Helper()
	js := jstest.StartJetStream(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "rl_state"})
	if err != nil {
		t.Fatal(err)
	}
	st, err := kvstate.NewJetStreamStore(ctx, js, "rl_state")
	if err != nil {
		t.Fatal(err)
	}
	s, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: StreamName("rl"), Subjects: []string{Subjects("rl") + "*"}})
	if err != nil {
		t.Fatal(err)
	}
	j := New(Config{Self: "me", Prefix: "rl", Parts: testParts,
		Stream: NewJetStreamStream(context.Background(), s, st, 5*time.Second, nil),
		Bucket: NewJetStreamBucket(st, "rl_state"), View: views{}, Runtime: rt.Real,
		Timeout: time.Second, CheckpointInterval: time.Hour, ReadCache: time.Minute, Floors: true})
	t.Cleanup(j.Stop)
	return j, kv, js
}

// keyIn returns a key of partition p other than not.
func keyIn(p int, not string) string {
	for i := 0; ; i++ {
		if k := "p.t.k=" + strconv.Itoa(i); ownership.PartitionOf(k, testParts) == p && k != not {
			return k
		}
	}
}

// wait waits (bounded) for done to be called and returns its error.
func wait(t *testing.T, start func(done func(error))) error {
	t.Helper()
	ch := make(chan error, 1)
	start(func(err error) { ch <- err })
	select {
	case err := <-ch:
		return err
	case <-time.After(30 * time.Second):
		t.Fatal("no answer within 30s")
		return nil
	}
}
