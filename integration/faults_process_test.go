package integration

import (
	"context"
	"encoding/json"
	"fmt"
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
	urls := clientURLs(procs)
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
// logged), the hot key's limit denies during each step, and the stored
// state accounts for every admission (hotPolicy).
func TestFaultRollingRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("rolling restart of three processes")
	}
	procs, conns := procCluster(t)
	acct := prespend(t, conns[0][0])
	l := startLoad(t, slices.Concat(conns...), hotDesc)
	l.waitDecisions(t, loadStats{}, 200, faultTimeout, "warm-up")
	for _, p := range procs {
		l.resetGap()
		s0 := l.stats()
		leader := stateLeader(conns[0][0])
		start := time.Now()
		p.stop()
		p.restart()
		l.waitDecisions(t, l.stats(), 200, faultTimeout, "after restarting "+p.name)
		d := l.stats().sub(s0)
		t.Logf("%s (state stream leader before: %s) restarted in %s: %v", p.name, leader, time.Since(start).Round(time.Millisecond), d)
		// Clients of the stopping server lose requests in flight when it
		// closes their connection; nodes answer decisions or 503s only.
		requireClean(t, "restart of "+p.name, d, true)
	}
	l.stop()
	total := l.stats()
	t.Logf("whole run: %v", total)
	checkAccounting(t, conns[0][0], acct, total.admitted, total.failed())
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

// partOwner reads the node id in the shards bucket's part.<n> entry (""
// when there is none or it cannot be read).
func partOwner(nc *nats.Conn, part int) string {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
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

// hotDecided is the number of decisions of the hot policy a process made
// itself (not forwarded), from its /metrics.
func hotDecided(t *testing.T, p *proc) float64 {
	t.Helper()
	return procMetric(t, p, `limitmesh_decisions_total{policy="hot",result="allowed"}`) +
		procMetric(t, p, `limitmesh_decisions_total{policy="hot",result="denied"}`)
}

// TestFaultKillOwner: three serve processes; load on one hot key (its
// limit denying most of it) through the two processes that do not own the
// key's partition; the owner gets SIGKILL (its embedded server dies with
// it). The partition comes from the replies' "partition" hint, its owner
// from the shards bucket, and the test proves it killed that owner: before
// the kill, every decision of the key was made by the process it kills
// (its decisions counter), the two others decided none and forwarded.
// Another node takes the partition over and decides, decisions resume (the
// gap is logged), the limit denies after the kill, and the stored state
// accounts for every admission across the failover: no admission beyond
// the contract.
func TestFaultKillOwner(t *testing.T) {
	if testing.Short() {
		t.Skip("kill test with three processes")
	}
	procs, conns := procCluster(t)
	hint := decide(t, conns[0][0], "rl.v1.decide", req(hotDesc, `"dry_run":true`))
	part := hint.Partition
	if hint.Code != "" || part < 0 {
		t.Fatalf("dry run %+v: want a decision with the partition hint", hint)
	}
	owner := -1
	waitFor(t, "an owner of the hot key's partition", func() bool {
		owner = procOfNode(t, procs, partOwner(conns[0][0], part))
		return owner >= 0
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
	acct := prespend(t, survivor)
	l := startLoad(t, others, hotDesc)
	l.waitDecisions(t, loadStats{}, 300, faultTimeout, "burst before the kill")

	// The process about to be killed decides the key: it made at least
	// every decision the load has seen so far (it keeps deciding while the
	// counters are read), the two others made none and forwarded.
	before := l.stats()
	if !slices.Equal(before.partitions, []int{part}) {
		t.Fatalf("the load's decisions carry partitions %v, want only %d", before.partitions, part)
	}
	for i, p := range procs {
		decided := hotDecided(t, p)
		forwarded := procMetric(t, p, `limitmesh_forwarded_total{outcome="ok"}`)
		switch {
		case i == owner && decided < float64(before.ok()):
			t.Fatalf("%s (the partition's owner by the shards bucket) decided %v of the key, the load saw %d decisions", p.name, decided, before.ok())
		case i != owner && (decided != 0 || forwarded == 0):
			t.Fatalf("%s (not the owner) decided %v of the key and forwarded %v: the owner is not %s", p.name, decided, forwarded, procs[owner].name)
		}
	}
	if id := partOwner(survivor, part); id != ownerID {
		t.Fatalf("partition %d moved to %q before the kill", part, id)
	}

	l.resetGap()
	before = l.stats()
	leader := stateLeader(survivor)
	procs[owner].kill()
	killedAt := time.Now()
	newOwner := -1
	// The killed process took a JetStream server with it: if it led the
	// shards stream, an election comes before the lease can even be
	// renewed or claimed.
	waitWithin(t, faultTimeout, fmt.Sprintf("a new owner of partition %d", part), func() bool {
		newOwner = procOfNode(t, procs, partOwner(survivor, part))
		return newOwner >= 0 && newOwner != owner
	})
	l.waitDecisions(t, l.stats(), 200, faultTimeout, "after killing the owner")
	resumed := time.Since(killedAt)
	l.stop()
	after := l.stats().sub(before)
	t.Logf("owner %s (%s) killed; partition %d now owned by %s; 200 decisions within %s of the kill: %v",
		procs[owner].name, ownerID, part, procs[newOwner].name, resumed.Round(time.Millisecond), after)
	t.Logf("before the kill: %v; state stream leader at the kill: %s", before, leader)
	requireClean(t, "after the kill", after, true)
	if !slices.Equal(l.stats().partitions, []int{part}) {
		t.Errorf("the load's decisions carry partitions %v, want only %d", l.stats().partitions, part)
	}
	// The survivors decide the key now (their counters were 0 before the
	// kill). On a busy machine the partition may move once more between
	// the two (the first claim's lease lapses under load before it is
	// renewed), so the first new owner alone may have decided none of it.
	var survivorsDecided float64
	for i, p := range procs {
		if i != owner {
			d := hotDecided(t, p)
			survivorsDecided += d
			t.Logf("%s decided %v of the key after the kill", p.name, d)
		}
	}
	if survivorsDecided == 0 {
		t.Errorf("no survivor decided the key after the kill (the load saw %d decisions)", after.ok())
	}
	total := l.stats()
	checkAccounting(t, survivor, acct, total.admitted, total.failed())
}
