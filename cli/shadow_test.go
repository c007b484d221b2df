package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/jstest"
	"github.com/limitmesh/limitmesh/internal/usagetest"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/limitmesh/limitmesh/policies"
	"github.com/limitmesh/limitmesh/shadow"
	usagestream "github.com/limitmesh/limitmesh/usage"
)

const shadowCandidate = `{"match": {"tenant": "*"}, "key": ["tenant"],
  "limits": [{"name": "rate", "algorithm": "token_bucket", "rate": "10/s", "burst": 5}],
  "shadow": true,
  "description": "stricter per tenant"}`

// shadowInstallation starts a server with the policy bucket, the usage
// stream, a candidate, 400 usage records and a shadow evaluator; it
// returns the server's URL and a JetStream context, once the candidate's
// summary covers every record.
func shadowInstallation(t *testing.T) (string, jetstream.JetStream) {
	t.Helper()
	srv := jstest.Start(t)
	js := jstest.JetStream(t, jstest.Connect(t, srv.Server))
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "rl_policies", History: 16})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: usagestream.StreamName("rl"), Subjects: []string{usagestream.Subjects("rl")}}); err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, "per-tenant", []byte(shadowCandidate)); err != nil {
		t.Fatal(err)
	}
	var recs []usagestream.Record
	at := time.Now().UnixMicro()
	for i := 0; i < 400; i++ {
		d, _ := policies.NewDescriptor([]policies.Dim{{Name: "tenant", Value: []string{"acme", "birch"}[i%2]}})
		recs = append(recs, usagestream.Record{ID: fmt.Sprintf("n1.%d", i), TimeUs: at + int64(i)*5000, Descriptor: d,
			Cost: 1_000_000, Allowed: i%7 != 0})
	}
	for i := 0; i < len(recs); i += 50 {
		b := usagetest.AppendBatch(nil, &usagestream.Batch{Node: "n1", Policy: "", Records: recs[i : i+50]})
		if _, err := js.Publish(ctx, usagestream.Subject("rl", ""), b); err != nil {
			t.Fatal(err)
		}
	}
	ev, err := shadow.NewEvaluator(js, shadow.Config{NodeID: "n1", Lease: 300 * time.Millisecond,
		FlushInterval: 50 * time.Millisecond, CheckpointInterval: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ectx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ev.Run(ectx) }()
	t.Cleanup(func() { stop(); <-done })
	waitFor(t, "the candidate's summary", func() bool {
		code, out, _ := run(t, nil, "shadow", "report", "per-tenant", "--json", "--nats-url", srv.ClientURL())
		var s shadow.Summary
		return code == 0 && json.Unmarshal([]byte(out), &s) == nil && s.Evaluated == 400
	})
	return srv.ClientURL(), js
}

// TestShadowCommands: report (table and --json), backtest of the
// candidate's document (the same counts as the live evaluation), promote
// with a stale --revision (refused, saying why), then promote (the same
// document without "shadow", compare-and-swap) and promote again (not a
// candidate any more).
func TestShadowCommands(t *testing.T) {
	url, js := shadowInstallation(t)
	code, out, errOut := run(t, nil, "shadow", "report", "--nats-url", url)
	if code != 0 || !strings.Contains(out, "CANDIDATE") || !strings.Contains(out, "per-tenant") || !strings.Contains(out, "400") {
		t.Fatalf("report: exit %d\n%s%s", code, out, errOut)
	}
	code, out, _ = run(t, nil, "shadow", "report", "per-tenant", "--nats-url", url, "--json")
	lines := strings.Split(strings.TrimSpace(out), "\n")
	var live shadow.Summary
	if code != 0 || len(lines) != 1 || json.Unmarshal([]byte(lines[0]), &live) != nil || live.Policy != "per-tenant" {
		t.Fatalf("report --json: exit %d, %q", code, out)
	}
	if live.WouldDeny == 0 || live.WouldAllow == 0 {
		t.Fatalf("the candidate should both admit and deny: %+v", live)
	}
	code, out, _ = run(t, nil, "shadow", "report", "per-tenant", "--nats-url", url)
	if code != 0 || !strings.Contains(out, "top denied keys of per-tenant") || !strings.Contains(out, "p.per-tenant.tenant=acme") {
		t.Fatalf("report NAME: exit %d\n%s", code, out)
	}
	if code, _, errOut := run(t, nil, "shadow", "report", "nobody", "--nats-url", url); code != 1 || !strings.Contains(errOut, "no summary") {
		t.Errorf("report of an unknown name: exit %d, %q", code, errOut)
	}

	file := filepath.Join(t.TempDir(), "stricter.json")
	os.WriteFile(file, []byte(shadowCandidate), 0o644)
	code, out, errOut = run(t, nil, "shadow", "backtest", file, "--name", "per-tenant", "--since", "1h", "--json", "--nats-url", url)
	var bt struct {
		shadow.Summary
		Records       uint64  `json:"records"`
		RecordsPerSec float64 `json:"records_per_sec"`
	}
	if code != 0 || json.Unmarshal([]byte(out), &bt) != nil {
		t.Fatalf("backtest --json: exit %d\n%s%s", code, out, errOut)
	}
	if bt.Records != 400 || bt.RecordsPerSec <= 0 || bt.Evaluated != live.Evaluated || bt.WouldDeny != live.WouldDeny ||
		bt.BothDenied != live.BothDenied || bt.OnlyLiveDenied != live.OnlyLiveDenied || bt.WouldDenyUnits != live.WouldDenyUnits ||
		fmt.Sprint(bt.TopDenied) != fmt.Sprint(live.TopDenied) {
		t.Fatalf("backtest %+v\nlive %+v", bt, live)
	}
	code, out, _ = run(t, nil, "shadow", "backtest", file, "--nats-url", url)
	if code != 0 || !strings.Contains(out, "backtest of stricter over the last 24h0m0s of RL_USAGE: 400 records") || !strings.Contains(out, "records/s") {
		t.Fatalf("backtest: exit %d\n%s", code, out)
	}

	code, _, errOut = run(t, nil, "shadow", "promote", "per-tenant", "--revision", "99", "--nats-url", url)
	if code != 1 || !strings.Contains(errOut, "changed since the report") || !strings.Contains(errOut, "--revision 1") {
		t.Fatalf("promote with a stale revision: exit %d, %q", code, errOut)
	}
	code, out, errOut = run(t, nil, "shadow", "promote", "per-tenant", "--nats-url", url)
	if code != 0 || !strings.Contains(out, "promoted per-tenant: candidate revision 1 is live as revision 2") {
		t.Fatalf("promote: exit %d\n%s%s", code, out, errOut)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	kv, _ := js.KeyValue(ctx, "rl_policies")
	e, err := kv.Get(ctx, "per-tenant")
	if err != nil {
		t.Fatal(err)
	}
	want := strings.Replace(shadowCandidate, "\n  \"shadow\": true,", "", 1)
	if string(e.Value()) != want {
		t.Fatalf("promoted document:\n%s\nwant\n%s", e.Value(), want)
	}
	code, _, errOut = run(t, nil, "shadow", "promote", "per-tenant", "--nats-url", url)
	if code != 1 || !strings.Contains(errOut, "not a candidate") {
		t.Fatalf("promote twice: exit %d, %q", code, errOut)
	}
	waitFor(t, "the promoted candidate's summary to go", func() bool {
		code, out, _ := run(t, nil, "shadow", "report", "--json", "--nats-url", url)
		return code == 0 && strings.TrimSpace(out) == ""
	})
}

func TestShadowUsage(t *testing.T) {
	for _, args := range [][]string{
		{"shadow"}, {"shadow", "frobnicate"}, {"shadow", "report", "a", "b"},
		{"shadow", "promote"}, {"shadow", "backtest"}, {"shadow", "backtest", "f", "--since", "-1h"},
	} {
		if code, _, _ := run(t, nil, args...); code != 2 {
			t.Errorf("%v: exit %d, want 2", args, code)
		}
	}
	if got := strings.Join(shadowArgs([]string{"NAME", "--json", "--revision", "3", "FILE"}), " "); got != "--json --revision 3 NAME FILE" {
		t.Errorf("shadowArgs: %q", got)
	}
}
