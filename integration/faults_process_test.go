package integration

import (
	"context"
	"encoding/json"
	"regexp"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// procCluster starts three serve processes, applies hotPolicy and returns
// them with two client connections per process (each on that process's
// server first, failing over to the others).
func procCluster(t *testing.T) ([]*proc, [][]*nats.Conn) {
	t.Helper()
	procs := startProcs(t, procSpec{n: 3})
	var urls []string
	for _, p := range procs {
		urls = append(urls, p.clientURL)
	}
	rev := putPolicy(t, connectURLs(t, urls...), "rl_policies", "hot", hotPolicy)
	waitProcsApplied(t, "hot", rev, procs...)
	conns := make([][]*nats.Conn, len(procs))
	for i := range procs {
		rot := append(slices.Clone(urls[i:]), urls[:i]...)
		conns[i] = []*nats.Conn{connectURLs(t, rot...), connectURLs(t, rot...)}
		waitRevision(t, conns[i][0], hotDesc, rev)
	}
	return procs, conns
}

// TestFaultRollingRestart: under load on one hot key, every serve process
// in turn gets SIGTERM (it drains and exits 0) and is restarted with the
// same --data; decisions continue (the longest gap of each step is
// logged) and the stored state accounts for every admission.
func TestFaultRollingRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("rolling restart of three processes")
	}
	procs, conns := procCluster(t)
	l := startLoad(t, slices.Concat(conns...), hotDesc)
	l.waitDecisions(t, loadStats{}, 200, testTimeout, "warm-up")
	for _, p := range procs {
		l.resetGap()
		s0 := l.stats()
		leader := stateLeader(conns[0][0])
		start := time.Now()
		p.stop()
		p.restart()
		l.waitDecisions(t, l.stats(), 200, 3*testTimeout, "after restarting "+p.name)
		d := l.stats().sub(s0)
		t.Logf("%s (state stream leader before: %s) restarted in %s: %v", p.name, leader, time.Since(start).Round(time.Millisecond), d)
		// Clients of the stopping server lose requests in flight when it
		// closes their connection; nodes answer decisions or 503s only.
		requireClean(t, "restart of "+p.name, d, true)
	}
	l.stop()
	total := l.stats()
	t.Logf("whole run: %v", total)
	checkAccounting(t, conns[0][0], total.admitted, total.failed())
}

var nodeIDLine = regexp.MustCompile(`msg="node serving".* node=([A-Za-z0-9_-]+)`)

// nodeID is the node id the process logged when it started serving.
func (p *proc) nodeID(t *testing.T) string {
	t.Helper()
	m := nodeIDLine.FindAllStringSubmatch(p.stderr.String(), -1)
	if len(m) == 0 {
		t.Fatalf("%s logged no node id", p.name)
	}
	return m[len(m)-1][1]
}

// partitionOf is the partition of a limit key among 64 (FNV-1a 32 of the
// key, docs/protocol.md).
func partitionOf(key string) int {
	h := uint32(2166136261)
	for i := 0; i < len(key); i++ {
		h ^= uint32(key[i])
		h *= 16777619
	}
	return int(h % 64)
}

// partOwner reads the node id in the shards bucket's part.<n> entry (""
// when there is none or it cannot be read).
func partOwner(nc *nats.Conn, part int) string {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	js, _ := jetstream.New(nc)
	kv, err := js.KeyValue(ctx, "rl_shards")
	if err != nil {
		return ""
	}
	e, err := kv.Get(ctx, "part."+strconv.Itoa(part))
	if err != nil {
		return ""
	}
	var v struct {
		Node string `json:"node"`
	}
	if json.Unmarshal(e.Value(), &v) != nil {
		return ""
	}
	return v.Node
}

// TestFaultKillOwner: three serve processes; a burst of load on one hot
// key through the two processes that do not own the key's partition; the
// owner gets SIGKILL (its embedded server dies with it). Another node
// takes the partition over, decisions resume (the gap is logged), and the
// stored state still holds every admission made before the kill: no
// admission beyond the contract across the failover.
func TestFaultKillOwner(t *testing.T) {
	if testing.Short() {
		t.Skip("kill test with three processes")
	}
	procs, conns := procCluster(t)
	part := partitionOf("p.hot.tenant=hot")
	var owner int
	waitFor(t, "an owner of the hot key's partition", func() bool {
		id := partOwner(conns[0][0], part)
		for i, p := range procs {
			if p.nodeID(t) == id {
				owner = i
				return true
			}
		}
		return false
	})
	ownerID := procs[owner].nodeID(t)
	var others []*nats.Conn
	var survivor *nats.Conn
	for i := range procs {
		if i != owner {
			others = append(others, conns[i]...)
			survivor = conns[i][0]
		}
	}
	l := startLoad(t, others, hotDesc)
	l.waitDecisions(t, loadStats{}, 300, testTimeout, "burst before the kill")

	l.resetGap()
	before := l.stats()
	leader := stateLeader(survivor)
	procs[owner].kill()
	killedAt := time.Now()
	var newOwner string
	// The killed process took a JetStream server with it: if it led the
	// shards stream, an election (up to 9 s) comes before the lease (3 s)
	// can even be renewed or claimed, so this wait is longer than others.
	deadline := time.Now().Add(3 * testTimeout)
	for {
		newOwner = partOwner(survivor, part)
		if newOwner != "" && newOwner != ownerID {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no new owner of partition %d within %v of the kill", part, 3*testTimeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
	l.waitDecisions(t, l.stats(), 200, 3*testTimeout, "after killing the owner")
	resumed := time.Since(killedAt)
	l.stop()
	after := l.stats().sub(before)
	t.Logf("owner %s (%s) killed; partition %d now owned by %s; 200 decisions within %s of the kill: %v",
		procs[owner].name, ownerID, part, newOwner, resumed.Round(time.Millisecond), after)
	t.Logf("before the kill: admitted %d; state stream leader at the kill: %s", before.admitted, leader)
	requireClean(t, "after the kill", after, true)
	total := l.stats()
	checkAccounting(t, survivor, total.admitted, total.failed())
}
