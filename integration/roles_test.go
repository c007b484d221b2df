package integration

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nats.go/micro"

	"github.com/limitmesh/limitmesh/mesh"
)

// rolesCandidate is a shadow candidate on slowPolicy's descriptors: a
// burst of 10 where the live policy has 40.
const rolesCandidate = `{"match": {"tenant": "*"}, "key": ["tenant"],
 "limits": [{"algorithm": "token_bucket", "rate": "1/h", "burst": 10}], "shadow": true}`

// TestProcessRoles: three serve processes forming one JetStream cluster,
// one with --roles ledger,shadow and two with --roles decide (CONTRACT.md
// §13). Decisions sent through every process's server, the ledger node's
// included, are decided by the two deciding nodes alone and admit exactly
// the burst; every partition is owned, and only by them; the ledger's
// entries and the candidate's summary appear, written by the ledger node,
// the only one that runs the reconciler and the evaluator. Each node
// reports its roles in limitmesh_node_info, and the deciding nodes in the
// micro service's metadata; the ledger node runs no micro service.
func TestProcessRoles(t *testing.T) {
	if testing.Short() {
		t.Skip("three processes")
	}
	ids := []string{"ledger", "d1", "d2"}
	roles := []string{"ledger,shadow", "decide", "decide"}
	procs := startProcs(t, procSpec{n: 3, each: [][]string{
		{"--node-id", ids[0], "--roles", roles[0]},
		{"--node-id", ids[1], "--roles", roles[1]},
		{"--node-id", ids[2], "--roles", roles[2]},
	}})
	ledger, deciders := procs[0], procs[1:]
	admin := connectURLs(t, clientURLs(procs)...)
	js, _ := jetstream.New(admin)

	// The roles each process reports.
	for i, p := range procs {
		series := fmt.Sprintf(`limitmesh_node_info{node=%q,roles=%q,version=%q}`, ids[i], roles[i], mesh.Version)
		if v := procMetric(t, p, series); v != 1 {
			t.Errorf("%s: %s = %v, want 1", p.name, series, v)
		}
		if !strings.Contains(p.stderr.String(), "roles="+roles[i]) {
			t.Errorf("%s logged no roles=%s", p.name, roles[i])
		}
	}
	checkMicroRoles(t, admin, ids[1:])

	// Partitions: every one owned, by a deciding node; the ledger node
	// owns none.
	waitFor(t, "every partition owned by d1 or d2, the two owning all 64 between them", func() bool {
		for part := range mesh.DefaultPartitions {
			if o := partOwner(admin, part); o != "d1" && o != "d2" {
				return false
			}
		}
		return procMetric(t, deciders[0], "limitmesh_owned_partitions")+
			procMetric(t, deciders[1], "limitmesh_owned_partitions") == mesh.DefaultPartitions
	})
	if v, ok, err := procMetricValue(ledger, "limitmesh_owned_partitions"); err != nil || !ok || v != 0 {
		t.Errorf("ledger node: limitmesh_owned_partitions %v (present %v, %v), want 0", v, ok, err)
	}

	// The reconciler and the evaluator run on the ledger node only (their
	// metrics are registered where they run).
	waitFor(t, "the ledger node to lead the ledger and the evaluator", func() bool {
		v, ok, _ := procMetricValue(ledger, "limitmesh_shadow_leader")
		return ok && v == 1 && ledgerLeader(js) == "ledger" && shadowLeader(js) == "ledger"
	})
	for _, p := range deciders {
		for _, series := range []string{"limitmesh_shadow_leader", "limitmesh_usage_lag_seconds"} {
			if _, ok, err := procMetricValue(p, series); err != nil || ok {
				t.Errorf("%s (decide only) reports %s (%v): it runs no reconciler or evaluator", p.name, series, err)
			}
		}
	}

	// A live policy and a candidate, taken up by the evaluator before the
	// traffic (a candidate counts what is evaluated after that).
	rev := putPolicy(t, admin, "rl_policies", "slow", slowPolicy)
	crev := putPolicy(t, admin, "rl_policies", "slow-v2", rolesCandidate)
	waitProcsApplied(t, "slow", rev, procs...)
	waitFor(t, "the evaluator to take the candidate up", func() bool {
		return storedSummaries(js, []string{"slow-v2"})["slow-v2"].Revision == crev
	})

	// 50 decisions of one key, through the three servers in turn.
	d := map[string]string{"tenant": "roles"}
	if admitted := admitInTurn(t, procs, d, rev, 50); admitted != 40 {
		t.Fatalf("admitted %d of 50 sequential requests, want the burst 40", admitted)
	}
	// Decided by the deciding nodes alone.
	var allowed, denied float64
	for _, p := range deciders {
		allowed += procMetric(t, p, `limitmesh_decisions_total{policy="slow",result="allowed"}`)
		denied += procMetric(t, p, `limitmesh_decisions_total{policy="slow",result="denied"}`)
	}
	if allowed != 40 || denied != 10 {
		t.Errorf("the deciding nodes decided %v allowed and %v denied, want 40 and 10", allowed, denied)
	}
	if _, ok, err := procMetricValue(ledger, `limitmesh_decisions_total{policy="slow",result="allowed"}`); err != nil || ok {
		t.Errorf("the ledger node reports decisions (%v)", err)
	}

	// The ledger (written by the ledger node's reconciler) and the
	// candidate's summary (its evaluator) count the 50 decisions.
	key := "p.slow.tenant=roles"
	waitFor(t, "the ledger to count the 50 decisions", func() bool {
		l, err := ledgerUsage(js, "slow")
		if err != nil {
			return false
		}
		s := byKey(l)[key]
		return s.allowed == 40 && s.denied == 10
	})
	waitFor(t, "the candidate's summary to count the 50 decisions", func() bool {
		s := storedSummaries(js, []string{"slow-v2"})["slow-v2"]
		return s.Evaluated == 50 && s.WouldAllow == 10 && s.WouldDeny == 40 && s.LiveDenied == 10
	})
	if l, s := ledgerLeader(js), shadowLeader(js); l != "ledger" || s != "ledger" {
		t.Errorf("the ledger's lease is held by %q and the evaluator's by %q, want both by the ledger node", l, s)
	}
}

// checkMicroRoles asks every instance of the micro service for its info
// and fails unless exactly the nodes in want answer, each with its node
// id and the roles "decide" in the metadata. The answers of the instances
// arrive together; once every wanted node has answered, a second more is
// given to any other instance (a node without decide must not be one).
func checkMicroRoles(t *testing.T, nc *nats.Conn, want []string) {
	t.Helper()
	inbox := nats.NewInbox()
	sub, err := nc.SubscribeSync(inbox)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	if err := nc.PublishRequest("$SRV.INFO."+mesh.ServiceName, inbox, nil); err != nil {
		t.Fatal(err)
	}
	var got []string
	deadline := time.Now().Add(testTimeout)
	for {
		wait := time.Until(deadline)
		if len(got) >= len(want) {
			wait = min(wait, time.Second)
		}
		m, err := sub.NextMsg(wait)
		if err != nil {
			break
		}
		var info micro.Info
		if err := json.Unmarshal(m.Data, &info); err != nil {
			t.Fatalf("service info %s: %v", m.Data, err)
		}
		if r := info.Metadata[mesh.MetadataRoles]; r != "decide" {
			t.Errorf("service info of node %q: roles %q, want decide", info.Metadata[mesh.MetadataNode], r)
		}
		got = append(got, info.Metadata[mesh.MetadataNode])
	}
	slices.Sort(got)
	if !slices.Equal(got, want) {
		t.Errorf("micro service instances of nodes %q, want %q", got, want)
	}
}
