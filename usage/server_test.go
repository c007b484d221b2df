package usage

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// testServer is an embedded nats-server with JetStream on a TCP port, so a
// test can restart it on the same port and store directory.
type testServer struct {
	t    testing.TB
	opts *server.Options
	srv  *server.Server
}

func startServer(t testing.TB) *testServer {
	t.Helper()
	ts := &testServer{t: t, opts: &server.Options{
		Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: t.TempDir(),
		NoLog: true, NoSigs: true,
	}}
	ts.start()
	// Keep the port for restarts.
	ts.opts.Port = ts.srv.Addr().(*net.TCPAddr).Port
	t.Cleanup(func() { ts.srv.Shutdown(); ts.srv.WaitForShutdown() })
	return ts
}

func (ts *testServer) start() {
	ts.t.Helper()
	srv, err := server.NewServer(ts.opts)
	if err != nil {
		ts.t.Fatal(err)
	}
	go srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		ts.t.Fatal("nats-server not ready")
	}
	ts.srv = srv
}

// stop shuts the server down and waits until it is down.
func (ts *testServer) stop() {
	ts.srv.Shutdown()
	ts.srv.WaitForShutdown()
}

func (ts *testServer) url() string { return ts.srv.ClientURL() }

// connect returns a JetStream context on a new connection that reconnects
// forever; the connection is closed at cleanup.
func (ts *testServer) connect(t testing.TB) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc, err := nats.Connect(ts.url(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return nc, js
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

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}
