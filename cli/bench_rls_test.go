package cli

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"
)

// TestBenchRLSEmbedded: `bench --rls embedded` loads the embedded node's
// own Envoy bridge, alternating with the decide phase over NATS: both
// phases decide under the bench policy (denials at 1/s, burst 2), without
// errors or overshoot, and the report has the usual fields and the ratio.
func TestBenchRLSEmbedded(t *testing.T) {
	code, m, out, errOut := benchJSON(t, "--rls", "embedded", "--duration", "400ms", "--rounds", "2",
		"--keys", "50", "--zipf", "0", "--concurrency", "8", "--conns", "2", "--rate", "1/s", "--burst", "2", "--cost", "1")
	if code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	for _, k := range []string{"decisions_per_sec", "p50_ms", "p99_ms", "admitted", "denied", "nats_decisions_per_sec",
		"nats_p50_ms", "nats_p99_ms", "nats_admitted", "nats_denied", "ratio", "cpu_us_per_decision"} {
		num(t, m, k)
	}
	if m["mode"] != "rls" || m["policy_mode"] != "strict" || !strings.HasPrefix(m["target"].(string), "127.0.0.1:") {
		t.Errorf("mode, policy_mode, target: %v, %v, %v", m["mode"], m["policy_mode"], m["target"])
	}
	if num(t, m, "denied") == 0 || num(t, m, "nats_denied") == 0 {
		t.Errorf("50 keys at 1/s, burst 2: no denials in a phase (rls %v, nats %v)", m["denied"], m["nats_denied"])
	}
	if num(t, m, "errors") != 0 || num(t, m, "nats_errors") != 0 || num(t, m, "overshoot") != 0 {
		t.Errorf("errors %v, nats errors %v, overshoot %v: want 0", m["errors"], m["nats_errors"], m["overshoot"])
	}
	for _, want := range []string{"ShouldRateLimit (gRPC)", "decide over NATS", "ratio rls/nats:", "overshoot: 0 units"} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q:\n%s", want, out)
		}
	}
}

// TestBenchRLSAgainstServe: with --nats-url and --rls host:port, bench puts
// its policy into the deployment and loads the deployment's bridge (serve
// --envoy-listen) and its decide service; without a node to put the policy
// into (--rls-compare=false and no --nats-url) a server with no limit for
// the bench's descriptors is reported before the run.
func TestBenchRLSAgainstServe(t *testing.T) {
	natsAddr, httpAddr, envoyAddr := freeAddr(t), freeAddr(t), freeAddr(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var serveErr syncBuffer
	exit := make(chan int, 1)
	go func() {
		exit <- Main(ctx, []string{"serve", "--data", t.TempDir(), "--http", httpAddr, "--nats-listen", natsAddr, "--envoy-listen", envoyAddr},
			nil, strings.NewReader(""), &bytes.Buffer{}, &serveErr)
	}()
	waitFor(t, "/readyz", func() bool { code, err := httpGet("http://" + httpAddr + "/readyz"); return err == nil && code == 200 })

	code, m, out, errOut := benchJSON(t, "--nats-url", "nats://"+natsAddr, "--rls", envoyAddr, "--duration", "300ms", "--rounds", "1",
		"--keys", "20", "--concurrency", "4", "--conns", "1")
	if code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	if m["target"] != envoyAddr || num(t, m, "decisions_per_sec") <= 0 || num(t, m, "nats_decisions_per_sec") <= 0 || num(t, m, "ratio") <= 0 {
		t.Errorf("target %v, rls %v/s, nats %v/s, ratio %v", m["target"], m["decisions_per_sec"], m["nats_decisions_per_sec"], m["ratio"])
	}

	code, _, errOut = run(t, nil, "bench", "--rls", envoyAddr, "--rls-compare=false", "--duration", "100ms", "--quiet")
	if code != 1 || !strings.Contains(errOut, "no limit applies to domain limitmesh-bench") {
		t.Errorf("no bench policy: exit %d, stderr %q", code, errOut)
	}

	cancel()
	select {
	case code := <-exit:
		if code != 0 {
			t.Fatalf("serve exited %d; stderr:\n%s", code, serveErr.String())
		}
	case <-time.After(20 * time.Second):
		t.Fatal("serve did not stop")
	}
}

func TestBenchRLSBadFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--rls", "nowhere"}, `--rls "nowhere": want host:port or "embedded"`},
		{[]string{"--rls", "embedded", "--nats-url", "nats://127.0.0.1:1"}, "--rls embedded is the embedded node's bridge"},
		{[]string{"--rls", "embedded", "--mode", "leased"}, "--mode leased is not for it"},
		{[]string{"--rls", "embedded", "--cost", "1.5"}, "a whole number"},
		{[]string{"--rls", "embedded", "--candidates", "2"}, "--candidates and --flood are not for --rls"},
	} {
		code, _, errOut := run(t, nil, append([]string{"bench"}, tc.args...)...)
		if code != 2 || !strings.Contains(errOut, tc.want) {
			t.Errorf("bench %v: exit %d, stderr %q; want 2 and %q", tc.args, code, errOut, tc.want)
		}
	}
}
