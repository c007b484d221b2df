package jstest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// TestRestartKeepsPortAndStore: a stream created before a restart is
// there after it, and a connection that reconnects finds the server on
// its old port.
func TestRestartKeepsPortAndStore(t *testing.T) {
	s := Start(t)
	url := s.ClientURL()
	nc := Connect(t, s.Server, nats.MaxReconnects(-1), nats.ReconnectWait(10*time.Millisecond))
	js := JetStream(t, nc)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "S", Subjects: []string{"s"}}); err != nil {
		t.Fatal(err)
	}
	s.Stop()
	if s.Running() {
		t.Fatal("running after Stop")
	}
	s.Restart()
	if got := s.ClientURL(); got != url {
		t.Fatalf("restarted at %s, want %s", got, url)
	}
	if _, err := js.Stream(ctx, "S"); err != nil {
		t.Fatalf("stream after the restart: %v", err)
	}
}

// TestInProcess: a server without a listener is reached in process.
func TestInProcess(t *testing.T) {
	s := Start(t, InProcess)
	if s.Addr() != nil {
		t.Fatalf("listens on %v", s.Addr())
	}
	js := StartJetStream(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "b"}); err != nil {
		t.Fatal(err)
	}
}

// TestNoJetStream: a core server answers JetStream requests with an error.
func TestNoJetStream(t *testing.T) {
	s := Start(t, NoJetStream)
	js := JetStream(t, Connect(t, s.Server))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := js.AccountInfo(ctx); !errors.Is(err, jetstream.ErrJetStreamNotEnabled) {
		t.Fatalf("AccountInfo on a core server: %v, want ErrJetStreamNotEnabled", err)
	}
}
