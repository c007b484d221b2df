package cli

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh"
)

// benchJSON runs bench with args and returns its exit code, its --json line
// decoded, and its output.
func benchJSON(t *testing.T, args ...string) (int, map[string]any, string, string) {
	t.Helper()
	code, out, errOut := run(t, nil, append([]string{"bench", "--json", "--quiet"}, args...)...)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	var m map[string]any
	if err := json.Unmarshal([]byte(lines[len(lines)-1]), &m); err != nil {
		t.Fatalf("exit %d; last line of stdout is not JSON: %v\nstdout:\n%s\nstderr:\n%s", code, err, out, errOut)
	}
	return code, m, out, errOut
}

// num returns field k of a --json line as a number, failing if absent.
func num(t *testing.T, m map[string]any, k string) float64 {
	t.Helper()
	v, ok := m[k].(float64)
	if !ok {
		t.Fatalf("--json line lacks numeric field %q: %v", k, m)
	}
	return v
}

// checkRun checks what every bench run must report: the contract's fields,
// decisions that add up, an echo baseline and no overshoot in strict mode.
func checkRun(t *testing.T, m map[string]any) {
	t.Helper()
	for _, k := range []string{"decisions_per_sec", "echo_per_sec", "ratio", "p50_ms", "p99_ms",
		"p999_ms", "echo_p50_ms", "echo_p99_ms", "admitted", "denied", "overshoot", "keys", "zipf",
		"concurrency", "duration_s", "errors"} {
		num(t, m, k)
	}
	if m["mode"] != "strict" {
		t.Errorf("mode = %v, want strict", m["mode"])
	}
	admitted, denied, decisions := num(t, m, "admitted"), num(t, m, "denied"), num(t, m, "decisions")
	if admitted+denied != decisions {
		t.Errorf("admitted %v + denied %v != decisions %v", admitted, denied, decisions)
	}
	if admitted <= 0 {
		t.Errorf("admitted = %v, want > 0", admitted)
	}
	if num(t, m, "echo_per_sec") <= 0 || num(t, m, "echo_requests") <= 0 {
		t.Errorf("no echo baseline: %v", m)
	}
	if num(t, m, "unmatched") != 0 {
		t.Errorf("%v decisions were not made with the bench policy", m["unmatched"])
	}
	if o := num(t, m, "overshoot"); o != 0 {
		t.Errorf("strict mode overshoot = %v units on %v keys, want 0", o, m["overshoot_keys"])
	}
	if p50, p99, p999 := num(t, m, "p50_ms"), num(t, m, "p99_ms"), num(t, m, "p999_ms"); p50 <= 0 || p50 > p99 || p99 > p999 {
		t.Errorf("latency percentiles out of order: p50 %v, p99 %v, p999 %v", p50, p99, p999)
	}
}

// TestBenchEmbeddedStrict runs bench against its embedded node with a
// limit far below the load (1/s, burst 2 per key, 50 keys used uniformly,
// so every key is used up): many requests are denied, bench finds no
// overshoot, and the admissions stay within the contract as this test
// measures it itself: at most burst + rate × the command's whole run on
// each key that admitted any.
func TestBenchEmbeddedStrict(t *testing.T) {
	// The run's length on the wall clock, which the node decides with
	// (the monotonic clock's rate may differ while the system clock is
	// slewed).
	start := time.Now().UnixNano()
	heap := filepath.Join(t.TempDir(), "heap.pb.gz")
	code, m, out, errOut := benchJSON(t, "--duration", "300ms", "--echo-duration", "300ms", "--memprofile", heap,
		"--keys", "50", "--zipf", "0", "--concurrency", "8", "--conns", "2", "--rate", "1/s", "--burst", "2")
	wall := time.Duration(time.Now().UnixNano() - start)
	if code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	checkRun(t, m)
	if num(t, m, "keys") != 50 || num(t, m, "concurrency") != 8 || m["rate"] != "1/s" || m["burst"] != "2" {
		t.Errorf("flags not reported: %v", m)
	}
	admitted, denied, keys := num(t, m, "admitted"), num(t, m, "denied"), num(t, m, "keys_admitted")
	if denied == 0 {
		t.Errorf("50 keys at 1/s, burst 2, took every one of %v requests: the limit did not bind", m["decisions"])
	}
	if num(t, m, "errors") != 0 {
		t.Errorf("errors = %v, want 0 against an embedded node", m["errors"])
	}
	if keys < 1 || keys > 50 {
		t.Errorf("keys_admitted = %v, want 1..50", keys)
	}
	if allowed := keys * (2 + 1*wall.Seconds()); admitted > allowed {
		t.Errorf("admitted %v on %v keys within %s, more than (burst 2 + 1/s × %s) per key = %.1f",
			admitted, keys, wall.Round(time.Millisecond), wall.Round(time.Millisecond), allowed)
	}
	for _, want := range []string{"raw NATS echo", "decide", "overshoot: 0 units", "mode strict", "token_bucket 1/s, burst 2 per key", "usage lag: "} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q:\n%s", want, out)
		}
	}
	if lag, pending := num(t, m, "usage_lag_ms"), num(t, m, "usage_pending"); lag < 0 || pending < 0 || (pending == 0) != (lag == 0) {
		t.Errorf("usage_lag_ms %v with %v batches pending: want both 0 or both positive", lag, pending)
	}
	if d, e := num(t, m, "cpu_us_per_decision"), num(t, m, "echo_cpu_us_per_request"); d <= 0 || e <= 0 {
		t.Errorf("cpu_us_per_decision %v, echo_cpu_us_per_request %v: want both positive", d, e)
	}
	if !strings.Contains(out, "µs per decision") {
		t.Errorf("report lacks the CPU line:\n%s", out)
	}
	// The usage stream's cost and the memory.
	if b, h := num(t, m, "usage_bytes_per_decision"), num(t, m, "usage_retention_hours"); b <= 0 || b > 2000 || h <= 0 || h > 24 {
		t.Errorf("usage_bytes_per_decision %v, usage_retention_hours %v: want 0..2000 bytes and 0..24 h", b, h)
	}
	if rss := num(t, m, "rss_peak_mb"); rss <= 0 {
		t.Errorf("rss_peak_mb = %v, want positive", rss)
	}
	for _, want := range []string{"usage stream: ", "usage retention: ", "memory: peak resident "} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q:\n%s", want, out)
		}
	}
	if b, err := os.ReadFile(heap); err != nil || len(b) < 2 || b[0] != 0x1f || b[1] != 0x8b {
		t.Errorf("--memprofile wrote no gzipped profile: %d bytes, %v", len(b), err)
	}
}

// TestBenchUsageOff: --usage=false runs the embedded node without usage
// records; the lag is reported as off (null in --json). With --nats-url
// the flag is refused: it configures the embedded node only.
func TestBenchUsageOff(t *testing.T) {
	code, m, out, errOut := benchJSON(t, "--usage=false", "--duration", "200ms", "--echo-duration", "200ms",
		"--keys", "20", "--concurrency", "4", "--conns", "1")
	if code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	checkRun(t, m)
	if v, ok := m["usage_lag_ms"]; !ok || v != nil {
		t.Errorf("usage_lag_ms = %v (present %v), want null", v, ok)
	}
	if !strings.Contains(out, "usage lag: off (--usage=false)") {
		t.Errorf("report does not say usage is off:\n%s", out)
	}
	if v, ok := m["usage_bytes_per_decision"]; !ok || v != nil {
		t.Errorf("usage_bytes_per_decision = %v (present %v), want null", v, ok)
	}
	if rss := num(t, m, "rss_peak_mb"); rss <= 0 {
		t.Errorf("rss_peak_mb = %v, want positive", rss)
	}
	code, _, errOut = run(t, nil, "bench", "--usage=false", "--nats-url", "nats://127.0.0.1:1")
	if code != 2 || !strings.Contains(errOut, "--usage=false") {
		t.Errorf("--usage=false with --nats-url: exit %d, stderr %q; want 2 naming the flag", code, errOut)
	}
}

// TestBenchRoundsInterleaved runs the phases in 3 alternating rounds: both
// phases measure, the JSON says how many rounds, and the decide phase's
// tallies, kept across its slices with spans crossing the echo slices
// between them, find no overshoot on two keys whose limit is far below the
// load (so the spans and the refill between slices matter).
func TestBenchRoundsInterleaved(t *testing.T) {
	code, m, out, errOut := benchJSON(t, "--rounds", "3", "--duration", "300ms", "--echo-duration", "3600ms",
		"--timeout", "500ms", "--keys", "2", "--zipf", "0", "--concurrency", "8", "--conns", "2",
		"--rate", "100/s", "--burst", "3")
	if code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	checkRun(t, m)
	if num(t, m, "rounds") != 3 {
		t.Errorf("rounds = %v, want 3", m["rounds"])
	}
	if num(t, m, "decisions") <= 0 || num(t, m, "echo_requests") <= 0 {
		t.Errorf("a phase measured nothing: %v", m)
	}
	// --timeout 500ms bounds the phases' time (below); on a busy machine
	// a few requests may take longer than that. Any other error, or more
	// than a few timeouts, fails.
	if e, to := num(t, m, "errors"), num(t, m, "timeouts"); e != to || to > num(t, m, "decisions")/20 {
		t.Errorf("errors %v of which timeouts %v: want only a few timeouts", e, to)
	}
	if e := num(t, m, "echo_errors"); e > num(t, m, "echo_requests")/20 {
		t.Errorf("echo errors %v of %v requests: want only a few (timeouts)", e, m["echo_requests"])
	}
	if num(t, m, "denied") == 0 {
		t.Errorf("two keys at 100/s took every request: %v", m)
	}
	// A phase's time is the sum of its slices': each runs its planned time
	// and then waits for its requests in flight, each of which ends within
	// --timeout. So the decide time is at most 0.3s + 3 × 0.5s = 1.8s
	// however slow the machine, while counting the two 1.2s echo slices
	// between the first and the last decide slice would make it at least
	// 2.7s: the bound between them is not a timing assumption.
	if d := num(t, m, "duration_s"); d < 0.3 || d >= 2.25 {
		t.Errorf("duration_s = %v: want the decide slices' sum, between 0.3s and 1.8s", d)
	}
	if d := num(t, m, "echo_duration_s"); d < 3.6 {
		t.Errorf("echo_duration_s = %v: want at least the 3.6s planned", d)
	}
	if !strings.Contains(out, "interleaved in 3 rounds") {
		t.Errorf("report does not say the rounds:\n%s", out)
	}
}

// TestBenchHotKeyAgainstServe runs bench with --nats-url against a node on
// a TCP listener, with one key and a limit far below the offered load, so
// most requests are denied and the admitted total is checked against the
// contract.
func TestBenchHotKeyAgainstServe(t *testing.T) {
	emb, err := mesh.StartEmbedded(mesh.EmbeddedConfig{Listen: "127.0.0.1:-1", DataDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(emb.Shutdown)
	nc, err := emb.Connect()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	// The node decides on the wall clock, as bench measures its spans
	// (their rates would differ, were one of them monotonic, while the
	// system clock is slewed: on a VM by as much as 0.5% for minutes, and
	// a saturated key at 50/s then looks 0.1 units over).
	node, err := mesh.NewNode(nc, mesh.NodeConfig{Prefix: "hot"})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := node.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = node.Stop(context.Background()) })

	code, m, out, errOut := benchJSON(t, "--nats-url", emb.ClientURL(), "--prefix", "hot",
		"--duration", "400ms", "--echo-duration", "200ms", "--keys", "1", "--concurrency", "8",
		"--rate", "50/s", "--burst", "5", "--cost", "0.5")
	if code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	checkRun(t, m)
	if num(t, m, "denied") == 0 {
		t.Errorf("one key at 50/s took every request: %v", m)
	}
	if num(t, m, "keys_admitted") != 1 {
		t.Errorf("keys_admitted = %v, want 1", m["keys_admitted"])
	}
	// The deployment's usage stream (prefix hot) is measured.
	if lag := num(t, m, "usage_lag_ms"); lag < 0 {
		t.Errorf("usage_lag_ms = %v", lag)
	}

	// The run's policy is gone afterwards.
	code, listed, _ := run(t, nil, "policy", "list", "--nats-url", emb.ClientURL(), "--prefix", "hot")
	if code != 0 || strings.Contains(listed, "bench-") {
		t.Errorf("policy list after bench (exit %d):\n%s", code, listed)
	}
}

// TestBenchModeTheNodeDoesNotImplement runs bench --mode async against a
// deployment whose node does not implement async: it rejects bench's
// policy and answers the run's descriptors as unmatched (here a stand-in
// for such a node on a real NATS server, since this build's node
// implements every mode bench offers). bench exits 1 with one line saying
// so, measures nothing, and removes its policy.
func TestBenchModeTheNodeDoesNotImplement(t *testing.T) {
	emb, err := mesh.StartEmbedded(mesh.EmbeddedConfig{Listen: "127.0.0.1:-1", DataDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(emb.Shutdown)
	nc, err := emb.Connect()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "rl_policies", History: 16})
	if err != nil {
		t.Fatal(err)
	}
	unmatched := []byte(`{"allowed":true,"policy":"","revision":0,"remaining":0,"retry_after_ms":0,"reset_after_ms":0}`)
	var asked atomic.Int64
	if _, err := nc.QueueSubscribe("rl.v1.decide", "limitmesh", func(m *nats.Msg) {
		asked.Add(1)
		_ = m.Respond(unmatched)
	}); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}

	code, out, errOut := run(t, nil, "bench", "--nats-url", emb.ClientURL(), "--mode", "async", "--quiet",
		"--duration", "200ms", "--keys", "5", "--concurrency", "2")
	if code != 1 || !strings.Contains(errOut, "does not seem to implement --mode async") {
		t.Errorf("exit %d, stderr %q: want 1 and a line saying the node does not implement async", code, errOut)
	}
	if strings.Count(strings.TrimSpace(errOut), "\n") != 0 {
		t.Errorf("want one line on stderr, got:\n%s", errOut)
	}
	if out != "" {
		t.Errorf("bench reported a measurement:\n%s", out)
	}
	if asked.Load() == 0 {
		t.Error("bench never asked the node for a decision")
	}
	// The policy bench put was for async, and it is gone again.
	hist, err := kv.History(ctx, ">")
	if err != nil {
		t.Fatalf("policy history: %v", err)
	}
	var put, deleted string
	for _, e := range hist {
		switch e.Operation() {
		case jetstream.KeyValuePut:
			put = e.Key()
			if !strings.Contains(string(e.Value()), `"mode":"async"`) {
				t.Errorf("bench put policy %s without mode async: %s", e.Key(), e.Value())
			}
		case jetstream.KeyValueDelete, jetstream.KeyValuePurge:
			deleted = e.Key()
		}
	}
	if put == "" || !strings.HasPrefix(put, "bench-async-") || deleted != put {
		t.Errorf("policy put %q, deleted %q: want bench-async-<run> put and deleted", put, deleted)
	}
}

// TestBenchNonStrictModes runs bench in async and local mode against its
// embedded node (one node: neither mode may admit beyond the limit there,
// since their bounds count owner failures and other nodes) with a limit far
// below the load: the run reports its mode, decisions that add up, denials
// and no overshoot.
func TestBenchNonStrictModes(t *testing.T) {
	for _, mode := range []string{"async", "local"} {
		t.Run(mode, func(t *testing.T) {
			code, m, out, errOut := benchJSON(t, "--mode", mode, "--duration", "300ms", "--echo-duration", "300ms",
				"--keys", "20", "--concurrency", "8", "--conns", "2", "--rate", "1/s", "--burst", "2")
			if code != 0 {
				t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
			}
			if m["mode"] != mode {
				t.Errorf("mode = %v, want %s", m["mode"], mode)
			}
			admitted, denied, decisions := num(t, m, "admitted"), num(t, m, "denied"), num(t, m, "decisions")
			if admitted <= 0 || denied <= 0 || admitted+denied != decisions {
				t.Errorf("admitted %v, denied %v, decisions %v: want both and a sum", admitted, denied, decisions)
			}
			if num(t, m, "errors") != 0 || num(t, m, "unmatched") != 0 {
				t.Errorf("errors %v, unmatched %v: want 0", m["errors"], m["unmatched"])
			}
			if o := num(t, m, "overshoot"); o != 0 {
				t.Errorf("%s mode on one node: overshoot %v units on %v keys, want 0", mode, o, m["overshoot_keys"])
			}
			if want := "limitmesh bench: mode " + mode; !strings.Contains(out, want) || !strings.Contains(out, "policy bench-"+mode+"-") {
				t.Errorf("report lacks %q or the policy name:\n%s", want, out)
			}
		})
	}
}

func TestBenchBadFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--mode", "eventual"},
		{"--zipf", "-1"},
		{"--keys", "0"},
		{"--concurrency", "0"},
		{"--conns", "0"},
		{"--duration", "0s"},
		{"--rounds", "5", "--duration", "4ms"}, // slices under 1ms
		{"--cost", "0"},
		{"--cost", "1e3"},
		{"--prefix", "Bad.Prefix"},
		{"--roles", "ledger,shadow"},
		{"--roles", "decide,judge"},
		{"extra"},
	} {
		code, _, errOut := run(t, nil, append([]string{"bench"}, args...)...)
		if code != 2 || errOut == "" {
			t.Errorf("bench %v: exit %d, stderr %q; want 2 and a message", args, code, errOut)
		}
	}
	// A limit the policy parser rejects is reported with its flag.
	code, _, errOut := run(t, nil, "bench", "--rate", "ten per second")
	if code != 1 || !strings.Contains(errOut, "--rate") {
		t.Errorf("bad --rate: exit %d, stderr %q", code, errOut)
	}
}

func TestBenchFlagsFromEnvironment(t *testing.T) {
	s := stdio{err: new(strings.Builder), env: parseEnv([]string{
		"LIMITMESH_NATS_URL=nats://example:4222", "LIMITMESH_KEYS=7", "LIMITMESH_ZIPF=0",
		"LIMITMESH_ROUNDS=3",
	})}
	b, parse := benchFlags(s)
	if err := parse([]string{"--keys", "9"}); err != nil {
		t.Fatal(err)
	}
	c := &b.cfg
	if !b.external || c.Dial == nil || c.Target != "nats://example:4222" {
		t.Errorf("LIMITMESH_NATS_URL must select the external deployment: %+v", b)
	}
	if c.Keys != 9 || c.Zipf != 0 || c.EchoDuration != c.Duration || c.Rounds != 3 {
		t.Errorf("keys %d zipf %v echo %v rounds %d: want 9 (flag wins), 0, --duration, 3",
			c.Keys, c.Zipf, c.EchoDuration, c.Rounds)
	}
	// Without the variable, 5 rounds.
	b, parse = benchFlags(stdio{err: new(strings.Builder), env: parseEnv(nil)})
	if err := parse(nil); err != nil || b.cfg.Rounds != 5 {
		t.Errorf("default rounds %d (%v), want 5", b.cfg.Rounds, err)
	}
}

func TestBenchRoundsRejected(t *testing.T) {
	for _, v := range []string{"0", "-1", "1001"} {
		code, _, errOut := run(t, nil, "bench", "--rounds", v)
		if code != 2 || !strings.Contains(errOut, "--rounds") || strings.Count(strings.TrimSpace(errOut), "\n") != 0 {
			t.Errorf("bench --rounds %s: exit %d, stderr %q; want 2 and one line naming --rounds", v, code, errOut)
		}
	}
	code, _, errOut := run(t, nil, "bench", "--rounds", "0", "--quiet")
	if code != 2 || !strings.Contains(errOut, "must be 1..1000") {
		t.Errorf("--rounds 0: exit %d, stderr %q", code, errOut)
	}
	code, _, errOut = run(t, []string{"LIMITMESH_ROUNDS=0"}, "bench")
	if code != 2 || !strings.Contains(errOut, "--rounds") {
		t.Errorf("LIMITMESH_ROUNDS=0: exit %d, stderr %q", code, errOut)
	}
}

// TestBenchLeased: --mode leased with six SDK holders over an embedded
// two-region supercluster, demand shifting between them: the --json line
// has CONTRACT §8's bound, utilization and local_fraction, the limit binds
// (denials), most decisions are the holders' own, and the measured
// overshoot is within the bound (bench itself fails beyond it).
func TestBenchLeased(t *testing.T) {
	if testing.Short() {
		t.Skip("an embedded supercluster")
	}
	code, m, out, errOut := benchJSON(t, "--mode", "leased", "--holders", "6", "--regions", "2", "--shift", "300ms",
		"--duration", "1s", "--echo-duration", "300ms")
	if code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	if m["mode"] != "leased" || num(t, m, "holders") != 6 || num(t, m, "regions") != 2 {
		t.Errorf("flags not reported: %v", m)
	}
	bound, util, local := num(t, m, "bound"), num(t, m, "utilization"), num(t, m, "local_fraction")
	if over := num(t, m, "overshoot"); bound <= 0 || over > bound {
		t.Errorf("overshoot %v, bound %v: want a positive bound and the overshoot within it", over, bound)
	}
	if util <= 0 || local <= 0 || local > 1 {
		t.Errorf("utilization %v, local_fraction %v: want both positive, the fraction at most 1", util, local)
	}
	if num(t, m, "denied") == 0 || num(t, m, "admitted") == 0 || num(t, m, "errors") != 0 {
		t.Errorf("admitted %v, denied %v, errors %v: want both decisions and no errors", m["admitted"], m["denied"], m["errors"])
	}
}

func TestFormatUnits(t *testing.T) {
	if formatUnits(42_500_000) != "42.5" || formatUnits(3*kvstate.Unit) != "3" || formatUnits(1) != "0.000001" {
		t.Errorf("formatUnits: %q %q %q", formatUnits(42_500_000), formatUnits(3*kvstate.Unit), formatUnits(1))
	}
}
