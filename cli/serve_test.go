package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
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

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/limitmesh/limitmesh/internal/jstest"
	"github.com/limitmesh/limitmesh/mesh"
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
	jstest.Eventually(t, 15*time.Second, what, cond)
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

// TestServeRegionFlags: --region, --gateway-listen and --gateways (and
// their LIMITMESH_* variables) settle the region, the cluster name and
// the gateway map: the region names the cluster unless --cluster-name is
// given, and a flag wins over its variable.
func TestServeRegionFlags(t *testing.T) {
	cases := []struct {
		name           string
		env, args      []string
		region, clustr string
		gateways       map[string][]string
	}{
		{"defaults", nil, nil, "default", "limitmesh", nil},
		{"region names the cluster", nil, []string{"--region", "eu"}, "eu", "eu", nil},
		{"region from the environment", []string{"LIMITMESH_REGION=us"}, nil, "us", "us", nil},
		{"flag wins over variable", []string{"LIMITMESH_REGION=us"}, []string{"--region", "eu"}, "eu", "eu", nil},
		{"cluster name alone", nil, []string{"--cluster-name", "lm"}, "default", "lm", nil},
		{"both, equal", nil, []string{"--cluster-name", "eu", "--region", "eu"}, "eu", "eu", nil},
		{"gateways from the environment",
			[]string{"LIMITMESH_GATEWAY_LISTEN=127.0.0.1:7222",
				"LIMITMESH_GATEWAYS=eu=nats://10.0.0.1:7222, us=nats://10.1.0.1:7222,us=nats://10.1.0.2:7222"},
			[]string{"--region", "eu", "--cluster-listen", "127.0.0.1:6222"},
			"eu", "eu", map[string][]string{
				"eu": {"nats://10.0.0.1:7222"},
				"us": {"nats://10.1.0.1:7222", "nats://10.1.0.2:7222"},
			}},
		{"gateway listen without remotes", nil,
			[]string{"--region", "us", "--cluster-listen", "127.0.0.1:6222", "--gateway-listen", "0.0.0.0:7222"},
			"us", "us", map[string][]string{}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := stdio{err: new(bytes.Buffer), env: parseEnv(tc.env)}
			c, parse := serveFlags(s)
			if err := parse(tc.args); err != nil {
				t.Fatalf("parse: %v (%s)", err, s.err)
			}
			if c.region != tc.region || c.clusterName != tc.clustr {
				t.Errorf("region %q, cluster %q; want %q, %q", c.region, c.clusterName, tc.region, tc.clustr)
			}
			if fmt.Sprint(c.gatewayURLs) != fmt.Sprint(tc.gateways) {
				t.Errorf("gateways %v, want %v", c.gatewayURLs, tc.gateways)
			}
		})
	}
}

// TestServeRegionBadFlags: invalid region and gateway settings exit 2 with
// one line naming the flag.
func TestServeRegionBadFlags(t *testing.T) {
	gw := []string{"serve", "--region", "eu", "--cluster-listen", "127.0.0.1:6222", "--gateway-listen", "127.0.0.1:7222"}
	cases := []struct {
		name string
		env  []string
		args []string
		want string
	}{
		{"bad region", nil, []string{"serve", "--region", "EU West"}, "--region"},
		{"bad region from env", []string{"LIMITMESH_REGION=eu.west"}, []string{"serve"}, "--region"},
		{"cluster name and region differ", nil, []string{"serve", "--cluster-name", "lm", "--region", "eu"}, "differ"},
		{"gateway listen without port", nil, []string{"serve", "--region", "eu", "--cluster-listen", "127.0.0.1:6222", "--gateway-listen", "127.0.0.1"}, "--gateway-listen"},
		{"gateway listen port 0", nil, []string{"serve", "--region", "eu", "--cluster-listen", "127.0.0.1:6222", "--gateway-listen", "127.0.0.1:0"}, "--gateway-listen"},
		{"gateway without a cluster", nil, []string{"serve", "--region", "eu", "--gateway-listen", "127.0.0.1:7222"}, "needs --cluster-listen"},
		{"gateway without a region", nil, []string{"serve", "--cluster-listen", "127.0.0.1:6222", "--gateway-listen", "127.0.0.1:7222"}, "needs --region"},
		{"gateways without a listener", nil, []string{"serve", "--region", "eu", "--gateways", "us=nats://h:7222"}, "--gateways needs --gateway-listen"},
		{"gateway with url", nil, []string{"serve", "--nats-url", "nats://x:1", "--gateway-listen", "127.0.0.1:7222"}, "--gateway-listen"},
		{"entry without name", nil, append(gw, "--gateways", "nats://h:7222"), "--gateways entry"},
		{"entry with empty name", nil, append(gw, "--gateways", "=nats://h:7222"), "--gateways entry"},
		{"entry with bad name", nil, append(gw, "--gateways", "U.S=nats://h:7222"), "--gateways entry"},
		{"entry without URL", nil, append(gw, "--gateways", "us="), "--gateways entry"},
		{"entry with another scheme", nil, append(gw, "--gateways", "us=http://h:7222"), "--gateways entry"},
		{"entry without port", nil, append(gw, "--gateways", "us=nats://h"), "--gateways entry"},
		{"entry with port out of range", nil, append(gw, "--gateways", "us=nats://h:99999"), "--gateways entry"},
		{"bad entry from env", []string{"LIMITMESH_GATEWAYS=us=nats://h:1,us"}, gw, "--gateways entry"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			code, _, stderr := run(t, tc.env, tc.args...)
			if code != 2 {
				t.Fatalf("exit %d, want 2; stderr: %s", code, stderr)
			}
			if !strings.Contains(stderr, tc.want) || strings.Count(stderr, "\n") != 1 {
				t.Errorf("stderr %q: want one line mentioning %q", stderr, tc.want)
			}
		})
	}
}

// TestServeTwoRegions runs two `limitmesh serve` nodes, each with its own
// embedded server forming a one-server region (eu and us) joined by
// gateways, both given the same --gateways list: a policy put through eu
// applies in us, and decisions through either region's server spend the
// same global burst.
func TestServeTwoRegions(t *testing.T) {
	if testing.Short() {
		t.Skip("supercluster test")
	}
	regions := []string{"eu", "us"}
	natsAddr, httpAddr, route, gw := map[string]string{}, map[string]string{}, map[string]string{}, map[string]string{}
	var gateways []string
	for _, r := range regions {
		natsAddr[r], httpAddr[r], route[r], gw[r] = freeAddr(t), freeAddr(t), freeAddr(t), freeAddr(t)
		gateways = append(gateways, r+"=nats://"+gw[r])
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	exits := map[string]chan int{}
	stderrs := map[string]*syncBuffer{}
	for _, r := range regions {
		exits[r], stderrs[r] = make(chan int, 1), &syncBuffer{}
		args := []string{"serve", "--data", t.TempDir(), "--nats-listen", natsAddr[r], "--http", httpAddr[r],
			"--server-name", r + "-1", "--cluster-listen", route[r], "--routes", "nats://" + route[r],
			"--gateway-listen", gw[r]}
		env := []string{"LIMITMESH_REGION=" + r, "LIMITMESH_GATEWAYS=" + strings.Join(gateways, ",")}
		go func() {
			exits[r] <- Main(ctx, args, env, strings.NewReader(""), &bytes.Buffer{}, stderrs[r])
		}()
	}
	for _, r := range regions {
		deadline := time.Now().Add(60 * time.Second)
		for {
			resp, err := httpGet("http://" + httpAddr[r] + "/readyz")
			if err == nil && resp == 200 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s not ready; stderr:\n%s", r, stderrs[r].String())
			}
			time.Sleep(50 * time.Millisecond)
		}
		if !strings.Contains(stderrs[r].String(), "region="+r) {
			t.Errorf("%s: the serving log line does not name the region:\n%s", r, stderrs[r].String())
		}
	}
	// One JetStream across the regions: both servers see the same policy
	// bucket, placed in one region.
	leaders := map[string]string{}
	for _, r := range regions {
		nc, err := nats.Connect("nats://" + natsAddr[r])
		if err != nil {
			t.Fatal(err)
		}
		js, _ := jetstream.New(nc)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		st, err := js.Stream(ctx, "KV_rl_policies")
		if err != nil {
			t.Fatalf("%s: %v", r, err)
		}
		info, err := st.Info(ctx)
		cancel()
		nc.Close()
		if err != nil || info.Cluster == nil {
			t.Fatalf("%s: stream info %v %+v", r, err, info)
		}
		leaders[r] = info.Cluster.Name + "/" + info.Cluster.Leader
	}
	if leaders["eu"] != leaders["us"] {
		t.Fatalf("the regions see different policy buckets: %v", leaders)
	}
	t.Logf("the policy bucket lives at %s", leaders["eu"])
	envOf := func(r string) []string { return []string{"LIMITMESH_NATS_URL=nats://" + natsAddr[r]} }
	policy := filepath.Join(t.TempDir(), "acme.json")
	os.WriteFile(policy, []byte(`{"match":{"tenant":"acme"},"limits":[{"algorithm":"token_bucket","rate":"1/h","burst":2}]}`), 0o644)
	if code, out, errs := run(t, envOf("eu"), "policy", "put", "acme", policy); code != 0 {
		t.Fatalf("policy put through eu: exit %d %q %q", code, out, errs)
	}
	decide := func(r string, dry bool) map[string]any {
		t.Helper()
		args := []string{"decide", "-d", "tenant=acme"}
		if dry {
			args = append(args, "--dry-run")
		}
		code, out, errs := run(t, envOf(r), args...)
		if code != 0 {
			t.Fatalf("decide through %s: exit %d %q %q", r, code, out, errs)
		}
		var reply map[string]any
		if err := json.Unmarshal([]byte(out), &reply); err != nil {
			t.Fatalf("decide printed %q: %v", out, err)
		}
		return reply
	}
	for _, r := range regions {
		waitFor(t, "the policy applies through "+r, func() bool { return decide(r, true)["policy"] == "acme" })
	}
	admitted := 0
	for _, r := range []string{"us", "eu", "us", "eu"} {
		if decide(r, false)["allowed"] == true {
			admitted++
		}
	}
	if admitted != 2 {
		t.Fatalf("4 decisions through both regions admitted %d, want the burst of 2", admitted)
	}
	cancel()
	for _, r := range regions {
		select {
		case code := <-exits[r]:
			if code != 0 {
				t.Fatalf("%s exited %d; stderr:\n%s", r, code, stderrs[r].String())
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("%s did not stop", r)
		}
	}
}

// httpGet returns the status code of a GET.
func httpGet(url string) (int, error) {
	resp, err := http.Get(url)
	if err != nil {
		return 0, err
	}
	resp.Body.Close()
	return resp.StatusCode, nil
}

// TestServeUsageFlags: --usage, --usage-interval, --usage-retention and
// --usage-max-bytes, their defaults, their LIMITMESH_* variables (a flag
// wins) and the sizes --usage-max-bytes takes.
func TestServeUsageFlags(t *testing.T) {
	cases := []struct {
		name      string
		env, args []string
		usage     bool
		interval  time.Duration
		retention time.Duration
		maxBytes  int64
	}{
		{"defaults", nil, nil, true, 250 * time.Millisecond, 24 * time.Hour, 1 << 30},
		{"off", nil, []string{"--usage=false"}, false, 250 * time.Millisecond, 24 * time.Hour, 1 << 30},
		{"off from the environment", []string{"LIMITMESH_USAGE=false"}, nil, false, 250 * time.Millisecond, 24 * time.Hour, 1 << 30},
		{"flag wins", []string{"LIMITMESH_USAGE=false", "LIMITMESH_USAGE_INTERVAL=1s"},
			[]string{"--usage", "--usage-interval", "100ms"}, true, 100 * time.Millisecond, 24 * time.Hour, 1 << 30},
		{"environment", []string{"LIMITMESH_USAGE_INTERVAL=50ms", "LIMITMESH_USAGE_RETENTION=2h", "LIMITMESH_USAGE_MAX_BYTES=512MiB"},
			nil, true, 50 * time.Millisecond, 2 * time.Hour, 512 << 20},
		{"bytes", nil, []string{"--usage-max-bytes", "1048576"}, true, 250 * time.Millisecond, 24 * time.Hour, 1 << 20},
		{"decimal unit", nil, []string{"--usage-max-bytes", "2GB"}, true, 250 * time.Millisecond, 24 * time.Hour, 2e9},
		{"unit after a space", nil, []string{"--usage-max-bytes", "3 GiB"}, true, 250 * time.Millisecond, 24 * time.Hour, 3 << 30},
		{"TiB", nil, []string{"--usage-max-bytes", "1TiB", "--usage-retention", "720h"}, true, 250 * time.Millisecond, 720 * time.Hour, 1 << 40},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := stdio{err: new(bytes.Buffer), env: parseEnv(tc.env)}
			c, parse := serveFlags(s)
			if err := parse(tc.args); err != nil {
				t.Fatalf("parse: %v (%s)", err, s.err)
			}
			if c.usage != tc.usage || c.usageInterval != tc.interval || c.usageRetention != tc.retention || int64(c.usageMaxBytes) != tc.maxBytes {
				t.Errorf("usage %v interval %v retention %v max bytes %d; want %v %v %v %d",
					c.usage, c.usageInterval, c.usageRetention, c.usageMaxBytes, tc.usage, tc.interval, tc.retention, tc.maxBytes)
			}
		})
	}
	// The default prints as a size.
	var help bytes.Buffer
	Main(context.Background(), []string{"serve", "-h"}, nil, strings.NewReader(""), &help, &help)
	if !strings.Contains(help.String(), "-usage-max-bytes") || !strings.Contains(help.String(), "(default 1GiB)") {
		t.Errorf("serve -h does not show --usage-max-bytes with its default 1GiB:\n%s", help.String())
	}
}

// TestServeUsageBadFlags: invalid usage settings exit 2 with one line
// naming the flag or its variable.
func TestServeUsageBadFlags(t *testing.T) {
	cases := []struct {
		name string
		env  []string
		args []string
		want string
	}{
		{"interval zero", nil, []string{"--usage-interval", "0s"}, "--usage-interval"},
		{"interval too long", nil, []string{"--usage-interval", "2m"}, "--usage-interval"},
		{"retention too short", nil, []string{"--usage-retention", "30s"}, "--usage-retention"},
		{"max bytes too small", nil, []string{"--usage-max-bytes", "64KiB"}, "--usage-max-bytes"},
		{"max bytes not a size", nil, []string{"--usage-max-bytes", "lots"}, "usage-max-bytes"},
		{"max bytes negative", nil, []string{"--usage-max-bytes", "-1"}, "usage-max-bytes"},
		{"max bytes fraction", nil, []string{"--usage-max-bytes", "1.5GiB"}, "usage-max-bytes"},
		{"max bytes overflow", nil, []string{"--usage-max-bytes", "9000000TiB"}, "usage-max-bytes"},
		{"bad size from env", []string{"LIMITMESH_USAGE_MAX_BYTES=1 gigabyte"}, nil, "LIMITMESH_USAGE_MAX_BYTES"},
		{"bad bool from env", []string{"LIMITMESH_USAGE=maybe"}, nil, "LIMITMESH_USAGE"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			code, _, stderr := run(t, tc.env, append([]string{"serve"}, tc.args...)...)
			if code != 2 {
				t.Fatalf("exit %d, want 2; stderr: %s", code, stderr)
			}
			if !strings.Contains(stderr, tc.want) {
				t.Errorf("stderr %q: want it to mention %q", stderr, tc.want)
			}
		})
	}
}

// TestServeUsageStream: the stream a node creates has --usage-retention
// and --usage-max-bytes (here from the environment), and --usage=false
// creates none.
func TestServeUsageStream(t *testing.T) {
	if testing.Short() {
		t.Skip("two serve runs")
	}
	for _, on := range []bool{true, false} {
		natsAddr, httpAddr := freeAddr(t), freeAddr(t)
		ctx, cancel := context.WithCancel(context.Background())
		var serveErr syncBuffer
		exit := make(chan int, 1)
		go func() {
			exit <- Main(ctx, []string{"serve", "--data", t.TempDir(), "--http", httpAddr, "--nats-listen", natsAddr,
				"--usage-retention", "90m", fmt.Sprintf("--usage=%v", on)},
				[]string{"LIMITMESH_USAGE_MAX_BYTES=512MiB", "LIMITMESH_USAGE_INTERVAL=100ms"},
				strings.NewReader(""), &bytes.Buffer{}, &serveErr)
		}()
		waitFor(t, "/readyz", func() bool { code, err := httpGet("http://" + httpAddr + "/readyz"); return err == nil && code == 200 })
		nc, err := nats.Connect("nats://" + natsAddr)
		if err != nil {
			t.Fatal(err)
		}
		js, _ := jetstream.New(nc)
		sctx, scancel := context.WithTimeout(context.Background(), 10*time.Second)
		st, err := js.Stream(sctx, "RL_USAGE")
		if on {
			if err != nil {
				t.Fatalf("--usage: stream RL_USAGE: %v", err)
			}
			info := st.CachedInfo()
			if info.Config.MaxAge != 90*time.Minute || info.Config.MaxBytes != 512<<20 {
				t.Errorf("RL_USAGE max age %v max bytes %d, want 1h30m and 512MiB", info.Config.MaxAge, info.Config.MaxBytes)
			}
			if _, err := js.KeyValue(sctx, "rl_ledger"); err != nil {
				t.Errorf("--usage: ledger bucket: %v", err)
			}
		} else if !errors.Is(err, jetstream.ErrStreamNotFound) {
			t.Errorf("--usage=false: stream RL_USAGE: %v, want not found", err)
		}
		scancel()
		nc.Close()
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
}

// TestServeRolesFlags: --roles (and LIMITMESH_ROLES; a flag wins) names
// the node's roles in any order, with spaces and repeats; the default is
// every role, also with --usage=false (ledger and shadow then idle).
func TestServeRolesFlags(t *testing.T) {
	cases := []struct {
		name      string
		env, args []string
		want      mesh.Roles
	}{
		{"default", nil, nil, mesh.AllRoles},
		{"default without usage", nil, []string{"--usage=false"}, mesh.AllRoles},
		{"decide only", nil, []string{"--roles", "decide"}, mesh.RoleDecide},
		{"ledger and shadow", nil, []string{"--roles", "ledger,shadow"}, mesh.RoleLedger | mesh.RoleShadow},
		{"any order, spaces, repeats", nil, []string{"--roles", " shadow, decide ,shadow"}, mesh.RoleDecide | mesh.RoleShadow},
		{"decide without usage", nil, []string{"--roles", "decide", "--usage=false"}, mesh.RoleDecide},
		{"environment", []string{"LIMITMESH_ROLES=ledger"}, nil, mesh.RoleLedger},
		{"flag wins", []string{"LIMITMESH_ROLES=ledger"}, []string{"--roles", "decide,shadow"}, mesh.RoleDecide | mesh.RoleShadow},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := stdio{err: new(bytes.Buffer), env: parseEnv(tc.env)}
			c, parse := serveFlags(s)
			if err := parse(tc.args); err != nil {
				t.Fatalf("parse: %v (%s)", err, s.err)
			}
			if c.roleSet != tc.want {
				t.Errorf("roles %q, want %q", c.roleSet, tc.want)
			}
		})
	}
	var help bytes.Buffer
	Main(context.Background(), []string{"serve", "-h"}, nil, strings.NewReader(""), &help, &help)
	if !strings.Contains(help.String(), "-roles") || !strings.Contains(help.String(), `(default "decide,ledger,shadow")`) {
		t.Errorf("serve -h does not show --roles with its default:\n%s", help.String())
	}
}

// TestServeRolesBadFlags: an unknown role, a list naming no role, and
// ledger or shadow named with --usage=false exit 2 with one line naming
// --roles.
func TestServeRolesBadFlags(t *testing.T) {
	cases := []struct {
		name string
		env  []string
		args []string
		want string
	}{
		{"unknown role", nil, []string{"--roles", "decide,leader"}, `--roles "decide,leader": want one or more of decide, ledger and shadow`},
		{"capitalised", nil, []string{"--roles", "Decide"}, `--roles "Decide"`},
		{"empty", nil, []string{"--roles", ""}, `--roles "": want one or more`},
		{"only commas", nil, []string{"--roles", ", ,"}, `--roles ", ,": want one or more`},
		{"unknown from env", []string{"LIMITMESH_ROLES=all"}, nil, `--roles "all"`},
		{"empty from env", []string{"LIMITMESH_ROLES="}, nil, `--roles ""`},
		{"ledger without usage", nil, []string{"--roles", "ledger", "--usage=false"}, "--usage=false"},
		{"shadow without usage", nil, []string{"--roles", "decide,shadow", "--usage=false"}, "--usage=false"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			code, _, stderr := run(t, tc.env, append([]string{"serve"}, tc.args...)...)
			if code != 2 {
				t.Fatalf("exit %d, want 2; stderr: %s", code, stderr)
			}
			if !strings.Contains(stderr, tc.want) || strings.Count(stderr, "\n") != 1 {
				t.Errorf("stderr %q: want one line mentioning %q", stderr, tc.want)
			}
		})
	}
}
