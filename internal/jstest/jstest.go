// Package jstest starts embedded nats-servers for tests: JetStream stored
// in the test's temporary directory, ready for connections before Start
// returns, shut down (and waited for) when the test ends. Connections
// opened with [Connect] close when the test ends too.
//
// Only _test.go files import it; it imports nothing of this module.
package jstest

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// readyWait is how long a server may take to accept connections.
const readyWait = 60 * time.Second

// Option changes the options [Start] gives its server.
type Option func(*server.Options)

// InProcess starts the server without a listener: reach it with [Connect]
// (an in-process connection) only.
func InProcess(o *server.Options) { o.DontListen = true }

// NoJetStream starts a core NATS server, without JetStream and its store.
func NoJetStream(o *server.Options) { o.JetStream, o.StoreDir = false, "" }

// Server is an embedded nats-server that a test can stop and start again:
// a restart keeps its port and its store directory, so connections that
// reconnect find it and JetStream finds its streams.
type Server struct {
	*server.Server // the running server (the last one started)

	t    testing.TB
	opts server.Options
}

// Start starts a server with JetStream on a random port of 127.0.0.1,
// storing in a new directory of t.TempDir(), changed by opts. The test
// fails if the server cannot start.
func Start(t testing.TB, opts ...Option) *Server {
	t.Helper()
	s := &Server{t: t, opts: server.Options{
		Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: t.TempDir(),
		NoLog: true, NoSigs: true,
	}}
	for _, o := range opts {
		o(&s.opts)
	}
	s.Server = start(t, &s.opts)
	t.Cleanup(func() { shutdown(s.Server) })
	if a, ok := s.Addr().(*net.TCPAddr); ok {
		s.opts.Port = a.Port
	}
	return s
}

// Stop shuts the server down and waits until it is down.
func (s *Server) Stop() { shutdown(s.Server) }

// Restart starts the server again, after [Server.Stop], on the same port
// and store directory.
func (s *Server) Restart() {
	s.t.Helper()
	s.Server = start(s.t, &s.opts)
}

// Run starts a server with the options o (a cluster member, a server from a
// configuration file) and shuts it down when the test ends. It starts the
// server with a copy of o, so o can start it again.
func Run(t testing.TB, o *server.Options) *server.Server {
	t.Helper()
	s := start(t, o)
	t.Cleanup(func() { shutdown(s) })
	return s
}

// start starts a server with a copy of o and waits until it accepts
// connections.
func start(t testing.TB, o *server.Options) *server.Server {
	t.Helper()
	c := *o
	s, err := server.NewServer(&c)
	if err != nil {
		t.Fatal(err)
	}
	go s.Start()
	if !s.ReadyForConnections(readyWait) {
		s.Shutdown()
		name := c.ServerName
		if name == "" {
			name = "nats-server"
		}
		t.Fatalf("%s not ready after %s", name, readyWait)
	}
	return s
}

func shutdown(s *server.Server) {
	s.Shutdown()
	s.WaitForShutdown()
}

// Connect opens a connection to s, in process when s has no listener,
// and closes it when the test ends.
func Connect(t testing.TB, s *server.Server, opts ...nats.Option) *nats.Conn {
	t.Helper()
	url := ""
	if s.Addr() == nil {
		opts = append(opts, nats.InProcessServer(s))
	} else {
		url = s.ClientURL()
	}
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// JetStream returns the JetStream context of nc.
func JetStream(t testing.TB, nc *nats.Conn) jetstream.JetStream {
	t.Helper()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return js
}

// StartJetStream starts an in-process server with JetStream and returns
// JetStream on a connection to it: the set-up of a test that needs only
// streams and buckets.
func StartJetStream(t testing.TB) jetstream.JetStream {
	t.Helper()
	return JetStream(t, Connect(t, Start(t, InProcess).Server))
}

// KeyValue creates (or opens) the KV bucket cfg describes on js.
func KeyValue(t testing.TB, js jetstream.JetStream, cfg jetstream.KeyValueConfig) jetstream.KeyValue {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	kv, err := js.CreateOrUpdateKeyValue(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return kv
}

// Eventually polls cond every 10 ms until it holds, failing the test once
// limit has passed: the one bounded wait of tests on observable state.
func Eventually(t testing.TB, limit time.Duration, what string, cond func() bool) {
	t.Helper()
	EventuallyWhy(t, limit, what, func() (bool, string) { return cond(), "" })
}

// EventuallyWhy is Eventually with a condition that says why it does not
// hold yet; the failure quotes its last reason.
func EventuallyWhy(t testing.TB, limit time.Duration, what string, cond func() (ok bool, why string)) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for {
		ok, why := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			if why != "" {
				t.Fatalf("timed out after %v waiting for %s (last: %s)", limit, what, why)
			}
			t.Fatalf("timed out after %v waiting for %s", limit, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
