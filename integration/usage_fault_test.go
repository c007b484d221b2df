package integration

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// The usage fault tests: three `serve` processes (an R3 JetStream cluster,
// records published every 100 ms) under load; one process is SIGKILLed.
// Afterwards the ledger must hold each record the stream holds exactly once
// (its totals equal the stream's records deduplicated by id), and for every
// key what clients saw: at least every admission they got, and at most
// those plus the requests they got no decision for (a strict write that
// landed while its client got a 503 or nothing is spent, and recorded).

// billedPolicy meters tenants: a strict limit no test exhausts.
const billedPolicy = `{"match": {"tenant": "*"}, "key": ["tenant"],
 "limits": [{"name": "rate", "algorithm": "token_bucket", "rate": "1/h", "burst": 1000000}]}`

// billedKey is the limit key of tenant under billedPolicy.
func billedKey(tenant string) string { return "p.billed.tenant=" + tenant }

// usageCluster is three serve processes with billedPolicy applied, and a
// client connection to all of them.
type usageCluster struct {
	procs []*proc
	conns [][]*nats.Conn // two per process, on it first
	admin *nats.Conn
	js    jetstream.JetStream
}

func startUsageCluster(t *testing.T) *usageCluster {
	t.Helper()
	procs := startProcs(t, procSpec{n: 3, extra: []string{"--usage-interval", "100ms"}})
	urls := clientURLs(procs)
	uc := &usageCluster{procs: procs, admin: connectURLs(t, urls...)}
	uc.js, _ = jetstream.New(uc.admin)
	rev := putPolicy(t, uc.admin, "rl_policies", "billed", billedPolicy)
	waitProcsApplied(t, "billed", rev, procs...)
	uc.conns = make([][]*nats.Conn, len(procs))
	for i := range procs {
		rot := append(slices.Clone(urls[i:]), urls[:i]...)
		uc.conns[i] = []*nats.Conn{connectURLs(t, rot...), connectURLs(t, rot...)}
		waitRevision(t, uc.conns[i][0], map[string]string{"tenant": "warm"}, rev)
	}
	return uc
}

// usageLoads is the load of a kill test: three tenants admitted at a
// decimal cost, and one denied (its cost is above the burst).
type usageLoads struct {
	admitted map[string]*load // by tenant
	denied   *load
}

var usageTenants = []string{"u1", "u2", "u3"}

// start runs the loads through the processes other than skip.
func (uc *usageCluster) startLoads(t *testing.T, skip int) *usageLoads {
	t.Helper()
	var conns []*nats.Conn
	for i := range uc.procs {
		if i != skip {
			conns = append(conns, uc.conns[i]...)
		}
	}
	ul := &usageLoads{admitted: map[string]*load{}}
	for _, tenant := range usageTenants {
		ul.admitted[tenant] = startLoadBody(t, conns, req(map[string]string{"tenant": tenant}, `"cost":"0.5"`))
	}
	ul.denied = startLoadBody(t, conns[:2], req(map[string]string{"tenant": "deny"}, `"cost":2000000`))
	return ul
}

func (ul *usageLoads) all() []*load {
	out := []*load{ul.denied}
	for _, tenant := range usageTenants {
		out = append(out, ul.admitted[tenant])
	}
	return out
}

// wait waits until every load has made n more decisions than at from.
func (ul *usageLoads) wait(t *testing.T, from map[*load]loadStats, n int, within time.Duration, what string) {
	t.Helper()
	for _, l := range ul.all() {
		l.waitAnswered(t, from[l], n, within, what)
	}
}

func (ul *usageLoads) snapshot() map[*load]loadStats {
	out := map[*load]loadStats{}
	for _, l := range ul.all() {
		out[l] = l.stats()
	}
	return out
}

func (ul *usageLoads) stop() {
	for _, l := range ul.all() {
		l.stop()
	}
}

// check waits until the ledger caught up with the stream and holds at
// least every admission the clients saw, then checks each key against the
// clients: admitted <= ledger allowed <= admitted + requests without a
// decision, every allowed record at the load's cost, denials at most what
// clients saw denied plus what they did not see.
func (uc *usageCluster) check(t *testing.T, ul *usageLoads, alive []*proc) {
	t.Helper()
	atLeast := func(st ledgerCaughtUp) string {
		got := byKey(st.ledger)
		for _, tenant := range usageTenants {
			if a, l := ul.admitted[tenant].stats().admitted, got[billedKey(tenant)].allowed; l < int64(a) {
				return fmt.Sprintf("%s: the ledger (and the stream) hold %d admissions, clients saw %d", tenant, l, a)
			}
		}
		return ""
	}
	st := waitCaughtUp(t, 3*time.Minute, uc.js, procsPending(alive...), atLeast, "billed")
	got := byKey(st.ledger)
	t.Logf("the stream holds %d records (%d distinct); published again: %v", st.stream.records, func() (n int64) {
		for _, s := range got {
			n += s.allowed + s.denied
		}
		return n
	}(), st.stream.again)
	for _, tenant := range usageTenants {
		s := ul.admitted[tenant].stats()
		l := got[billedKey(tenant)]
		t.Logf("%s: clients %v; ledger %v", tenant, s, l)
		if l.allowed > int64(s.admitted+s.failed()) {
			t.Errorf("%s: the ledger counts %d admissions, clients saw %d and %d requests without a decision: counted twice",
				tenant, l.allowed, s.admitted, s.failed())
		}
		if l.allowedU != l.allowed*500_000 || l.denied != 0 {
			t.Errorf("%s: ledger %v, want only admissions of 0.5 units", tenant, l)
		}
	}
	s := ul.denied.stats()
	l := got[billedKey("deny")]
	t.Logf("deny: clients %v; ledger %v", s, l)
	if l.denied > int64(s.denied+s.failed()) || l.allowed != 0 || l.deniedU != l.denied*2_000_000_000_000 {
		t.Errorf("deny: ledger %v, clients saw %d denied and %d without a decision", l, s.denied, s.failed())
	}
}

// TestUsageKillNodeUnderLoad: the owner of a metered key's partition is
// SIGKILLed under load through the other two processes. The partition's
// next owner publishes again what the dead node's journal holds (same
// ids), so every admission clients saw reaches the ledger, once.
func TestUsageKillNodeUnderLoad(t *testing.T) {
	if testing.Short() {
		t.Skip("kill test with three processes")
	}
	uc := startUsageCluster(t)
	// The key's partition, from a dry run's "partition" hint.
	hint := decide(t, uc.admin, "rl.v1.decide", req(map[string]string{"tenant": usageTenants[0]}, `"dry_run":true`))
	part := hint.Partition
	if hint.Code != "" || part < 0 {
		t.Fatalf("dry run %+v: want a decision with the partition hint", hint)
	}
	victim := -1
	waitFor(t, "an owner of "+billedKey(usageTenants[0])+"'s partition", func() bool {
		victim = procOfNode(t, uc.procs, partOwner(uc.admin, part))
		return victim >= 0
	})
	victimID := uc.procs[victim].nodeID(t)
	ul := uc.startLoads(t, victim)
	ul.wait(t, map[*load]loadStats{}, 200, 3*testTimeout, "before the kill")

	uc.procs[victim].kill()
	killedAt := time.Now()
	waitWithin(t, 3*testTimeout, fmt.Sprintf("a new owner of partition %d", part), func() bool {
		o := partOwner(uc.admin, part)
		return o != "" && o != victimID
	})
	ul.wait(t, ul.snapshot(), 200, 3*testTimeout, "after the kill")
	t.Logf("%s (%s, owner of partition %d) killed; decisions resumed within %v",
		uc.procs[victim].name, victimID, part, time.Since(killedAt).Round(time.Millisecond))
	ul.stop()
	var alive []*proc
	for i, p := range uc.procs {
		if i != victim {
			alive = append(alive, p)
		}
	}
	uc.check(t, ul, alive)
}

// TestUsageKillReconciler: the process running the ledger's reconciler
// (the node named by the lease entry leader.ledger in rl_ledger) is
// SIGKILLed while records stream in; another takes the lease over and goes
// on from the ledger's cursor, and nothing is counted twice: the ledger's
// totals equal the stream's records deduplicated by id, and the clients'
// admissions bound them as in TestUsageKillNodeUnderLoad.
func TestUsageKillReconciler(t *testing.T) {
	if testing.Short() {
		t.Skip("kill test with three processes")
	}
	uc := startUsageCluster(t)
	var leader string
	victim := -1
	waitWithin(t, 3*testTimeout, "a reconciler holding leader.ledger", func() bool {
		leader = ledgerLeader(uc.js)
		victim = procOfNode(t, uc.procs, leader)
		return victim >= 0
	})
	ul := uc.startLoads(t, victim)
	ul.wait(t, map[*load]loadStats{}, 200, 3*testTimeout, "before the kill")
	// Mid-stream: the ledger has counted some of the load, and the load
	// goes on.
	waitWithin(t, 3*testTimeout, "the ledger counting the load", func() bool {
		l, err := ledgerUsage(uc.js, "billed")
		return err == nil && byKey(l)[billedKey(usageTenants[0])].allowed > 0
	})
	before, _ := ledgerUsage(uc.js, "billed")
	uc.procs[victim].kill()
	killedAt := time.Now()
	var next string
	waitWithin(t, 3*testTimeout, "another node taking leader.ledger over", func() bool {
		next = ledgerLeader(uc.js)
		return next != "" && next != leader
	})
	t.Logf("reconciler %s on %s killed with %v counted for %s; %s took over within %v",
		leader, uc.procs[victim].name, byKey(before)[billedKey(usageTenants[0])], usageTenants[0], next,
		time.Since(killedAt).Round(time.Millisecond))
	// The new reconciler counts what comes after.
	ul.wait(t, ul.snapshot(), 200, 3*testTimeout, "after the kill")
	waitWithin(t, 3*testTimeout, "the new reconciler counting", func() bool {
		l, err := ledgerUsage(uc.js, "billed")
		return err == nil && byKey(l)[billedKey(usageTenants[0])].allowed > byKey(before)[billedKey(usageTenants[0])].allowed
	})
	ul.stop()
	var alive []*proc
	for i, p := range uc.procs {
		if i != victim {
			alive = append(alive, p)
		}
	}
	uc.check(t, ul, alive)
}
