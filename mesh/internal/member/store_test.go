package member

import (
	"context"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/jstest"
	"github.com/limitmesh/limitmesh/internal/storetest"
	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/nats-io/nats.go/jetstream"
)

// TestBucketStoreTTL: without the journal, each record written to the
// state bucket carries its time to live (the state TTL, or until it comes
// to rest plus the margin), by the store's clock; a store that cannot
// write TTLs, or retention off, writes none.
func TestBucketStoreTTL(t *testing.T) {
	js := jstest.StartJetStream(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "st", TTL: time.Hour}); err != nil {
		t.Fatal(err)
	}
	if _, err := kvstate.EnsureTTLStream(ctx, js, "KV_st", 24*time.Hour); err != nil {
		t.Fatal(err)
	}
	st, err := kvstate.NewJetStreamStore(ctx, js, "st")
	if err != nil {
		t.Fatal(err)
	}
	stream, err := js.Stream(ctx, "KV_st")
	if err != nil {
		t.Fatal(err)
	}
	now := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	clock := func() time.Time { return now }
	record := func(rest time.Duration) []byte {
		return keyrec.Append(nil, &keyrec.Record{Policy: "p", Revision: 1, Version: 1, RestAt: now.Add(rest).UnixNano()})
	}
	ret := keyrec.Retention{Floor: 3 * time.Second, Horizon: 24 * time.Hour}
	for _, c := range []struct {
		key   string
		store BucketStore
		rest  time.Duration
		want  string
	}{
		{"rests-in-an-hour", BucketStore{Bucket: st, Retention: ret, Now: clock}, time.Hour, "3602"},
		{"at-rest", BucketStore{Bucket: st, Retention: ret, Now: clock}, -time.Second, "3"},
		{"beyond-the-horizon", BucketStore{Bucket: st, Retention: ret, Now: clock}, 48 * time.Hour, "never"},
		{"retention-off", BucketStore{Bucket: st, Now: clock}, time.Hour, ""},
	} {
		done := make(chan uint64, 1)
		c.store.UpdateAsync(c.key, record(c.rest), nil, 0, 5*time.Second, func(rev uint64, err error) {
			if err != nil {
				t.Errorf("%s: %v", c.key, err)
			}
			done <- rev
		})
		m, err := stream.GetMsg(ctx, <-done)
		if err != nil {
			t.Fatal(err)
		}
		if got := m.Header.Get(jetstream.MsgTTLHeader); got != c.want {
			t.Fatalf("%s: Nats-TTL %q, want %q", c.key, got, c.want)
		}
	}
	// A store without TTLs (in memory) writes the record as it is.
	mem := BucketStore{Bucket: memAsync{storetest.NewMem()}, Retention: ret, Now: clock}
	done := make(chan error, 1)
	mem.UpdateAsync("k", record(time.Hour), nil, 0, time.Second, func(_ uint64, err error) { done <- err })
	if err := <-done; err != nil {
		t.Fatalf("memory store: %v", err)
	}
}

// memAsync is a storetest.Mem as an AsyncStore (no TTLs).
type memAsync struct{ *storetest.Mem }

func (m memAsync) GetAsync(key string, _ time.Duration, done func([]byte, uint64, error)) {
	go done(m.Get(context.Background(), key))
}

func (m memAsync) UpdateAsync(key string, val []byte, rev uint64, _ time.Duration, done func(uint64, error)) {
	go done(m.Update(context.Background(), key, val, rev))
}
