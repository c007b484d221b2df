package kvstate_test

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/jstest"
	"github.com/limitmesh/limitmesh/internal/storetest"
	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/nats-io/nats.go/jetstream"
)

// bucket starts an in-process nats-server with JetStream and creates the
// KV bucket "st" on it.
func bucket(t *testing.T) (jetstream.JetStream, jetstream.KeyValue) {
	t.Helper()
	js := jstest.StartJetStream(t)
	return js, jstest.KeyValue(t, js, jetstream.KeyValueConfig{Bucket: "st"})
}

func TestJetStreamStore(t *testing.T) {
	js, kv := bucket(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := kvstate.NewJetStreamStore(ctx, js, "st")
	if err != nil {
		t.Fatal(err)
	}
	storetest.Contract(t, s)

	// A deleted key is kvstate.ErrNotFound with the delete marker's revision, and
	// an Update expecting that revision recreates it.
	if err := kv.Delete(ctx, "k"); err != nil {
		t.Fatal(err)
	}
	_, rev, err := s.Get(ctx, "k")
	if !errors.Is(err, kvstate.ErrNotFound) || rev == 0 {
		t.Fatalf("Get of a deleted key: rev %d err %v, want the marker's revision and kvstate.ErrNotFound", rev, err)
	}
	if _, err := s.Update(ctx, "k", []byte("back"), rev); err != nil {
		t.Fatalf("Update over the delete marker: %v", err)
	}
	// Create (expected revision 0) also works over a delete marker.
	if err := kv.Delete(ctx, "other"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Update(ctx, "other", []byte("new"), 0); err != nil {
		t.Fatalf("create over a delete marker: %v", err)
	}
	// Errors other than a conflict are not kvstate.ErrConflict.
	if _, err := kvstate.NewJetStreamStore(ctx, js, "missing"); err == nil {
		t.Fatal("binding a missing bucket succeeded")
	}
	if err := js.DeleteKeyValue(ctx, "st"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.Get(ctx, "k"); err == nil || errors.Is(err, kvstate.ErrNotFound) {
		t.Fatalf("Get with the bucket gone: %v, want a store error", err)
	}
	if _, err := s.Update(ctx, "k", []byte("x"), 1); err == nil || errors.Is(err, kvstate.ErrConflict) {
		t.Fatalf("Update with the bucket gone: %v, want a store error", err)
	}
}

// blockingAsync is a Store made of an kvstate.AsyncStore's asynchronous methods,
// so the shared store contract checks them.
type blockingAsync struct{ kvstate.AsyncStore }

func (b blockingAsync) Get(ctx context.Context, key string) ([]byte, uint64, error) {
	type res struct {
		val []byte
		rev uint64
		err error
	}
	ch := make(chan res, 1)
	b.GetAsync(key, 5*time.Second, func(val []byte, rev uint64, err error) { ch <- res{val, rev, err} })
	r := <-ch
	return r.val, r.rev, r.err
}

func (b blockingAsync) Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error) {
	type res struct {
		rev uint64
		err error
	}
	ch := make(chan res, 1)
	b.UpdateAsync(key, value, rev, 5*time.Second, func(rev uint64, err error) { ch <- res{rev, err} })
	r := <-ch
	return r.rev, r.err
}

func TestJetStreamStoreAsync(t *testing.T) {
	js, kv := bucket(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := kvstate.NewJetStreamStore(ctx, js, "st")
	if err != nil {
		t.Fatal(err)
	}
	b := blockingAsync{s}
	storetest.Contract(t, b)

	// Over a delete marker, expected revision 0 loses (the caller
	// reloads); the marker's revision from Get wins.
	if err := kv.Delete(ctx, "k"); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Update(ctx, "k", []byte("x"), 0); !errors.Is(err, kvstate.ErrConflict) {
		t.Fatalf("create over a delete marker: %v, want kvstate.ErrConflict", err)
	}
	_, rev, err := b.Get(ctx, "k")
	if !errors.Is(err, kvstate.ErrNotFound) || rev == 0 {
		t.Fatalf("Get of a deleted key: rev %d err %v", rev, err)
	}
	if _, err := b.Update(ctx, "k", []byte("back"), rev); err != nil {
		t.Fatalf("Update over the delete marker: %v", err)
	}

	// Many writes in flight at once, several per key, each expecting the
	// key's initial state: exactly one per key wins, and the store holds
	// the winners' values.
	const keys, perKey = 50, 4
	type result struct {
		key, i int
		rev    uint64
		err    error
	}
	results := make(chan result, keys*perKey)
	for k := range keys {
		for i := range perKey {
			key := "many." + strconv.Itoa(k)
			s.UpdateAsync(key, []byte(strconv.Itoa(i)), 0, 5*time.Second, func(rev uint64, err error) {
				results <- result{k, i, rev, err}
			})
		}
	}
	won := make(map[int]result)
	for range keys * perKey {
		r := <-results
		switch {
		case r.err == nil:
			if _, dup := won[r.key]; dup {
				t.Fatalf("key %d: two creates won", r.key)
			}
			won[r.key] = r
		case !errors.Is(r.err, kvstate.ErrConflict):
			t.Fatalf("key %d: %v", r.key, r.err)
		}
	}
	for k := range keys {
		w, ok := won[k]
		if !ok {
			t.Fatalf("key %d: no create won", k)
		}
		val, rev, err := b.Get(ctx, "many."+strconv.Itoa(k))
		if err != nil || rev != w.rev || string(val) != strconv.Itoa(w.i) {
			t.Fatalf("key %d: stored %q rev %d err %v, want %d rev %d", k, val, rev, err, w.i, w.rev)
		}
	}
}
