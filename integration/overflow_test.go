package integration

import (
	"context"
	"fmt"
	"testing"

	"github.com/limitmesh/limitmesh/mesh"
	"github.com/nats-io/nats.go/jetstream"
)

// cappedPolicy keeps at most 3 live keys per node (max_keys), each with a
// burst of 2 that does not refill within a test.
const cappedPolicy = `{"match": {"tenant": "*"}, "key": ["tenant"], "max_keys": 3,
 "limits": [{"name": "rate", "algorithm": "token_bucket", "rate": "1/h", "burst": 2}]}`

// TestMaxKeysOverflowMesh: on two nodes, each owner keeps 3 live keys of
// the policy; every other key shares the policy's one overflow key, which
// lives in one partition (so one node forwards its overflowing keys to the
// other), stays limited to the policy's limits, and is counted in
// limitmesh_overflow_total. Live keys keep their own state.
func TestMaxKeysOverflowMesh(t *testing.T) {
	e := server(t, t.TempDir())
	nodes := meshNodes(t, []*mesh.Embedded{e}, 2)
	rev := putPolicy(t, nodes[0].nc, "rl_policies", "capped", cappedPolicy)
	waitApplied(t, "capped", rev, nodes...)
	key := func(tenant string) string { return "p.capped.tenant=" + tenant }

	const tenants = 40
	live := map[string]bool{}
	perNode := make([]int, len(nodes))
	shards := readShards(t, nodes[0].nc)
	for k := range tenants {
		tenant := fmt.Sprintf("t%d", k)
		p := partitionOf(key(tenant))
		for i, n := range nodes {
			if shards[p].Node == n.id && perNode[i] < 3 {
				perNode[i]++
				live[tenant] = true
			}
		}
	}
	if perNode[0] < 3 || perNode[1] < 3 {
		t.Fatalf("live keys per node %v: each node must own 3 of the %d tenants' partitions", perNode, tenants)
	}
	overflowSum := func() float64 {
		return metricValue(t, nodes[0], `limitmesh_overflow_total{policy="capped"}`) +
			metricValue(t, nodes[1], `limitmesh_overflow_total{policy="capped"}`)
	}

	// Round 1: the live keys spend 1 of 2; the overflowing keys share the
	// overflow key's burst of 2.
	overflowAdmitted := 0
	for k := range tenants {
		tenant := fmt.Sprintf("t%d", k)
		r := decide(t, nodes[k%2].nc, "rl.v1.decide", req(map[string]string{"tenant": tenant}, ""))
		if r.Code != "" || r.Policy != "capped" {
			t.Fatalf("%s: %+v", tenant, r)
		}
		if want := partitionOf(key(tenant)); r.Partition != want {
			t.Fatalf("%s: partition hint %d, want its own key's %d", tenant, r.Partition, want)
		}
		switch {
		case live[tenant] && (!r.Allowed || r.Remaining != 1):
			t.Fatalf("live %s: %+v, want admitted with 1 left", tenant, r)
		case !live[tenant] && r.Allowed:
			overflowAdmitted++
		}
	}
	if overflowAdmitted != 2 {
		t.Fatalf("the overflowing keys were admitted %d times, want the overflow key's burst 2", overflowAdmitted)
	}
	if got, want := overflowSum(), float64(tenants-len(live)); got != want {
		t.Fatalf("limitmesh_overflow_total %v, want %v", got, want)
	}

	// Round 2: live keys have their last unit; the overflow key is spent.
	for k := range tenants {
		tenant := fmt.Sprintf("t%d", k)
		r := decide(t, nodes[(k+1)%2].nc, "rl.v1.decide", req(map[string]string{"tenant": tenant}, ""))
		if r.Code != "" || r.Allowed != live[tenant] {
			t.Fatalf("round 2, %s (live %v): %+v", tenant, live[tenant], r)
		}
	}
	if got, want := overflowSum(), float64(2*(tenants-len(live))); got != want {
		t.Fatalf("limitmesh_overflow_total %v, want %v", got, want)
	}
	// One state for all of them, stored under the overflow key.
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	js, _ := jetstream.New(nodes[0].nc)
	kv, err := js.KeyValue(ctx, "rl_state")
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the overflow key's state checkpointed", func() bool {
		_, err := kv.Get(ctx, "p.capped._overflow")
		return err == nil
	})
}
