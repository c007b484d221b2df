package cli

import (
	"bytes"
	"context"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/limitmesh/limitmesh/mesh/envoy"
)

// TestServeEnvoy runs `limitmesh serve` with LIMITMESH_ENVOY_LISTEN (the
// variable of --envoy-listen): the Envoy rate limit service answers with
// the policy put through the CLI, its health is SERVING, its metrics are
// on /metrics beside the node's, and serve stops with exit 0.
func TestServeEnvoy(t *testing.T) {
	natsAddr, httpAddr, envoyAddr := freeAddr(t), freeAddr(t), freeAddr(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var serveErr syncBuffer
	exit := make(chan int, 1)
	go func() {
		exit <- Main(ctx, []string{"serve", "--data", t.TempDir(), "--http", httpAddr, "--nats-listen", natsAddr},
			[]string{"LIMITMESH_ENVOY_LISTEN=" + envoyAddr}, strings.NewReader(""), &bytes.Buffer{}, &serveErr)
	}()
	waitFor(t, "/readyz", func() bool { code, err := httpGet("http://" + httpAddr + "/readyz"); return err == nil && code == 200 })
	if !strings.Contains(serveErr.String(), "envoy rate limit service serving") {
		t.Errorf("no serving line for the Envoy service:\n%s", serveErr.String())
	}

	env := []string{"LIMITMESH_NATS_URL=nats://" + natsAddr}
	policy := filepath.Join(t.TempDir(), "p.json")
	os.WriteFile(policy, []byte(`{"match":{"domain":"edge","generic_key":"*"},"limits":[{"algorithm":"token_bucket","rate":"1/h","burst":5}]}`), 0o644)
	if code, out, errs := run(t, env, "policy", "put", "edge", policy); code != 0 {
		t.Fatalf("policy put: exit %d %q %q", code, out, errs)
	}

	conn, err := grpc.NewClient(envoyAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	rls := rlsv3.NewRateLimitServiceClient(conn)
	rctx, rcancel := context.WithTimeout(ctx, 20*time.Second)
	defer rcancel()
	req := &rlsv3.RateLimitRequest{Domain: "edge", Descriptors: []*ratelimitv3.RateLimitDescriptor{
		{Entries: []*ratelimitv3.RateLimitDescriptor_Entry{{Key: "generic_key", Value: "a"}}}}}
	waitFor(t, "a decision under the policy", func() bool {
		r, err := rls.ShouldRateLimit(rctx, req)
		return err == nil && r.Statuses[0].CurrentLimit.GetName() == "edge"
	})
	h, err := healthpb.NewHealthClient(conn).Check(rctx, &healthpb.HealthCheckRequest{Service: envoy.ServiceName})
	if err != nil || h.Status != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health: %v, %v", h, err)
	}

	resp, err := http.Get("http://" + httpAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	var metrics bytes.Buffer
	metrics.ReadFrom(resp.Body)
	resp.Body.Close()
	for _, want := range []string{`limitmesh_envoy_requests_total{code="ok"}`, `limitmesh_decisions_total{policy="edge",result="allowed"}`} {
		if !strings.Contains(metrics.String(), want) {
			t.Errorf("metrics lack %s", want)
		}
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
	if _, err := net.DialTimeout("tcp", envoyAddr, time.Second); err == nil {
		t.Error("the Envoy port still accepts connections after serve returned")
	}
}

// TestServeEnvoyBadFlags: a malformed --envoy-listen, one with a node that
// does not decide, and a port already taken each fail with one line.
func TestServeEnvoyBadFlags(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	for _, tc := range []struct {
		name string
		env  []string
		args []string
		code int
		want string
	}{
		{"no port", nil, []string{"--envoy-listen", "localhost"}, 2, `--envoy-listen "localhost": want host:port`},
		{"bad port", []string{"LIMITMESH_ENVOY_LISTEN=127.0.0.1:99999"}, nil, 2, `--envoy-listen "127.0.0.1:99999"`},
		{"no decide role", nil, []string{"--envoy-listen", "127.0.0.1:0", "--roles", "ledger"}, 2, "--envoy-listen needs the decide role"},
		{"port taken", nil, []string{"--envoy-listen", taken.Addr().String(), "--http", "127.0.0.1:0"}, 1, "--envoy-listen " + taken.Addr().String()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, _, stderr := run(t, tc.env, append([]string{"serve", "--data", t.TempDir()}, tc.args...)...)
			if code != tc.code {
				t.Fatalf("exit %d, want %d; stderr: %s", code, tc.code, stderr)
			}
			if !strings.Contains(stderr, tc.want) || strings.Count(stderr, "\n") != 1 {
				t.Errorf("stderr %q: want one line mentioning %q", stderr, tc.want)
			}
		})
	}
}
