package integration

import (
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/mesh"
	"github.com/nats-io/nats.go"
)

// The leased-mode tests (CONTRACT §8): nodes hold grants of a leased key
// and answer plain decide requests from them; gateways (the Go SDK) hold
// sub-grants and spend locally; owners account for every grant in the
// key's journalled record.

// leasedPolicy is Acme's contract in leased mode: 10/s, burst 40, grants of
// 10 for 2 s, at most 40 outstanding: the bound is 40.
const leasedPolicy = `{"match": {"tenant": "*"}, "key": ["tenant"], "mode": "leased",
 "lease": {"size": 10, "ttl": "2s", "max_outstanding": 40},
 "limits": [{"name": "rate", "algorithm": "token_bucket", "rate": "10/s", "burst": 40}]}`

const (
	leasedRate  = 10.0
	leasedBurst = 40.0
	leasedBound = 40.0
)

func leasedKey(tenant string) string { return "p.leased.tenant=" + tenant }

// TestLeasedNodeGrants: one node; plain decide requests of a leased key are
// answered from the node's grant once it has one (the first goes to the
// owner, strict, while the node asks for a grant); 80 at once admit at most
// the burst plus the bound, and no more than the contract over the run.
func TestLeasedNodeGrants(t *testing.T) {
	e := server(t, t.TempDir())
	tn := startNode(t, e, mesh.NodeConfig{})
	rev := putPolicy(t, tn.nc, "rl_policies", "leased", leasedPolicy)
	waitApplied(t, "leased", rev, tn)
	start := time.Now()
	d := map[string]string{"tenant": "acme"}
	admitted := 0
	if r := decide(t, tn.nc, "rl.v1.decide", req(d, "")); !r.Allowed || r.Policy != "leased" {
		t.Fatalf("first request: %+v", r)
	}
	admitted++
	waitFor(t, "a request answered from the node's grant", func() bool {
		if r := decide(t, tn.nc, "rl.v1.decide", req(d, "")); r.Allowed {
			admitted++
		}
		return metricValue(t, tn, `limitmesh_lease_local_decisions_total{policy="leased",result="allowed"}`) > 0
	})
	conns := []*nats.Conn{tn.nc, connect(t, e), connect(t, e)}
	for _, r := range burstReplies(t, conns, d, 80) {
		if r.Code != "" {
			t.Fatalf("burst: %+v", r)
		}
		if r.Allowed {
			admitted++
		}
	}
	elapsed := time.Since(start).Seconds()
	if limit := leasedBurst + leasedRate*elapsed + leasedBound; float64(admitted) > limit {
		t.Fatalf("admitted %d in %.2fs, contract plus bound %.1f", admitted, elapsed, limit)
	}
	t.Logf("admitted %d in %.2fs; local %v, grants %v", admitted, elapsed,
		metricValue(t, tn, `limitmesh_lease_local_decisions_total{policy="leased",result="allowed"}`),
		metricValue(t, tn, `limitmesh_lease_grants_total{result="granted"}`))
}
