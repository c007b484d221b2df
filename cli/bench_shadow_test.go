package cli

import (
	"strings"
	"testing"
)

// TestBenchCandidates: with --candidates 3 the embedded node's shadow
// evaluator replays the run through three candidates; the --json line's
// "shadow" object counts every decision evaluated, says how long the
// evaluation took to catch up after the run, and the text report says so.
func TestBenchCandidates(t *testing.T) {
	code, m, out, errOut := benchJSON(t, "--duration", "600ms", "--echo-duration", "300ms", "--rounds", "2",
		"--keys", "50", "--concurrency", "8", "--conns", "2", "--candidates", "3")
	if code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	checkRun(t, m)
	sh, ok := m["shadow"].(map[string]any)
	if !ok {
		t.Fatalf("no shadow object: %v", m)
	}
	if num(t, sh, "candidates") != 3 || num(t, sh, "evaluated") < num(t, m, "decisions") || num(t, sh, "catch_up_s") < 0 {
		t.Errorf("shadow %v of %v decisions", sh, m["decisions"])
	}
	if num(t, sh, "lag_max_s") < num(t, sh, "lag_p50_s") {
		t.Errorf("lag figures out of order: %v", sh)
	}
	if !strings.Contains(out, "shadow: 3 candidates") {
		t.Errorf("report lacks the shadow line:\n%s", out)
	}
	// Without candidates: no shadow object.
	code, m, out, errOut = benchJSON(t, "--duration", "100ms", "--keys", "5", "--concurrency", "2", "--conns", "1")
	if _, ok := m["shadow"]; code != 0 || ok {
		t.Errorf("without --candidates: exit %d, %v\n%s%s", code, m, out, errOut)
	}
}

// TestBenchCandidatesFlag: --candidates out of range is a usage error.
func TestBenchCandidatesFlag(t *testing.T) {
	for _, v := range []string{"-1", "101"} {
		if code, _, errOut := run(t, nil, "bench", "--candidates", v); code != 2 || !strings.Contains(errOut, "--candidates") {
			t.Errorf("--candidates %s: exit %d, %q", v, code, errOut)
		}
	}
}
