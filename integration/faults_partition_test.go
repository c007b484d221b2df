package integration

import (
	"fmt"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/mesh"
	"github.com/nats-io/nats.go"
)

// TestFaultPartition: three servers whose routes pass through proxies, a
// node and load on each. The server that leads the state stream is cut off
// from the other two: the majority side keeps deciding once a new leader
// is elected, the cut-off node answers 503 (it cannot commit a write), and
// after healing every side decides again. The hot key's limit denies most
// of the load throughout, and the stored state accounts for every
// admission on both sides (hotPolicy).
func TestFaultPartition(t *testing.T) {
	if testing.Short() {
		t.Skip("partition test: waits for a raft election (up to ~10 s)")
	}
	pc := startProxiedCluster(t, 3)
	nodes := make([]*testNode, 3)
	for i := range nodes {
		// Each node and each client stays on its own server: the cut-off
		// side is the cut-off server with its node and clients.
		nodes[i] = startNodeRetry(t, mesh.NodeConfig{Replicas: 3, Logger: faultLog(t, fmt.Sprint(i))}, pc.URL(i))
	}
	rev := putPolicy(t, nodes[0].nc, "rl_policies", "hot", hotPolicy)
	waitApplied(t, "hot", rev, nodes...)
	conns := make([][]*nats.Conn, 3)
	for i := range conns {
		conns[i] = []*nats.Conn{connectURLs(t, pc.URL(i)), connectURLs(t, pc.URL(i))}
		waitRevision(t, conns[i][0], hotDesc, rev)
	}
	acct := prespend(t, conns[0][0])
	leader := waitStateLeader(t, conns[0][0])
	k := -1
	for i := range pc.servers {
		if pc.servers[i].Name() == leader {
			k = i
		}
	}
	if k < 0 {
		t.Fatalf("state stream leader %q is none of the servers", leader)
	}
	var majority []*nats.Conn
	for i := range conns {
		if i != k {
			majority = append(majority, conns[i]...)
		}
	}
	maj := startLoad(t, majority, hotDesc)
	minor := startLoad(t, conns[k], hotDesc)
	maj.waitDecisions(t, loadStats{}, 200, faultTimeout, "warm-up, majority")
	minor.waitDecisions(t, loadStats{}, 50, faultTimeout, "warm-up, cut-off side")

	// Cut the leader's server off.
	maj.resetGap()
	m0, n0 := maj.stats(), minor.stats()
	pc.Isolate(t, k)
	cutAt := time.Now()
	maj.waitDecisions(t, maj.stats(), 200, faultTimeout, "majority after the cut")
	mCut := maj.stats().sub(m0)
	t.Logf("server %s cut off; majority decides again %s after the cut: %v",
		leader, time.Since(cutAt).Round(time.Millisecond), mCut)
	// Requests in flight at the instant of the cut may go unanswered
	// (observed: 0-2 per run on each side, even with a 5 s client
	// timeout); every reply a node sent is a decision or a 503.
	requireClean(t, "majority during the cut", mCut, true)
	// The cut-off side: its node gets no write committed, so it answers
	// 503 (once a request there has waited out its decision deadline).
	waitWithin(t, faultTimeout, "503s on the cut-off side", func() bool { return minor.stats().unavailable > n0.unavailable })
	nCut := minor.stats().sub(n0)
	t.Logf("cut-off side during the cut: %v", nCut)
	requireClean(t, "cut-off side during the cut", nCut, true)
	if nCut.admitted > 0 {
		t.Logf("the cut-off side was admitted %d after the cut (writes committed just before it)", nCut.admitted)
	}

	// Heal: both sides decide again. Requests in flight at the cut are
	// given up by their clients one request timeout after it at the latest
	// (the majority may decide again well before): count them in the cut,
	// not after healing.
	time.Sleep(time.Until(cutAt.Add(faultRequestTimeout + 100*time.Millisecond)))
	m1, n1 := maj.stats(), minor.stats()
	maj.resetGap()
	minor.resetGap()
	pc.Heal(t, k)
	healAt := time.Now()
	minor.waitDecisions(t, n1, 100, faultTimeout, "cut-off side after healing")
	maj.waitDecisions(t, m1, 100, faultTimeout, "majority after healing")
	t.Logf("healed; the cut-off side decides again %s after healing", time.Since(healAt).Round(time.Millisecond))
	maj.stop()
	minor.stop()
	mHeal, nHeal := maj.stats().sub(m1), minor.stats().sub(n1)
	t.Logf("after healing: majority %v; formerly cut-off side %v", mHeal, nHeal)
	requireClean(t, "majority after healing", mHeal, false)
	requireClean(t, "formerly cut-off side after healing", nHeal, false)

	a, b := maj.stats(), minor.stats()
	t.Logf("whole run: majority %v; cut-off side %v", a, b)
	checkAccounting(t, conns[(k+1)%3][0], acct, a.admitted+b.admitted, a.failed()+b.failed())
}
