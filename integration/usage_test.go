package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/cli"
	"github.com/limitmesh/limitmesh/mesh"
	"github.com/limitmesh/limitmesh/usage"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// usageRecords reads every usage record the stream holds, by subject.
func usageRecords(t *testing.T, nc *nats.Conn) map[string][]usage.Record {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	js, _ := jetstream.New(nc)
	s, err := js.Stream(ctx, usage.StreamName("rl"))
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]usage.Record{}
	for seq := uint64(1); ; {
		m, err := s.GetMsg(ctx, seq, jetstream.WithGetMsgSubject(usage.Subjects("rl")))
		if err != nil {
			return out
		}
		seq = m.Sequence + 1
		b, err := usage.DecodeBatch(m.Data)
		if err != nil {
			t.Fatalf("usage message %d: %v", m.Sequence, err)
		}
		out[m.Subject] = append(out[m.Subject], b.Records...)
	}
}

// ledgerTotals reads the ledger entry of policy's key in period.
func ledgerTotals(t *testing.T, nc *nats.Conn, policy, period, key string) (usage.Totals, bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	js, _ := jetstream.New(nc)
	kv, err := js.KeyValue(ctx, usage.LedgerBucket("rl"))
	if err != nil {
		return usage.Totals{}, false
	}
	e, err := kv.Get(ctx, usage.TotalsKey(policy, period, key))
	if err != nil {
		return usage.Totals{}, false
	}
	tot, err := usage.ParseTotals(e.Value())
	if err != nil {
		t.Fatal(err)
	}
	return tot, true
}

// TestUsageExactlyWhatClientsSaw: decisions with decimal costs, a retried
// request_id, an unmatched descriptor and dry runs; the usage stream holds
// one record per decision that is neither a dry run nor a remembered
// retry, the ledger's totals equal what the client saw to the micro-unit,
// and `limitmesh usage report` prints those totals.
func TestUsageExactlyWhatClientsSaw(t *testing.T) {
	e := server(t, t.TempDir())
	tn := startNode(t, e, mesh.NodeConfig{UsageInterval: 50 * time.Millisecond, LeaseTime: ownershipLease})
	rev := putPolicy(t, tn.nc, "rl_policies", "metered",
		`{"match":{"tenant":"*"},"key":["tenant"],"limits":[{"algorithm":"token_bucket","rate":"1/h","burst":10}]}`)
	desc := map[string]string{"tenant": "acme", "plan": "v7"}
	waitRevision(t, tn.nc, desc, rev)

	var allowed, denied int
	var allowedMicro, deniedMicro int64
	costs := []string{`"2.5"`, `1`, `"0.000001"`, `3`, `"4.25"`, `2`} // 12.750001 > 10: the last ones deny
	micro := []int64{2_500_000, 1_000_000, 1, 3_000_000, 4_250_000, 2_000_000}
	for i, c := range costs {
		r := decide(t, tn.nc, "rl.v1.decide", req(desc, `"cost":`+c))
		if r.Code != "" {
			t.Fatalf("decision %d: %+v", i, r)
		}
		if r.Allowed {
			allowed++
			allowedMicro += micro[i]
		} else {
			denied++
			deniedMicro += micro[i]
		}
	}
	// A retry of a request_id is answered from memory: one record.
	first := decide(t, tn.nc, "rl.v1.decide", req(desc, `"cost":"0.5","request_id":"r-1"`))
	again := decide(t, tn.nc, "rl.v1.decide", req(desc, `"cost":"0.5","request_id":"r-1"`))
	if first.Allowed != again.Allowed || first.Remaining != again.Remaining {
		t.Fatalf("retry answered differently: %+v then %+v", first, again)
	}
	if first.Allowed {
		allowed++
		allowedMicro += 500_000
	} else {
		denied++
		deniedMicro += 500_000
	}
	// Dry runs: no record.
	for range 3 {
		decide(t, tn.nc, "rl.v1.decide", req(desc, `"dry_run":true`))
	}
	// Unmatched: on rl.usage._.
	if r := decide(t, tn.nc, "rl.v1.decide", req(map[string]string{"other": "x"}, `"cost":"1.5"`)); !r.Allowed || r.Policy != "" {
		t.Fatalf("unmatched: %+v", r)
	}
	if allowed == 0 || denied == 0 {
		t.Fatalf("want admissions and denials: %d, %d", allowed, denied)
	}
	key := "p.metered.tenant=acme"

	waitFor(t, "every record in the stream", func() bool {
		recs := usageRecords(t, tn.nc)
		return len(recs["rl.usage.metered"]) == allowed+denied && len(recs["rl.usage._"]) == 1
	})
	recs := usageRecords(t, tn.nc)
	ids := map[string]bool{}
	var gotA, gotD int64
	for _, r := range recs["rl.usage.metered"] {
		if ids[r.ID] || r.Key != key || r.Revision != rev || len(r.Descriptor) != 2 {
			t.Fatalf("record %+v: duplicate id, wrong key, revision or descriptor", r)
		}
		ids[r.ID] = true
		if r.Allowed {
			gotA += r.Cost
		} else {
			gotD += r.Cost
		}
		if r.RequestID == "r-1" && r.Cost != 500_000 {
			t.Fatalf("the request_id's record: %+v", r)
		}
	}
	if gotA != allowedMicro || gotD != deniedMicro {
		t.Fatalf("stream: allowed %d denied %d micro-units, clients saw %d and %d", gotA, gotD, allowedMicro, deniedMicro)
	}
	if u := recs["rl.usage._"][0]; u.Cost != 1_500_000 || !u.Allowed || u.Key != "" {
		t.Fatalf("unmatched record %+v", u)
	}

	day := usage.Day(time.Now().UnixMicro())
	waitWithin(t, 30*time.Second, "the ledger's totals", func() bool {
		tot, ok := ledgerTotals(t, tn.nc, "metered", day, key)
		if !ok {
			return false
		}
		a, _ := usage.MicroUnits(&tot.AllowedUnits)
		d, _ := usage.MicroUnits(&tot.DeniedUnits)
		return tot.Allowed == int64(allowed) && tot.Denied == int64(denied) && a == allowedMicro && d == deniedMicro
	})
	var out, errOut bytes.Buffer
	code := cli.Main(context.Background(), []string{"usage", "report", "--policy", "metered", "--period", day,
		"--json", "--nats-url", e.ClientURL()}, nil, strings.NewReader(""), &out, &errOut)
	if code != 0 {
		t.Fatalf("usage report: exit %d: %s", code, errOut.String())
	}
	var entry struct {
		Allowed      int64  `json:"allowed"`
		AllowedUnits string `json:"allowed_units"`
		Denied       int64  `json:"denied"`
	}
	if err := json.Unmarshal([]byte(strings.TrimSpace(out.String())), &entry); err != nil ||
		entry.Allowed != int64(allowed) || entry.Denied != int64(denied) || entry.AllowedUnits != fmt.Sprint(float64(allowedMicro)/1e6) {
		t.Fatalf("usage report --json: %q (%v), want %d allowed (%d micro-units), %d denied", out.String(), err, allowed, allowedMicro, denied)
	}
}
