package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// freeAddr returns a loopback address with a port nobody listens on now,
// from below the kernel's ephemeral range (32768 and up on Linux), so that
// no outgoing connection can take it between this pick and the bind.
func freeAddr(t *testing.T) string {
	t.Helper()
	for range 10000 {
		addr := fmt.Sprintf("127.0.0.1:%d", 20000+rand.IntN(12000))
		l, err := net.Listen("tcp", addr)
		if err == nil {
			l.Close()
			return addr
		}
	}
	t.Fatal("no free loopback port")
	return ""
}

// syncBuffer is a bytes.Buffer safe for the serve goroutine and the test.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// waitFor polls cond every 20 ms until it holds or 15 s pass.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestServeEndToEnd runs `limitmesh serve` with an embedded server, drives it
// with the other subcommands as an operator would, and stops it as SIGTERM
// does (cancelling the context): the exit code must be 0.
func TestServeEndToEnd(t *testing.T) {
	natsAddr, httpAddr := freeAddr(t), freeAddr(t)
	data := t.TempDir()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var serveErr syncBuffer
	exit := make(chan int, 1)
	go func() {
		exit <- Main(ctx, []string{"serve", "--data", data, "--http", httpAddr},
			[]string{"LIMITMESH_NATS_LISTEN=" + natsAddr}, strings.NewReader(""), &bytes.Buffer{}, &serveErr)
	}()
	waitFor(t, "/readyz", func() bool {
		resp, err := http.Get("http://" + httpAddr + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == 200
	})

	env := []string{"LIMITMESH_NATS_URL=nats://" + natsAddr}
	policy := filepath.Join(t.TempDir(), "acme.json")
	os.WriteFile(policy, []byte(`{"match":{"tenant":"acme"},"limits":[{"algorithm":"token_bucket","rate":"1/h","burst":2}]}`), 0o644)
	if code, out, errs := run(t, env, "policy", "put", "acme", policy); code != 0 || !strings.Contains(out, "put acme at revision") {
		t.Fatalf("policy put: exit %d %q %q", code, out, errs)
	}

	decide := func() map[string]any {
		t.Helper()
		code, out, errs := run(t, env, "decide", "-d", "tenant=acme")
		if code != 0 {
			t.Fatalf("decide: exit %d %q %q", code, out, errs)
		}
		var reply map[string]any
		if err := json.Unmarshal([]byte(out), &reply); err != nil {
			t.Fatalf("decide printed %q: %v", out, err)
		}
		return reply
	}
	waitFor(t, "the policy to apply", func() bool { return decide()["policy"] == "acme" })
	// The wait spent one unit of the burst of 2: one more is admitted, then denied.
	if r := decide(); r["allowed"] != true {
		t.Fatalf("second decision denied: %v", r)
	}
	if r := decide(); r["allowed"] != false || r["retry_after_ms"].(float64) <= 0 {
		t.Fatalf("third decision: %v", r)
	}

	// An invalid put is refused by the command before it reaches the bucket.
	bad := filepath.Join(t.TempDir(), "bad.json")
	os.WriteFile(bad, []byte(`{"match":{"tenant":"acme"},"limits":[]}`), 0o644)
	if code, _, errs := run(t, env, "policy", "put", "acme", bad); code == 0 || !strings.Contains(errs, "limits") {
		t.Fatalf("invalid put: exit %d %q", code, errs)
	}
	// Forced in, then rolled back to the valid revision.
	if code, _, errs := run(t, env, "policy", "put", "--force", "acme", bad); code != 0 {
		t.Fatalf("forced put: %q", errs)
	}
	if code, out, _ := run(t, env, "policy", "history", "acme"); code != 0 || !strings.Contains(out, "invalid") {
		t.Fatalf("history: %q", out)
	}
	if code, out, errs := run(t, env, "policy", "rollback", "acme"); code != 0 || !strings.Contains(out, "to the value of revision 1") {
		t.Fatalf("rollback: exit %d %q %q", code, out, errs)
	}
	if code, out, _ := run(t, env, "policy", "get", "acme"); code != 0 || !strings.Contains(out, `"burst":2`) {
		t.Fatalf("get after rollback: %q", out)
	}
	if code, out, _ := run(t, env, "policy", "list"); code != 0 || !strings.Contains(out, "acme") || !strings.Contains(out, "valid") {
		t.Fatalf("list: %q", out)
	}

	resp, err := http.Get("http://" + httpAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	var metrics bytes.Buffer
	metrics.ReadFrom(resp.Body)
	resp.Body.Close()
	if !strings.Contains(metrics.String(), `limitmesh_decisions_total{policy="acme",result="denied"}`) {
		t.Errorf("metrics lack the denied decision:\n%s", metrics.String())
	}

	cancel()
	select {
	case code := <-exit:
		if code != 0 {
			t.Fatalf("serve exited %d after the signal; stderr:\n%s", code, serveErr.String())
		}
	case <-time.After(20 * time.Second):
		t.Fatal("serve did not stop after the signal")
	}
}
