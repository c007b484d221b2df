package cli

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestPolicyExplainFile(t *testing.T) {
	dir := t.TempDir()
	write := func(name, doc string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(doc), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	local := write("acme.json", `{"match":{"tenant":"acme"},"mode":"local","limits":[{"name":"rate","algorithm":"token_bucket","rate":"10/s","burst":40}]}`)
	async := write("a.json", `{"match":{"tenant":"acme"},"mode":"async","limits":[{"name":"rate","algorithm":"token_bucket","rate":"10/s","burst":40},{"name":"w","algorithm":"fixed_window","limit":100,"window":"1m"}]}`)
	strict := write("s.json", `{"match":{"tenant":"acme"},"limits":[{"algorithm":"gcra","rate":"1/s","burst":3}]}`)
	leased := write("l.json", `{"match":{"tenant":"acme"},"mode":"leased","limits":[{"algorithm":"gcra","rate":"1/s","burst":3}]}`)
	acme := write("acme-leased.json", `{"match":{"tenant":"acme"},"mode":"leased","lease":{"size":10,"ttl":"2s","max_outstanding":40},"limits":[{"name":"rate","algorithm":"token_bucket","rate":"10/s","burst":40},{"name":"month","algorithm":"quota","limit":20000000,"period":"month"}]}`)
	conc := write("c.json", `{"match":{"tenant":"acme"},"mode":"leased","limits":[{"algorithm":"concurrency","limit":3,"window":"1m"}]}`)
	for _, tc := range []struct {
		args []string
		code int
		want []string
	}{
		{[]string{"acme", "--file", local, "--nodes", "3"}, 0, []string{"mode local", "limit rate: token_bucket, rate 10/s, burst 40",
			"with 3 nodes", "local: rate: (3 − 1) × 40 = 80 units"}},
		{[]string{"acme", "--file", local}, 0, []string{"with 1 node", "(1 − 1) × 40 = 0 units"}},
		{[]string{"acme", "--file", async, "--nodes", "2"}, 0, []string{"mode async", "async: rate: 40 + 10/s × (100ms + 500ms) = 46 units",
			"async: w: limit 100 = 100 units per window"}},
		{[]string{"acme", "--file", async, "--async-interval", "100ms", "--decision-timeout", "400ms"}, 0,
			[]string{"async: rate: 40 + 10/s × (100ms + 400ms) = 45 units"}},
		{[]string{"acme", "--file", strict, "--nodes", "6"}, 0, []string{"mode strict", "strict: gcra: 0 units"}},
		{[]string{"acme", "--file", leased}, 0, []string{"mode leased", "lease: grants of up to 1 units, ttl 2s (holders stop 200ms early: the skew margin), at most 3 units outstanding per key",
			"leased: gcra: max_outstanding 3 = 3 units", "gcra: admitted(t1, t2) ≤ 3 + 1/s × (t2 − t1) + 3"}},
		{[]string{"acme", "--file", acme, "--nodes", "6"}, 0, []string{"lease: grants of up to 10 units, ttl 2s (holders stop 200ms early: the skew margin), at most 40 units outstanding per key",
			"leased: rate: max_outstanding 40 = 40 units", "leased: month: max_outstanding 40 = 40 units per period",
			"rate: admitted(t1, t2) ≤ 40 + 10/s × (t2 − t1) + 40", "month: admitted ≤ 20000000 + 40 = 20000040 per month"}},
		{[]string{"acme", "--file", conc}, 1, nil},
		{[]string{"acme", "--file", local, "--nodes", "0"}, 2, nil},
		{[]string{"--file", local}, 2, nil},
	} {
		code, out, errOut := run(t, nil, append([]string{"policy", "explain"}, tc.args...)...)
		if code != tc.code {
			t.Errorf("%v: exit %d, want %d\n%s%s", tc.args, code, tc.code, out, errOut)
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(out, w) {
				t.Errorf("%v: output lacks %q:\n%s", tc.args, w, out)
			}
		}
	}
}
