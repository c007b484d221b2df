package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/limitmesh/limitmesh/mesh"
	"github.com/limitmesh/limitmesh/policies"
	lmusage "github.com/limitmesh/limitmesh/usage"
)

// usageFixture is an embedded server with the usage stream, a publisher
// and a running reconciler.
type usageFixture struct {
	url string
	js  jetstream.JetStream
	pub *lmusage.Publisher
}

func newUsageFixture(t *testing.T) *usageFixture {
	t.Helper()
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
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := lmusage.EnsureStream(ctx, js, lmusage.StreamConfig{Prefix: "rl"}); err != nil {
		t.Fatal(err)
	}
	pub, err := lmusage.NewPublisher(js, lmusage.PublisherConfig{Node: "n1", Boot: "b1", Interval: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close(context.Background()) })
	rec, err := lmusage.NewReconciler(ctx, js, lmusage.ReconcilerConfig{Node: "n1"})
	if err != nil {
		t.Fatal(err)
	}
	rctx, rcancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = rec.Run(rctx); close(done) }()
	t.Cleanup(func() { rcancel(); <-done })
	return &usageFixture{url: emb.ClientURL(), js: js, pub: pub}
}

func (f *usageFixture) add(t *testing.T, policy, key string, tUs, cost int64, allowed bool, dims ...string) {
	t.Helper()
	var ds []policies.Dim
	for i := 0; i < len(dims); i += 2 {
		ds = append(ds, policies.Dim{Name: dims[i], Value: dims[i+1]})
	}
	d, err := policies.NewDescriptor(ds)
	if err != nil {
		t.Fatal(err)
	}
	if !f.pub.Add(policy, lmusage.Record{TimeUs: tUs, Revision: 2, Key: key, Descriptor: d, Cost: cost, Allowed: allowed, RequestID: "r1"}) {
		t.Fatal("Add refused")
	}
}

// waitLedger waits until the reconciler applied everything published.
func (f *usageFixture) waitLedger(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := f.pub.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	s, err := f.js.Stream(ctx, lmusage.StreamName("rl"))
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	ledger, err := f.js.KeyValue(ctx, lmusage.LedgerBucket("rl"))
	if err != nil {
		t.Fatal(err)
	}
	// The ledger's cursor entry: every message up to its seq is wholly in
	// the ledger (docs/protocol.md).
	var cursor struct {
		Seq uint64 `json:"seq"`
	}
	for cursor.Seq < info.State.LastSeq {
		if ctx.Err() != nil {
			t.Fatalf("ledger at %d, stream at %d", cursor.Seq, info.State.LastSeq)
		}
		time.Sleep(10 * time.Millisecond)
		en, err := ledger.Get(ctx, "cursor")
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			continue
		}
		if err != nil {
			t.Fatalf("reading the ledger's cursor: %v", err)
		}
		if err := json.Unmarshal(en.Value(), &cursor); err != nil {
			t.Fatalf("cursor %q: %v", en.Value(), err)
		}
	}
}

const dec3 = int64(1796256000000000) // 2026-12-03T00:00:00Z

func TestUsageReport(t *testing.T) {
	f := newUsageFixture(t)
	acme := "p.acme-search.tenant=acme"
	f.add(t, "acme-search", acme, dec3+1, 2_500_000, true, "tenant", "acme")
	f.add(t, "acme-search", acme, dec3+2, 500_001, true, "tenant", "acme")
	f.add(t, "acme-search", acme, dec3+3, 3_000_000, false, "tenant", "acme")
	f.add(t, "acme-search", acme, dec3+86_400_000_000, 1_000_000, true, "tenant", "acme") // Dec 4
	f.add(t, "birch", "p.birch", dec3, 7_000_000, true, "tenant", "birch")
	f.add(t, "", "", dec3, 1_000_000, true, "tenant", "nobody")
	f.waitLedger(t)

	code, out, errOut := run(t, nil, "usage", "report", "--nats-url", f.url)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	var rows []string
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		rows = append(rows, strings.Join(strings.Fields(l), " "))
	}
	want := []string{
		"POLICY PERIOD KEY ALLOWED ALLOWED_UNITS DENIED DENIED_UNITS",
		"(none) 2026-12 - 1 1 0 0",
		"(none) 2026-12-03 - 1 1 0 0",
		"acme-search 2026-12 p.acme-search.tenant=acme 3 4.000001 1 3",
		"acme-search 2026-12-03 p.acme-search.tenant=acme 2 3.000001 1 3",
		"acme-search 2026-12-04 p.acme-search.tenant=acme 1 1 0 0",
		"birch 2026-12 p.birch 1 7 0 0",
		"birch 2026-12-03 p.birch 1 7 0 0",
	}
	if strings.Join(rows, "\n") != strings.Join(want, "\n") {
		t.Fatalf("report:\n%s\nwant (spacing aside):\n%s", out, strings.Join(want, "\n"))
	}

	// Filters and JSON: the entry as stored.
	code, out, errOut = run(t, nil, "usage", "report", "--nats-url", f.url, "--policy", "acme-search", "--period", "2026-12-03", "--json")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 1 {
		t.Fatalf("want one entry:\n%s", out)
	}
	var raw map[string]any
	if err := json.Unmarshal([]byte(lines[0]), &raw); err != nil {
		t.Fatal(err)
	}
	if raw["policy"] != "acme-search" || raw["key"] != acme || raw["period"] != "2026-12-03" ||
		raw["allowed"] != 2.0 || raw["allowed_units"] != "3.000001" || raw["denied"] != 1.0 || raw["denied_units"] != "3" {
		t.Fatalf("entry %s", lines[0])
	}
	ctx := context.Background()
	kv, err := f.js.KeyValue(ctx, "rl_ledger")
	if err != nil {
		t.Fatal(err)
	}
	stored, err := kv.Get(ctx, lmusage.TotalsKey("acme-search", "2026-12-03", acme))
	if err != nil {
		t.Fatal(err)
	}
	if lines[0] != string(stored.Value()) {
		t.Fatalf("--json printed %s, the bucket holds %s", lines[0], stored.Value())
	}

	for _, c := range []struct {
		args  []string
		lines int
	}{
		{[]string{"--policy", "_"}, 2},
		{[]string{"--key", "p.birch"}, 2},
		{[]string{"--period", "2026-12-04"}, 1},
		{[]string{"--policy", "nobody"}, 0},
	} {
		code, out, errOut := run(t, nil, append([]string{"usage", "report", "--nats-url", f.url, "--json"}, c.args...)...)
		if code != 0 {
			t.Fatalf("%v: exit %d: %s", c.args, code, errOut)
		}
		if n := strings.Count(out, "\n"); n != c.lines {
			t.Errorf("%v: %d entries, want %d:\n%s", c.args, n, c.lines, out)
		}
	}
	for _, bad := range [][]string{{"--policy", "Bad"}, {"--period", "2026-13"}, {"--key", "a..b"}, {"--key", "p.*"}, {"extra"}} {
		if code, _, _ := run(t, nil, append([]string{"usage", "report", "--nats-url", f.url}, bad...)...); code != 2 {
			t.Errorf("%v: exit %d, want 2", bad, code)
		}
	}
	// The environment sets the URL too.
	if code, out, _ := run(t, []string{"LIMITMESH_NATS_URL=" + f.url}, "usage", "report", "--policy", "birch"); code != 0 || !strings.Contains(out, "p.birch") {
		t.Fatalf("exit %d:\n%s", code, out)
	}
}

func TestUsageReportNoBucket(t *testing.T) {
	emb, err := mesh.StartEmbedded(mesh.EmbeddedConfig{Listen: "127.0.0.1:-1", DataDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(emb.Shutdown)
	code, _, errOut := run(t, nil, "usage", "report", "--nats-url", emb.ClientURL())
	if code != 1 || !strings.Contains(errOut, "rl_ledger does not exist") {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	if code, _, _ := run(t, nil, "usage"); code != 2 {
		t.Fatalf("bare usage: exit %d", code)
	}
}

func TestUsageTail(t *testing.T) {
	f := newUsageFixture(t)
	for _, asJSON := range []bool{false, true} {
		args := []string{"usage", "tail", "--nats-url", f.url, "--count", "3"}
		if asJSON {
			args = append(args, "--json", "--policy", "acme")
		}
		var out, errb bytes.Buffer
		done := make(chan int)
		go func() { done <- Main(context.Background(), args, nil, strings.NewReader(""), &out, &errb) }()
		// Publish until the tail has printed its records (it starts with
		// new records only, so the first ones may come before it listens).
		deadline := time.After(30 * time.Second)
		var code int
	loop:
		for i := 0; ; i++ {
			f.add(t, "acme", "p.acme.tenant=a_20b", dec3+int64(i), 1_500_000, i%2 == 0, "tenant", "a b")
			f.add(t, "", "", dec3, 1_000_000, true, "op", "x")
			select {
			case code = <-done:
				break loop
			case <-deadline:
				t.Fatal("tail did not print 3 records")
			case <-time.After(20 * time.Millisecond):
			}
		}
		if code != 0 {
			t.Fatalf("exit %d: %s", code, errb.String())
		}
		lines := strings.Split(strings.TrimSpace(out.String()), "\n")
		if len(lines) != 3 {
			t.Fatalf("%d lines:\n%s", len(lines), out.String())
		}
		for _, l := range lines {
			if asJSON {
				var rec map[string]any
				if err := json.Unmarshal([]byte(l), &rec); err != nil {
					t.Fatalf("%s: %v", l, err)
				}
				if rec["node"] != "n1" || rec["policy"] != "acme" || rec["cost"] != 1.5 || rec["key"] != "p.acme.tenant=a_20b" {
					t.Fatalf("record %s", l)
				}
				continue
			}
			if !strings.Contains(l, "2026-12-03T00:00:00.0000") || !strings.Contains(l, " n1 ") || !strings.Contains(l, "id=n1.b1.") {
				t.Fatalf("line %q", l)
			}
			if strings.Contains(l, " acme ") && !strings.Contains(l, `tenant="a b"`) {
				t.Fatalf("line %q", l)
			}
		}
	}
}

func TestUsageExport(t *testing.T) {
	f := newUsageFixture(t)
	// Nothing stored yet: nothing printed.
	if code, out, errs := run(t, nil, "usage", "export", "--nats-url", f.url); code != 0 || out != "" {
		t.Fatalf("empty stream: exit %d, %q %q", code, out, errs)
	}
	for i := 0; i < 50; i++ {
		f.add(t, "acme", "p.acme.tenant=a_20b", dec3+int64(i), 1_500_000, i%2 == 0, "tenant", "a b")
		f.add(t, "birch", "p.birch.tenant=b", dec3+int64(i), 1_000_000, true, "tenant", "b")
	}
	f.add(t, "", "", dec3, 1_000_000, true, "op", "x")
	f.waitLedger(t)

	code, out, errs := run(t, nil, "usage", "export", "--nats-url", f.url)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errs)
	}
	if n := strings.Count(out, "\n"); n != 101 {
		t.Fatalf("%d lines, want 101:\n%s", n, out)
	}
	code, out, errs = run(t, nil, "usage", "export", "--nats-url", f.url, "--policy", "acme", "--json", "--since", "1h")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errs)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 50 {
		t.Fatalf("%d lines for acme, want 50", len(lines))
	}
	ids := map[string]bool{}
	for i, l := range lines {
		var rec struct {
			Node, Policy, ID, Key, Result string
			TUs                           int64 `json:"t_us"`
			Revision                      int
			Cost                          float64
			Descriptor                    map[string]string
			RequestID                     string `json:"request_id"`
		}
		if err := json.Unmarshal([]byte(l), &rec); err != nil {
			t.Fatalf("%s: %v", l, err)
		}
		want := "denied"
		if i%2 == 0 {
			want = "allowed"
		}
		if rec.Node != "n1" || rec.Policy != "acme" || rec.Key != "p.acme.tenant=a_20b" || rec.TUs != dec3+int64(i) ||
			rec.Revision != 2 || rec.Cost != 1.5 || rec.Result != want || rec.Descriptor["tenant"] != "a b" || rec.RequestID != "r1" || ids[rec.ID] || rec.ID == "" {
			t.Fatalf("record %d: %s", i, l)
		}
		ids[rec.ID] = true
	}
	if code, out, _ := run(t, nil, "usage", "export", "--nats-url", f.url, "--policy", "_"); code != 0 || strings.Count(out, "\n") != 1 || !strings.Contains(out, "(none)") {
		t.Fatalf("--policy _: exit %d, %q", code, out)
	}
	if code, _, _ := run(t, nil, "usage", "export", "--nats-url", f.url, "extra"); code != 2 {
		t.Fatalf("extra argument: exit %d", code)
	}

	// A reservation's end (CONTRACT.md §10): a release costs 0 and names
	// its reservation, in both forms.
	d, err := policies.NewDescriptor([]policies.Dim{{Name: "tenant", Value: "c"}})
	if err != nil {
		t.Fatal(err)
	}
	const res = "r1.00000000002a.p.cedar.tenant=c"
	if !f.pub.Add("cedar", lmusage.Record{TimeUs: dec3, Revision: 2, Key: "p.cedar.tenant=c", Descriptor: d, Allowed: true, Reservation: res}) {
		t.Fatal("Add refused")
	}
	f.waitLedger(t)
	code, out, errs = run(t, nil, "usage", "export", "--nats-url", f.url, "--policy", "cedar")
	if code != 0 || strings.Count(out, "\n") != 1 || !strings.Contains(out, " cedar allowed 0 p.cedar.tenant=c tenant=c id=") ||
		!strings.HasSuffix(out, " reservation="+strconv.Quote(res)+"\n") { // quoted: it holds '='
		t.Fatalf("a release: exit %d, %q %q", code, out, errs)
	}
	code, out, errs = run(t, nil, "usage", "export", "--nats-url", f.url, "--policy", "cedar", "--json")
	var rec struct {
		Cost        *float64
		Result      string
		Reservation string
	}
	if code != 0 || json.Unmarshal([]byte(out), &rec) != nil || rec.Cost == nil || *rec.Cost != 0 || rec.Result != "allowed" || rec.Reservation != res {
		t.Fatalf("a release with --json: exit %d, %q %q", code, out, errs)
	}
}
