package cli

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/mesh"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
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

// TestPolicyExplainDescriptor: --descriptor lists the layers a descriptor
// meets (one policy each, the best of its layer), skipping candidates, and
// the largest bound the request is decided within.
func TestPolicyExplainDescriptor(t *testing.T) {
	emb, err := mesh.StartEmbedded(mesh.EmbeddedConfig{Listen: "127.0.0.1:-1", DataDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(emb.Shutdown)
	nc, err := nats.Connect(emb.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "rl_policies", History: 16})
	if err != nil {
		t.Fatal(err)
	}
	for name, doc := range map[string]string{
		"per-user":   `{"match":{"tenant":"*","user":"*"},"key":["tenant","user"],"layer":"user","limits":[{"algorithm":"token_bucket","rate":"5/s","burst":5}]}`,
		"tenant-agg": `{"match":{"tenant":"*"},"key":["tenant"],"layer":"tenant","mode":"local","limits":[{"algorithm":"token_bucket","rate":"20/s","burst":8}]}`,
		"acme-agg":   `{"match":{"tenant":"acme"},"key":["tenant"],"layer":"tenant","limits":[{"algorithm":"token_bucket","rate":"20/s","burst":20}]}`,
		"candidate":  `{"match":{"tenant":"*"},"layer":"other","shadow":true,"limits":[{"algorithm":"token_bucket","rate":"1/s","burst":1}]}`,
		"protect":    `{"match":{"destination":"search"},"layer":"protection","mode":"local","limits":[{"algorithm":"token_bucket","rate":"50/s","burst":50}]}`,
	} {
		if _, err := kv.Put(ctx, name, []byte(doc)); err != nil {
			t.Fatal(err)
		}
	}
	code, out, errOut := run(t, nil, "policy", "explain", "--nats-url", emb.ClientURL(), "--nodes", "3",
		"--descriptor", "tenant=acme,user=u1,destination=search")
	if code != 0 {
		t.Fatalf("exit %d: %s%s", code, out, errOut)
	}
	for _, w := range []string{"meets 3 layer(s)", "layer protection: policy protect", "layer tenant: policy acme-agg",
		"layer user: policy per-user", "decided within the largest bound of its layers: 100 units (protect/token_bucket)"} {
		if !strings.Contains(out, w) {
			t.Errorf("output lacks %q:\n%s", w, out)
		}
	}
	if strings.Contains(out, "candidate") || strings.Contains(out, "tenant-agg") {
		t.Errorf("output names a candidate or a policy its layer does not pick:\n%s", out)
	}
	if code, out, _ := run(t, nil, "policy", "explain", "--nats-url", emb.ClientURL(), "--descriptor", "other=x"); code != 0 || !strings.Contains(out, "no policy matches") {
		t.Errorf("unmatched: exit %d\n%s", code, out)
	}
}
