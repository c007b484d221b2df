package integration

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/mesh"
)

// grafanaDashboard is deploy/grafana/limitmesh.json.
func grafanaDashboard(t *testing.T) map[string]any {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(deployDir, "grafana", "limitmesh.json"))
	if err != nil {
		t.Fatal(err)
	}
	var d map[string]any
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("deploy/grafana/limitmesh.json: %v", err)
	}
	return d
}

// promExprs returns every "expr" string anywhere in v.
func promExprs(v any) []string {
	var out []string
	switch x := v.(type) {
	case map[string]any:
		for k, e := range x {
			if s, ok := e.(string); ok && k == "expr" {
				out = append(out, s)
				continue
			}
			out = append(out, promExprs(e)...)
		}
	case []any:
		for _, e := range x {
			out = append(out, promExprs(e)...)
		}
	}
	return out
}

var (
	promStrings  = regexp.MustCompile(`"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|` + "`[^`]*`")
	promMatchers = regexp.MustCompile(`\{[^}]*\}`)
	promRanges   = regexp.MustCompile(`\[[^\]]*\]`)
	promGrouping = regexp.MustCompile(`\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)`)
	promIdent    = regexp.MustCompile(`[a-zA-Z_:][a-zA-Z0-9_:]*`)
	promKeywords = map[string]bool{"and": true, "or": true, "unless": true, "bool": true, "offset": true, "by": true,
		"without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true, "inf": true, "nan": true, "atan2": true}
)

// promMetrics returns the metric names a PromQL expression selects: the
// identifiers left once strings, label matchers, ranges and grouping
// clauses are removed that are neither function calls, keywords, numbers
// nor Grafana variables.
func promMetrics(expr string) []string {
	s := promStrings.ReplaceAllString(expr, `""`)
	s = promMatchers.ReplaceAllString(s, " ")
	s = promRanges.ReplaceAllString(s, " ")
	s = promGrouping.ReplaceAllString(s, " ")
	var out []string
	for _, loc := range promIdent.FindAllStringIndex(s, -1) {
		name := s[loc[0]:loc[1]]
		if loc[0] > 0 {
			if c := s[loc[0]-1]; c == '$' || c == '.' || c >= '0' && c <= '9' {
				continue // a variable, or the exponent or fraction of a number
			}
		}
		rest := strings.TrimLeft(s[loc[1]:], " \t\n")
		if strings.HasPrefix(rest, "(") || promKeywords[strings.ToLower(name)] {
			continue
		}
		if !slices.Contains(out, name) {
			out = append(out, name)
		}
	}
	return out
}

func TestPromMetrics(t *testing.T) {
	for expr, want := range map[string]string{
		`sum by (policy, result) (rate(limitmesh_decisions_total{result="denied", policy=~"a.*"}[$__rate_interval]))`: "limitmesh_decisions_total",
		`histogram_quantile(0.99, sum by (le) (rate(limitmesh_decision_duration_seconds_bucket[5m])))`:                "limitmesh_decision_duration_seconds_bucket",
		`a_total / on (instance) group_left b_total > 1e3 and c`:                                                      "a_total b_total c",
		`max(limitmesh_usage_lag_seconds) offset 5m`:                                                                  "limitmesh_usage_lag_seconds",
		`label_replace(up, "x", "$1", "job", "(.*)")`:                                                                 "up",
	} {
		if got := strings.Join(promMetrics(expr), " "); got != want {
			t.Errorf("promMetrics(%s) = %q, want %q", expr, got, want)
		}
	}
}

// scrapeFamilies returns the metric family names a node's /metrics
// exports (from its # TYPE lines and its samples).
func scrapeFamilies(t *testing.T, tn *testNode) map[string]string {
	t.Helper()
	resp, err := http.Get(tn.http.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) == 4 && f[0] == "#" && f[1] == "TYPE" {
			out[f[2]] = f[3]
		} else if l != "" && l[0] != '#' {
			name := l[:strings.IndexAny(l+" ", "{ ")]
			if _, ok := out[name]; !ok {
				out[name] = "sample"
			}
		}
	}
	return out
}

// exported reports whether name (a metric name as a query writes it) is
// in families: itself, or a histogram or summary series of a family.
func exported(families map[string]string, name string) bool {
	if _, ok := families[name]; ok {
		return true
	}
	for _, suf := range []string{"_bucket", "_sum", "_count"} {
		if base, ok := strings.CutSuffix(name, suf); ok {
			if typ := families[base]; typ == "histogram" || typ == "summary" {
				return true
			}
		}
	}
	return false
}

// TestGrafanaDashboardMetrics: every PromQL expression of
// deploy/grafana/limitmesh.json names only limitmesh_ metrics, and every
// one of them is exported by real nodes (two on one server, so that
// requests are forwarded) after traffic with allowed and denied decisions
func TestGrafanaDashboardMetrics(t *testing.T) {
	d := grafanaDashboard(t)
	if d["uid"] != "limitmesh" || d["title"] == "" {
		t.Errorf("dashboard uid %v title %v", d["uid"], d["title"])
	}
	exprs := promExprs(d)
	if len(exprs) < 10 {
		t.Fatalf("only %d expressions in the dashboard", len(exprs))
	}
	var names []string
	for _, e := range exprs {
		ms := promMetrics(e)
		if len(ms) == 0 {
			t.Errorf("no metric in %q", e)
		}
		for _, m := range ms {
			if !strings.HasPrefix(m, "limitmesh_") {
				t.Errorf("%q names %q, not a limitmesh_ metric", e, m)
			}
			if !slices.Contains(names, m) {
				names = append(names, m)
			}
		}
	}
	for _, want := range []string{"limitmesh_decisions_total", "limitmesh_decision_duration_seconds_bucket",
		"limitmesh_shadow_decisions_total", "limitmesh_usage_lag_seconds", "limitmesh_cas_conflicts_total",
		"limitmesh_owned_partitions", "limitmesh_forwarded_total"} {
		if !slices.Contains(names, want) {
			t.Errorf("the dashboard does not show %s", want)
		}
	}

	e := server(t, t.TempDir())
	var nodes []*testNode
	for i := range 2 {
		nodes = append(nodes, startNode(t, e, mesh.NodeConfig{NodeID: fmt.Sprintf("g%d", i), LeaseTime: 600 * time.Millisecond}))
	}
	// The candidate first: the watch applies entries in order, so once the
	// live policy is in force the candidate was seen (a candidate is never
	// in force itself).
	putPolicy(t, nodes[0].nc, "rl_policies", "export-v2",
		`{"match": {"tenant": "*", "operation": "export"}, "key": ["tenant"], "limits": [{"algorithm": "token_bucket", "rate": "1/s", "burst": 1}], "shadow": true}`)
	rev := putPolicy(t, nodes[0].nc, "rl_policies", "per-tenant",
		`{"match": {"tenant": "*"}, "key": ["tenant"], "limits": [{"algorithm": "token_bucket", "rate": "1/s", "burst": 2}]}`)
	waitApplied(t, "per-tenant", rev, nodes...)

	missing := func() []string {
		families := map[string]string{}
		for _, n := range nodes {
			for k, v := range scrapeFamilies(t, n) {
				families[k] = v
			}
		}
		var out []string
		for _, m := range names {
			if !exported(families, m) {
				out = append(out, m)
			}
		}
		return out
	}
	i := 0
	var left []string
	waitWithin(t, 60*time.Second, "every metric of the dashboard exported", func() bool {
		for range 40 { // traffic: allowed, denied, forwarded, candidate matches
			i++
			desc := map[string]string{"tenant": fmt.Sprintf("t%d", i%60), "operation": "search"}
			if i%5 == 0 {
				desc["operation"] = "export"
			}
			decide(t, nodes[i%2].nc, "rl.v1.decide", req(desc, ""))
		}
		left = missing()
		return len(left) == 0
	})
	if len(left) > 0 {
		t.Fatalf("not exported: %v", left)
	}
}
