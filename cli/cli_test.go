package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// run runs the command in-process and returns its exit code and output.
func run(t *testing.T, env []string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	code = Main(context.Background(), args, env, strings.NewReader(""), &out, &errb)
	return code, out.String(), errb.String()
}

func TestEnvName(t *testing.T) {
	for flag, want := range map[string]string{
		"nats-url":         "LIMITMESH_NATS_URL",
		"http":             "LIMITMESH_HTTP",
		"decision-timeout": "LIMITMESH_DECISION_TIMEOUT",
	} {
		if got := EnvName(flag); got != want {
			t.Errorf("EnvName(%q) = %q, want %q", flag, got, want)
		}
	}
}

func TestServeFlagsFromEnvironment(t *testing.T) {
	s := stdio{err: new(bytes.Buffer), env: parseEnv([]string{
		"LIMITMESH_NATS_URL=nats://example:4222",
		"LIMITMESH_DECISION_TIMEOUT=250ms",
		"LIMITMESH_REPLICAS=3",
		"LIMITMESH_PREFIX=fromenv",
		"LIMITMESH_CHECKPOINT_INTERVAL=2s",
		"LIMITMESH_JOURNAL=false",
		"LIMITMESH_ASYNC_INTERVAL=250ms",
	})}
	c, parse := serveFlags(s)
	if err := parse([]string{"--prefix", "fromflag"}); err != nil {
		t.Fatal(err)
	}
	if c.natsURL != "nats://example:4222" || c.decisionTimeout.String() != "250ms" || c.replicas != 3 ||
		c.checkpoint.String() != "2s" || c.journal || c.asyncInterval.String() != "250ms" {
		t.Errorf("environment not applied: %+v", c)
	}
	if c.prefix != "fromflag" {
		t.Errorf("prefix = %q: the flag must win over LIMITMESH_PREFIX", c.prefix)
	}
}

func TestServeBadFlagsExitNonZeroWithOneLine(t *testing.T) {
	cases := []struct {
		name string
		env  []string
		args []string
		want string
	}{
		{"unknown flag", nil, []string{"serve", "--bogus"}, "flag provided but not defined"},
		{"bad duration", nil, []string{"serve", "--decision-timeout", "soon"}, "invalid value"},
		{"bad env", []string{"LIMITMESH_REPLICAS=many"}, []string{"serve"}, "LIMITMESH_REPLICAS"},
		{"bad prefix", nil, []string{"serve", "--prefix", "Bad.Prefix"}, "--prefix"},
		{"zero timeout", nil, []string{"serve", "--decision-timeout", "0s"}, "--decision-timeout"},
		{"zero checkpoint interval", nil, []string{"serve", "--checkpoint-interval", "0s"}, "--checkpoint-interval"},
		{"zero async interval", nil, []string{"serve", "--async-interval", "0s"}, "--async-interval"},
		{"huge async interval", nil, []string{"serve", "--async-interval", "2m"}, "--async-interval"},
		{"cluster with url", nil, []string{"serve", "--nats-url", "nats://x:1", "--routes", "nats://y:2"}, "--routes"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			code, _, stderr := run(t, tc.env, tc.args...)
			if code == 0 {
				t.Fatalf("exit 0, want non-zero; stderr: %s", stderr)
			}
			if !strings.Contains(stderr, tc.want) {
				t.Errorf("stderr %q does not mention %q", stderr, tc.want)
			}
		})
	}
}

func TestServeUnreachableNATS(t *testing.T) {
	code, _, stderr := run(t, nil, "serve", "--nats-url", "nats://127.0.0.1:1", "--http", "127.0.0.1:0")
	if code != 1 {
		t.Fatalf("exit %d, want 1; stderr: %s", code, stderr)
	}
	lines := strings.Split(strings.TrimSpace(stderr), "\n")
	if len(lines) != 1 || !strings.Contains(lines[0], "cannot connect to NATS at nats://127.0.0.1:1") {
		t.Errorf("want one clear line, got %q", stderr)
	}
}

func TestUnknownCommand(t *testing.T) {
	if code, _, stderr := run(t, nil, "frobnicate"); code != 2 || !strings.Contains(stderr, `unknown command "frobnicate"`) {
		t.Errorf("exit %d, stderr %q", code, stderr)
	}
}

func TestBuildDecideBody(t *testing.T) {
	body, err := buildDecideBody("", []string{"tenant=acme", "operation=search", "plan=v7"}, "2.5", "r1", true)
	if err != nil {
		t.Fatal(err)
	}
	var got map[string]any
	if err := json.Unmarshal(body, &got); err != nil {
		t.Fatal(err)
	}
	want := `{"cost":2.5,"descriptor":{"operation":"search","plan":"v7","tenant":"acme"},"dry_run":true,"request_id":"r1"}`
	if b, _ := json.Marshal(got); string(b) != want {
		t.Errorf("body = %s, want %s", b, want)
	}
	// A cost that is not a plain number goes as a string for the node to judge.
	body, _ = buildDecideBody("", []string{"tenant=acme"}, "1e3", "", false)
	if !strings.Contains(string(body), `"cost":"1e3"`) {
		t.Errorf("body = %s", body)
	}
	for _, bad := range [][]string{{"novalue"}, {"=x"}} {
		if _, err := buildDecideBody("", bad, "", "", false); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
	if _, err := buildDecideBody(`{"descriptor":`, nil, "", "", false); err == nil {
		t.Error("invalid --json accepted")
	}
}

func TestInterspersed(t *testing.T) {
	got := strings.Join(interspersed([]string{"NAME", "--revision", "3", "--force", "FILE"}), " ")
	if want := "--revision 3 --force NAME FILE"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
}

func TestPolicyValidate(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "acme-search.json")
	os.WriteFile(good, []byte(`{"match":{"tenant":"acme","operation":"search"},"key":["tenant","operation","plan"],`+
		`"limits":[{"name":"rate","algorithm":"token_bucket","rate":"10/s","burst":40}]}`), 0o644)
	bad := filepath.Join(dir, "bad.json")
	os.WriteFile(bad, []byte(`{"match":{"tenant":"acme"},"limits":[{"algorithm":"token_bucket","rate":"ten per second","burst":40}]}`), 0o644)

	code, out, stderr := run(t, nil, "policy", "validate", good)
	if code != 0 || !strings.Contains(out, "valid: acme-search") {
		t.Errorf("good policy: exit %d, out %q, err %q", code, out, stderr)
	}
	code, _, stderr = run(t, nil, "policy", "validate", bad)
	if code != 1 || !strings.Contains(stderr, `limits[0].rate`) {
		t.Errorf("bad policy: exit %d, stderr %q", code, stderr)
	}
}

// TestDemo runs the Acme story against an embedded node: the global limit
// admits at most its contract and six local buckets admit every request.
func TestDemo(t *testing.T) {
	code, out, stderr := run(t, nil, "demo")
	if code != 0 {
		t.Fatalf("demo: exit %d\n%s\n%s", code, out, stderr)
	}
	for _, want := range []string{
		"80 requests at once over 6 gateway connections",
		"six independent local buckets:        admitted 80, denied  0",
		"6 x 40 = 240",
		"(6 - 1) x 40 = 200",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("demo output lacks %q:\n%s", want, out)
		}
	}
	// The global limit: 40 plus whatever refilled while the burst ran
	// (the demo itself fails when the contract is exceeded).
	if !strings.Contains(out, "one global limit (limitmesh, strict):  admitted 4") {
		t.Errorf("demo output:\n%s", out)
	}
	// The leased story: six SDK gateways in two regions; the admitted count
	// is checked against burst + rate × elapsed + max_outstanding here too
	// (the demo fails beyond it), and the limit binds: 80 at once cannot
	// all be admitted.
	m := regexp.MustCompile(`leased \(grants spent in the gateways\):  admitted +(\d+), denied +(\d+)`).FindStringSubmatch(out)
	if m == nil || !strings.Contains(out, "in 2 region(s) [eu, us]") || !strings.Contains(out, "+ max_outstanding = 40 + 10/s x ") {
		t.Fatalf("demo output lacks the leased story:\n%s", out)
	}
	if admitted, _ := strconv.Atoi(m[1]); admitted < 1 || admitted > 60 || m[2] == "0" {
		t.Errorf("leased: admitted %s, denied %s of 80 at once: want 1..60 admitted (burst 40, bound 20) and denials", m[1], m[2])
	}
}
