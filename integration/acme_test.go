package integration

import (
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/mesh"
	"github.com/nats-io/nats.go"
)

// TestAcmeBurst: 80 simultaneous requests over six connections admit
// exactly 40 (the burst), and every denial says when to retry: within one
// token's refill time (100 ms at 10/s). The node's clock stands still
// during the burst, so the count is exact however slowly a loaded machine
// delivers the 80 requests (with a running clock, a burst that takes
// longer than 100 ms would rightly admit a 41st request).
func TestAcmeBurst(t *testing.T) {
	e := server(t, t.TempDir())
	frozen := time.Now()
	tn := startNode(t, e, mesh.NodeConfig{Clock: func() time.Time { return frozen }})
	rev := putPolicy(t, tn.nc, "rl_policies", "acme-search", acmePolicy)
	waitFor(t, "policy applied", func() bool {
		return decide(t, tn.nc, "rl.v1.decide", req(map[string]string{"tenant": "acme", "operation": "search", "plan": "probe"}, `"dry_run":true`)).Revision == rev
	})

	conns := make([]*nats.Conn, 6)
	for i := range conns {
		conns[i] = connect(t, e)
	}
	const n = 80
	replies := burstReplies(t, conns, acmeDesc, n)
	admitted := 0
	for _, r := range replies {
		if r.Code != "" {
			t.Fatalf("error reply: %+v", r)
		}
		if r.Policy != "acme-search" || r.Revision != rev {
			t.Fatalf("reply not attributed to acme-search@%d: %+v", rev, r)
		}
		if r.Allowed {
			admitted++
			continue
		}
		if r.RetryAfterMs != 100 {
			t.Errorf("denial retry_after_ms = %d, want 100: one token's refill at 10/s, the clock standing still", r.RetryAfterMs)
		}
	}
	if admitted != 40 {
		t.Fatalf("admitted %d of %d, want exactly 40", admitted, n)
	}
	if v := metricValue(t, tn, `limitmesh_decisions_total{policy="acme-search",result="allowed"}`); v != 40 {
		t.Errorf("allowed metric = %v, want 40", v)
	}
	if v := metricValue(t, tn, `limitmesh_decisions_total{policy="acme-search",result="denied"}`); v != 40 {
		t.Errorf("denied metric = %v, want 40", v)
	}
}
