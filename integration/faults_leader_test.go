package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/mesh"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// stateLeader returns the server name of the KV_rl_state stream leader
// ("" while there is none or the request fails).
func stateLeader(nc *nats.Conn) string {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	js, _ := jetstream.New(nc)
	s, err := js.Stream(ctx, "KV_rl_state")
	if err != nil {
		return ""
	}
	info, err := s.Info(ctx)
	if err != nil || info.Cluster == nil {
		return ""
	}
	return info.Cluster.Leader
}

// waitStateLeader polls until the KV_rl_state stream has a leader and
// returns its server name.
func waitStateLeader(t *testing.T, nc *nats.Conn) string {
	t.Helper()
	var leader string
	waitWithin(t, faultTimeout, "a state stream leader", func() bool {
		leader = stateLeader(nc)
		return leader != ""
	})
	return leader
}

// TestFaultStreamLeaderFailover: three servers, R3 buckets, a node on each,
// load on one hot key through every server, its limit denying most of it.
// The state stream's leader steps down, then the new leader's server shuts
// down. Decisions resume after each (the longest gap is logged), the limit
// denies during each, every failure a node answers is a clean 503, and the
// stored state accounts for every admission (hotPolicy).
func TestFaultStreamLeaderFailover(t *testing.T) {
	servers := embeddedCluster(t, 3)
	urls := make([]string, len(servers))
	for i, s := range servers {
		urls[i] = s.ClientURL()
	}
	// rotate(i) lists the URLs starting with server i's.
	rotate := func(i int) []string { return append(slices.Clone(urls[i:]), urls[:i]...) }
	nodes := make([]*testNode, len(servers))
	for i := range servers {
		nodes[i] = startNodeRetry(t, mesh.NodeConfig{Replicas: 3, Logger: faultLog(t, fmt.Sprint(i))}, rotate(i)...)
	}
	rev := putPolicy(t, nodes[0].nc, "rl_policies", "hot", hotPolicy)
	waitApplied(t, "hot", rev, nodes...)
	var conns []*nats.Conn
	for i := range servers {
		nc := connectURLs(t, rotate(i)...)
		waitRevision(t, nc, hotDesc, rev)
		conns = append(conns, nc, connectURLs(t, rotate(i)...))
	}
	admin := connectURLs(t, urls...)

	acct := prespend(t, conns[0])
	l := startLoad(t, conns, hotDesc)
	l.waitDecisions(t, loadStats{}, 200, faultTimeout, "warm-up")

	// 1. The stream leader steps down.
	before := waitStateLeader(t, admin)
	l.resetGap()
	s0 := l.stats()
	m, err := admin.Request("$JS.API.STREAM.LEADER.STEPDOWN.KV_rl_state", nil, testTimeout)
	if err != nil {
		t.Fatalf("leader stepdown: %v", err)
	}
	var sd struct {
		Success bool `json:"success"`
	}
	if json.Unmarshal(m.Data, &sd); !sd.Success {
		t.Fatalf("leader stepdown: %s", m.Data)
	}
	var after string
	waitWithin(t, faultTimeout, "a new state stream leader", func() bool {
		after = stateLeader(admin)
		return after != "" && after != before
	})
	l.waitDecisions(t, l.stats(), 200, faultTimeout, "after the stepdown")
	s1 := l.stats()
	d1 := s1.sub(s0)
	t.Logf("stepdown %s -> %s: %v", before, after, d1)
	requireClean(t, "stepdown", d1, false)

	// 2. The new leader's server goes away (its node reconnects to another
	// server; so do the clients that used it).
	l.resetGap()
	var victim int
	for i, s := range servers {
		if s.Server().Name() == after {
			victim = i
		}
	}
	servers[victim].Shutdown()
	var third string
	waitWithin(t, faultTimeout, "a leader on a surviving server", func() bool {
		third = stateLeader(admin)
		return third != "" && third != after
	})
	l.waitDecisions(t, l.stats(), 200, faultTimeout, "after the leader's server shut down")
	l.stop()
	s2 := l.stats()
	d2 := s2.sub(s1)
	t.Logf("leader server %s shut down, new leader %s: %v", after, third, d2)
	// Clients of the stopped server lose requests in flight; every reply
	// a node sent is a decision or a 503.
	requireClean(t, "leader shutdown", d2, true)

	total := l.stats()
	t.Logf("whole run: %v", total)
	checkAccounting(t, admin, acct, total.admitted, total.failed())
}
