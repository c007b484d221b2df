package kvstate

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// jsBucket starts an in-process nats-server with JetStream and creates a KV
// bucket on it.
func jsBucket(t *testing.T) (jetstream.JetStream, jetstream.KeyValue) {
	t.Helper()
	srv, err := server.NewServer(&server.Options{JetStream: true, StoreDir: t.TempDir(), DontListen: true, NoLog: true, NoSigs: true})
	if err != nil {
		t.Fatal(err)
	}
	go srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		t.Fatal("server not ready")
	}
	t.Cleanup(func() { srv.Shutdown(); srv.WaitForShutdown() })
	nc, err := nats.Connect("", nats.InProcessServer(srv))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "st"})
	if err != nil {
		t.Fatal(err)
	}
	return js, kv
}

func TestJetStreamStore(t *testing.T) {
	js, kv := jsBucket(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := NewJetStreamStore(ctx, js, "st")
	if err != nil {
		t.Fatal(err)
	}
	storeContract(t, s)

	// A deleted key is ErrNotFound with the delete marker's revision, and
	// an Update expecting that revision recreates it.
	if err := kv.Delete(ctx, "k"); err != nil {
		t.Fatal(err)
	}
	_, rev, err := s.Get(ctx, "k")
	if !errors.Is(err, ErrNotFound) || rev == 0 {
		t.Fatalf("Get of a deleted key: rev %d err %v, want the marker's revision and ErrNotFound", rev, err)
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
	// Errors other than a conflict are not ErrConflict.
	if _, err := NewJetStreamStore(ctx, js, "missing"); err == nil {
		t.Fatal("binding a missing bucket succeeded")
	}
	if err := js.DeleteKeyValue(ctx, "st"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.Get(ctx, "k"); err == nil || errors.Is(err, ErrNotFound) {
		t.Fatalf("Get with the bucket gone: %v, want a store error", err)
	}
	if _, err := s.Update(ctx, "k", []byte("x"), 1); err == nil || errors.Is(err, ErrConflict) {
		t.Fatalf("Update with the bucket gone: %v, want a store error", err)
	}
}
