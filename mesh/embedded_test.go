package mesh

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go"
)

// In-process connections have no write deadline unless asked for one, and
// carry request-reply both ways.
func TestEmbeddedConnectWithoutWriteDeadline(t *testing.T) {
	e, err := StartEmbedded(EmbeddedConfig{DataDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Shutdown()
	plain, err := e.Connect(nats.Name("plain"))
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	if got := plain.Opts.FlusherTimeout; got != 0 {
		t.Errorf("FlusherTimeout = %v, want 0", got)
	}
	asked, err := e.Connect(nats.FlusherTimeout(5 * time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer asked.Close()
	if got := asked.Opts.FlusherTimeout; got != 5*time.Second {
		t.Errorf("FlusherTimeout asked for = %v, want 5s", got)
	}
	sub, err := plain.Subscribe("echo", func(m *nats.Msg) { _ = m.Respond(append([]byte("re:"), m.Data...)) })
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	if err := plain.Flush(); err != nil {
		t.Fatal(err)
	}
	// A payload larger than the pipe's buffers, so writes span several
	// reads.
	big := make([]byte, 300<<10)
	for i := range big {
		big[i] = byte('a' + i%26)
	}
	reply, err := asked.Request("echo", big, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if want := "re:" + string(big); string(reply.Data) != want {
		t.Errorf("reply: %d bytes, want %d", len(reply.Data), len(want))
	}
}
