package integration

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/micro"

	"github.com/limitmesh/limitmesh/usage"
)

// acmeQuotaPolicy is Acme's contract with its monthly quota: 10/s with a
// burst of 40, and (scaled down for the test) 10 units a month.
const acmeQuotaPolicy = `{"match": {"tenant": "acme", "operation": "search"},
 "key": ["tenant", "operation", "plan"],
 "limits": [{"name": "rate", "algorithm": "token_bucket", "rate": "10/s", "burst": 40},
            {"name": "monthly", "algorithm": "quota", "limit": 10, "period": "month"}]}`

// startSingleProc starts one `limitmesh serve` process with an embedded
// server of its own (no cluster), waits until it is ready and kills it at
// cleanup.
func startSingleProc(t *testing.T, extra ...string) *proc {
	t.Helper()
	bin := buildBinary(t)
	ports := freePorts(t, 2)
	p := &proc{
		t:         t,
		name:      "n1",
		clientURL: fmt.Sprintf("nats://127.0.0.1:%d", ports[0]),
		httpURL:   fmt.Sprintf("http://127.0.0.1:%d", ports[1]),
		stderr:    &syncBuffer{},
	}
	p.args = append([]string{"serve",
		"--nats-listen", fmt.Sprintf("127.0.0.1:%d", ports[0]),
		"--http", fmt.Sprintf("127.0.0.1:%d", ports[1]),
		"--data", t.TempDir(),
		"--drain-timeout", "5s",
	}, extra...)
	p.start(bin)
	t.Cleanup(func() {
		p.kill()
		if t.Failed() {
			t.Logf("stderr of %s (last 6 kB):\n%s", p.name, tail(p.stderr.String(), 6<<10))
		}
	})
	p.waitReady()
	return p
}

// TestUsageQuotaExhaustedAcrossRestart: Acme's monthly quota is spent (at
// a decimal cost) and a request is denied; the serve process is SIGKILLed
// right after, while the usage of its last admissions is still in memory
// (records wait up to 5 s, and nothing is checkpointed) and restarted with
// the same data. The quota is still exhausted; the restarted node adopts
// the journal, publishes the admissions again with their ids, and the
// ledger counts each once: its month entry equals the quota's limit, the
// reconciler compares it with the quota state and finds no difference.
func TestUsageQuotaExhaustedAcrossRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("process restart")
	}
	p := startSingleProc(t, "--usage-interval", "5s", "--checkpoint-interval", "1h")
	nc := connectURLs(t, p.clientURL)
	rev := putPolicy(t, nc, "rl_policies", "acme-search", acmeQuotaPolicy)
	waitProcsApplied(t, "acme-search", rev, p)
	waitRevision(t, nc, acmeDesc, rev)
	key := "p.acme-search.operation=search.plan=v7.tenant=acme"
	month := usage.Month(time.Now().UnixMicro())
	spend := func(n int, allowed bool) {
		t.Helper()
		for i := 0; i < n; i++ {
			r := decide(t, nc, "rl.v1.decide", req(acmeDesc, `"cost":"2.5"`))
			if r.Code != "" || r.Allowed != allowed {
				t.Fatalf("decision %d: %+v, want allowed %v", i, r, allowed)
			}
		}
	}
	spend(2, true)
	waitWithin(t, 3*testTimeout, "the first 5 units in the ledger", func() bool {
		tot, ok := ledgerTotals(t, nc, "acme-search", month, key)
		return ok && tot.Allowed == 2
	})
	spend(2, true)
	spend(1, false)
	before, _ := ledgerTotals(t, nc, "acme-search", month, key)
	p.kill()
	t.Logf("killed with %d admissions (%s units) in the ledger", before.Allowed, before.AllowedUnits.String())
	p.restart()

	// Still exhausted (after the restarted node adopted the partition:
	// 503s until then).
	var r reply
	waitWithin(t, 3*testTimeout, "a decision after the restart", func() bool {
		m, err := nc.Request("rl.v1.decide", []byte(req(acmeDesc, `"cost":"0.000001"`)), faultRequestTimeout)
		if err != nil || m.Header.Get(micro.ErrorCodeHeader) != "" {
			return false
		}
		r = reply{}
		return json.Unmarshal(m.Data, &r) == nil
	})
	if r.Allowed || r.Policy != "acme-search" || r.RetryAfterMs <= 0 {
		t.Fatalf("after the restart: %+v, want denied by the exhausted quota until next month", r)
	}
	waitWithin(t, 6*testTimeout, "the ledger to count the quota's 10 units once", func() bool {
		tot, ok := ledgerTotals(t, nc, "acme-search", month, key)
		a, _ := usage.MicroUnits(&tot.AllowedUnits)
		if ok && (tot.Allowed > 4 || a > 10_000_000) {
			t.Fatalf("the ledger counts %d admissions (%s units): more than the 4 (10 units) made", tot.Allowed, tot.AllowedUnits.String())
		}
		return ok && tot.Allowed == 4 && a == 10_000_000
	})
	if before.Allowed == 4 {
		// Everything was published before the kill: the restarted node's
		// reconciler has nothing new of the key to compare.
		t.Logf("the ledger held every admission before the kill; no comparison after the restart")
		return
	}
	// The restarted node's reconciler counted the republished admissions
	// and compares the key with its quota state once it settles.
	waitWithin(t, 6*testTimeout, "the reconciler comparing the key with its quota", func() bool {
		v, err := procMetricErr(p, `limitmesh_reconcile_checks_total{policy="acme-search"}`)
		return err == nil && v >= 1
	})
	if v, err := procMetricErr(p, `limitmesh_reconcile_corrections_total{policy="acme-search"}`); err != nil || v != 0 {
		t.Errorf("limitmesh_reconcile_corrections_total = %v (%v), want 0: the ledger and the quota state differ", v, err)
	}
}
