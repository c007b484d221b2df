package usage

import (
	"context"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/jstest"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// startServer starts an embedded nats-server with JetStream on a TCP port,
// so a test can restart it on the same port and store directory.
func startServer(t testing.TB) *jstest.Server {
	t.Helper()
	return jstest.Start(t)
}

// connect returns a JetStream context on a new connection to ts that
// reconnects forever; the connection is closed at cleanup.
func connect(t testing.TB, ts *jstest.Server) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc := jstest.Connect(t, ts.Server, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	return nc, jstest.JetStream(t, nc)
}

// waitFor polls cond every 10 ms until it holds or limit passes.
func waitFor(t *testing.T, limit time.Duration, what string, cond func() bool) {
	t.Helper()
	jstest.Eventually(t, limit, what, cond)
}

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}
