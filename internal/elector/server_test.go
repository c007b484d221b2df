package elector

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/limitmesh/limitmesh/internal/jstest"
)

// startServer starts an embedded nats-server with JetStream, shut down at
// cleanup, and returns its client URL.
func startServer(t *testing.T) string {
	t.Helper()
	return jstest.Start(t).ClientURL()
}

// connect returns a new connection (reconnecting forever, closed at
// cleanup) and the KV bucket "leases" on it.
func connect(t *testing.T, url string) (*nats.Conn, jetstream.KeyValue) {
	t.Helper()
	nc, err := nats.Connect(url, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	kv, err := js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "leases"})
	if err != nil {
		t.Fatal(err)
	}
	return nc, kv
}

// waitFor polls cond every 10 ms until it holds or limit passes.
func waitFor(t *testing.T, limit time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", limit, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
