package jstest

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
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

// fatalRecorder is a testing.TB whose Fatalf records its message and ends
// the goroutine, as testing's does.
type fatalRecorder struct {
	testing.TB
	msg string
}

func (f *fatalRecorder) Helper() {}
func (f *fatalRecorder) Fatalf(format string, args ...any) {
	f.msg = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

// TestEventuallyWhy: a condition that comes to hold ends the wait without
// a failure; one that never holds fails it, quoting its last reason.
func TestEventuallyWhy(t *testing.T) {
	run := func(cond func() (bool, string)) string {
		f := &fatalRecorder{TB: t}
		done := make(chan struct{})
		go func() {
			defer close(done)
			EventuallyWhy(f, 20*time.Millisecond, "the cards", cond)
		}()
		<-done
		return f.msg
	}
	calls := 0
	if msg := run(func() (bool, string) { calls++; return calls == 3, "not yet" }); msg != "" || calls != 3 {
		t.Errorf("a condition holding at the third call: %d calls, failure %q", calls, msg)
	}
	n := 0
	msg := run(func() (bool, string) { n++; return false, fmt.Sprintf("%d cards", n) })
	if want := fmt.Sprintf("(last: %d cards)", n); !strings.HasPrefix(msg, "timed out after 20ms waiting for the cards") || !strings.HasSuffix(msg, want) {
		t.Errorf("failure %q, want it to end with %q", msg, want)
	}
}
