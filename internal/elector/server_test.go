package elector

import (
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
	return nc, jstest.KeyValue(t, jstest.JetStream(t, nc), jetstream.KeyValueConfig{Bucket: "leases"})
}

// waitFor polls cond every 10 ms until it holds or limit passes.
func waitFor(t *testing.T, limit time.Duration, what string, cond func() bool) {
	t.Helper()
	jstest.Eventually(t, limit, what, cond)
}
