package cli

import (
	"strings"
	"testing"
	"time"
)

// TestBenchFlood runs bench with a flood of 20 times a 1/s key next to the
// measured load: the flood's figures are in the report and its --json
// line, about F-1 in F of its requests are denied, and none of them
// reaches the measured keys (no overshoot, no unmatched decisions).
func TestBenchFlood(t *testing.T) {
	code, m, out, errOut := benchJSON(t, "--duration", "400ms", "--echo-duration", "200ms", "--rounds", "1",
		"--keys", "20", "--concurrency", "4", "--conns", "1", "--flood", "20", "--flood-rate", "10/s", "--flood-burst", "1")
	if code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	checkRun(t, m)
	f, ok := m["flood"].(map[string]any)
	if !ok {
		t.Fatalf("--json line lacks the flood: %v", m)
	}
	if num(t, f, "factor") != 20 || f["rate"] != "10/s" || num(t, f, "offered_per_sec") != 200 {
		t.Errorf("flood settings not reported: %v", f)
	}
	sent, admitted, denied := num(t, f, "sent"), num(t, f, "admitted"), num(t, f, "denied")
	if sent <= 0 || denied <= 0 || admitted+denied+num(t, f, "errors")+num(t, f, "unanswered") != sent {
		t.Errorf("flood counts do not add up: %v", f)
	}
	// 1 + 10/s over the run's length, which is at most a few seconds
	// here; the flood offers 200/s.
	if admitted > 1+10*num(t, f, "duration_s")+1 {
		t.Errorf("the flood key admitted %v in %vs, more than its limit", admitted, f["duration_s"])
	}
	if !strings.Contains(out, "flood: 20 x 10/s offered 200/s") {
		t.Errorf("report lacks the flood line:\n%s", out)
	}
}

// TestBenchMaxKeys: with --max-keys 5 on one node, 50 keys are admitted
// as at most 6 (5 live keys and the policy's overflow key): at most
// 6 × (burst + rate × the run).
func TestBenchMaxKeys(t *testing.T) {
	start := time.Now()
	code, m, out, errOut := benchJSON(t, "--duration", "300ms", "--echo-duration", "100ms", "--rounds", "1",
		"--keys", "50", "--zipf", "0", "--concurrency", "8", "--conns", "2", "--rate", "1/s", "--burst", "2", "--max-keys", "5")
	wall := time.Since(start)
	if code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	checkRun(t, m)
	if admitted, allowed := num(t, m, "admitted"), 6*(2+wall.Seconds()); admitted > allowed {
		t.Errorf("admitted %v on 50 keys with max_keys 5 within %s, more than 6 keys' worth (%.1f)", admitted, wall, allowed)
	}
}

// TestBenchFloodFlags: bad flood flags and a negative --max-keys are usage
// errors.
func TestBenchFloodFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--flood", "-1"},
		{"--flood", "10", "--flood-rate", "fast"},
		{"--flood", "10", "--flood-burst", "0"},
		{"--max-keys", "-5"},
	} {
		code, _, errOut := run(t, nil, append([]string{"bench"}, args...)...)
		if code != 2 || errOut == "" {
			t.Errorf("bench %v: exit %d, stderr %q; want 2 and a message", args, code, errOut)
		}
	}
}
