package integration

import (
	"fmt"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/mesh"
	"github.com/nats-io/nats.go"
)

// The region tests run strict-mode policies on a two-region supercluster
// (startSupercluster: eu and us, three servers each, gateways through
// proxies) with one node per region. The eu node starts first, so every
// bucket and stream the nodes use (policies, state, shards, journal) is
// created from eu and placed in eu: JetStream places a stream in the
// cluster of the server its creator is connected to, all its replicas in
// that one cluster.

// regionNodes is the fixture of the region tests.
type regionNodes struct {
	sc     *supercluster
	eu, us *testNode
}

// startRegionNodes starts the supercluster and a node in each region (eu
// first, with three replicas: the buckets live in eu) with cfg, and waits
// until the nodes share the partitions.
func startRegionNodes(t *testing.T, cfg mesh.NodeConfig) *regionNodes {
	t.Helper()
	sc := startSupercluster(t, regionSpec{"eu", 3}, regionSpec{"us", 3})
	cfg.Replicas = 3
	cfg.NodeID = "eu"
	eu := sc.startRegionNode(t, "eu", 1, cfg)
	cfg.NodeID = "us"
	us := sc.startRegionNode(t, "us", 1, cfg)
	rn := &regionNodes{sc: sc, eu: eu, us: us}
	waitExclusive(t, rn.nodes())
	if c := streamInfo(t, eu.nc, "KV_rl_state").Cluster; c == nil || c.Name != "eu" {
		t.Fatalf("the state bucket is not placed in eu: %+v", c)
	}
	return rn
}

func (rn *regionNodes) nodes() []*testNode { return []*testNode{rn.eu, rn.us} }

// node returns the node of region name.
func (rn *regionNodes) node(name string) *testNode {
	if name == "eu" {
		return rn.eu
	}
	return rn.us
}

// tenantOwnedIn finds a tenant whose limit key under keyOf is in a
// partition the node of region name owns.
func (rn *regionNodes) tenantOwnedIn(t *testing.T, name string, keyOf func(tenant string) string) string {
	t.Helper()
	n := rn.node(name)
	shards := readShards(t, n.nc)
	for k := range 10000 {
		tenant := fmt.Sprintf("%s%d", name, k)
		if shards[partitionOf(keyOf(tenant))].Node == n.id {
			return tenant
		}
	}
	t.Fatalf("no tenant owned in region %s", name)
	return ""
}

// regionConns opens n client connections to region name's servers, each
// starting at a different server.
func (rn *regionNodes) regionConns(t *testing.T, name string, n int) []*nats.Conn {
	t.Helper()
	r := rn.sc.region(t, name)
	conns := make([]*nats.Conn, n)
	for i := range conns {
		urls := r.URLs()
		k := i % len(urls)
		conns[i] = connectURLs(t, append(urls[k:], urls[:k]...)...)
	}
	return conns
}

// TestRegionsStrictBurst: a strict policy decided from clients in both
// regions is exact globally: 80 requests at once over connections to all
// six servers admit exactly the burst of 40, for a key owned in eu (us
// clients' requests cross the gateways to its owner) and for one owned in
// us (eu clients' requests cross them the other way, and the owner writes
// its state to the buckets in eu).
func TestRegionsStrictBurst(t *testing.T) {
	if testing.Short() {
		t.Skip("supercluster test")
	}
	rn := startRegionNodes(t, mesh.NodeConfig{})
	rev := putPolicy(t, rn.eu.nc, "rl_policies", "slow", slowPolicy)
	waitApplied(t, "slow", rev, rn.nodes()...)
	conns := append(rn.regionConns(t, "eu", 3), rn.regionConns(t, "us", 3)...)
	for _, owner := range []string{"eu", "us"} {
		tenant := rn.tenantOwnedIn(t, owner, slowKey)
		admitted, unavailable := burst(t, conns, map[string]string{"tenant": tenant}, 80)
		if admitted != 40 || unavailable != 0 {
			t.Fatalf("key owned in %s: 80 requests from both regions admitted %d (503: %d), want exactly 40",
				owner, admitted, unavailable)
		}
	}
}

// pacedPolicy limits each tenant to 20/s with a burst of 20: the region
// tests offer more, so the contract's envelope is what they can admit.
const (
	pacedPolicy = `{"match": {"tenant": "*"}, "key": ["tenant"],
 "limits": [{"name": "rate", "algorithm": "token_bucket", "rate": "20/s", "burst": 20}]}`
	pacedRate  = 20.0
	pacedBurst = 20.0
)

func pacedKey(tenant string) string { return "p.paced.tenant=" + tenant }

// regionLease is the partition lease of the region tests: short, so the
// partitions of a cut-off node move within the test's bounds.
const regionLease = time.Second

// TestRegionsGatewayCut: load from both regions on two keys, one owned by
// the eu node and one by the us node, while every bucket lives in eu; then
// the gateway links of us are cut, and healed.
//
// While cut (strict mode): us clients get 503 (their node answers at its
// decision deadline: its own partitions' writes cannot reach the journal
// in eu, and requests it forwards find no owner); eu clients keep deciding
// the eu-owned key, and the us-owned key once the eu node has taken the
// cut-off node's partitions over (one lease after its last renewal). So
// the region that can decide is the one where the buckets live, whoever
// owned the key before the cut. After the heal both regions decide both
// keys again within a bounded poll, policy changes reach the us node
// again, and over the whole run each key admitted no more than its
// contract: burst + rate x elapsed.
func TestRegionsGatewayCut(t *testing.T) {
	if testing.Short() {
		t.Skip("supercluster partition test")
	}
	rn := startRegionNodes(t, mesh.NodeConfig{LeaseTime: regionLease})
	rev := putPolicy(t, rn.eu.nc, "rl_policies", "paced", pacedPolicy)
	waitApplied(t, "paced", rev, rn.nodes()...)
	tenants := map[string]string{ // by the region of the key's owner
		"eu": rn.tenantOwnedIn(t, "eu", pacedKey),
		"us": rn.tenantOwnedIn(t, "us", pacedKey),
	}
	regions := []string{"eu", "us"}
	conns := map[string][]*nats.Conn{}
	for _, r := range regions {
		conns[r] = rn.regionConns(t, r, 2)
	}
	// loads[client region][owner region]
	loads := map[string]map[string]*load{}
	start := time.Now()
	for _, c := range regions {
		loads[c] = map[string]*load{}
		for _, o := range regions {
			loads[c][o] = startLoad(t, conns[c], map[string]string{"tenant": tenants[o]})
		}
	}
	each := func(f func(c, o string, l *load)) {
		for _, c := range regions {
			for _, o := range regions {
				f(c, o, loads[c][o])
			}
		}
	}
	snap := func() map[string]map[string]loadStats {
		s := map[string]map[string]loadStats{"eu": {}, "us": {}}
		each(func(c, o string, l *load) { s[c][o] = l.stats() })
		return s
	}
	each(func(c, o string, l *load) {
		l.waitDecisions(t, loadStats{}, 20, testTimeout, fmt.Sprintf("warm-up: %s clients, key owned in %s", c, o))
	})

	// Cut us off.
	before := snap()
	rn.sc.IsolateRegion(t, "us")
	cutAt := time.Now()
	loads["eu"]["eu"].waitDecisions(t, before["eu"]["eu"], 20, testTimeout, "eu clients, eu-owned key, cut")
	t.Logf("cut: eu decides the eu-owned key again %s after the cut", time.Since(cutAt).Round(time.Millisecond))
	loads["eu"]["us"].waitDecisions(t, before["eu"]["us"], 20, 4*testTimeout, "eu clients, us-owned key, cut")
	t.Logf("cut: eu decides the us-owned key again %s after the cut (the eu node took its partition over)",
		time.Since(cutAt).Round(time.Millisecond))
	// The shards bucket names eu (whose clients decide the key again); the
	// us node cannot reach the bucket: that it stopped serving (its
	// self-fence, by its own clock) only the node itself can tell.
	if p := partitionOf(pacedKey(tenants["us"])); readShard(t, rn.eu.nc, p).Node != rn.eu.id || rn.us.node.Owns(p) {
		t.Fatalf("partition %d of the us-owned key: the entry names %q, us owns %v; want eu alone",
			p, readShard(t, rn.eu.nc, p).Node, rn.us.node.Owns(p))
	}
	waitFor(t, "the eu node owns every partition, the us node none", func() bool {
		return servedBy(t, rn.eu, rn.eu) == mesh.DefaultPartitions && owned(rn.us.node) == 0
	})
	t.Logf("cut: the eu node owns all %d partitions %s after the cut", mesh.DefaultPartitions, time.Since(cutAt).Round(time.Millisecond))
	// From now on the us node serves no partition (it stopped serving
	// before the eu node could take any over): us clients get only 503s,
	// answered at the node's decision deadline.
	settled := snap()
	for _, o := range regions {
		loads["us"][o].waitUnavailable(t, settled["us"][o], 5, testTimeout, "us clients, key owned in "+o+", cut")
	}
	for range 3 {
		t0 := time.Now()
		r := decide(t, conns["us"][0], "rl.v1.decide", req(map[string]string{"tenant": tenants["eu"]}, ""))
		if r.Code != "503" {
			t.Fatalf("us client during the cut: %+v, want a 503", r)
		}
		t.Logf("cut: a us client's request answered 503 after %s", time.Since(t0).Round(time.Millisecond))
	}
	during := snap()
	each(func(c, o string, l *load) {
		st := during[c][o].sub(before[c][o])
		t.Logf("during the cut: %s clients, key owned in %s: %v", c, o, st)
		requireClean(t, fmt.Sprintf("%s clients, key owned in %s, cut", c, o), st, true)
		if c == "us" {
			if d := during[c][o].sub(settled[c][o]); d.ok() > 0 {
				t.Errorf("us clients, key owned in %s: %d decisions while cut off after the takeover: %v", o, d.ok(), d)
			}
		}
	})
	t.Logf("cut: JetStream meta leaders now %v", rn.sc.metaLeaders())

	// Heal. Requests in flight at the cut have been given up by now (one
	// request timeout after it at the latest).
	time.Sleep(time.Until(cutAt.Add(faultRequestTimeout + 100*time.Millisecond)))
	healed := snap()
	healAt := time.Now()
	rn.sc.HealRegion(t, "us")
	// Wait for all four together, logging when each decides again.
	// The us node owning partitions again is logged too: the eu node
	// hands the us node's share back as soon as it sees its heartbeats,
	// and those partitions have no owner until the us node's watch of the
	// shards bucket delivers again.
	back := map[string]time.Duration{}
	waitWithin(t, superclusterFormTimeout, "both regions decide both keys after the heal", func() bool {
		each(func(c, o string, l *load) {
			what := c + " clients, key owned in " + o
			if _, ok := back[what]; !ok && l.stats().ok()-healed[c][o].ok() >= 20 {
				back[what] = time.Since(healAt).Round(time.Millisecond)
			}
		})
		if _, ok := back["us node owns partitions"]; !ok && servedBy(t, rn.us, rn.eu) > 0 {
			back["us node owns partitions"] = time.Since(healAt).Round(time.Millisecond)
		}
		return len(back) == 5
	})
	t.Logf("healed: after the heal: %v", back)
	rev2 := putPolicy(t, rn.eu.nc, "rl_policies", "paced", pacedPolicy)
	waitWithin(t, superclusterFormTimeout, "the us node applies a policy change after the heal", func() bool {
		got, ok := policyRevision(rn.us.node, "paced")
		return ok && got >= rev2
	})
	t.Logf("healed: the us node applied a policy change %s after the heal", time.Since(healAt).Round(time.Millisecond))

	each(func(_, _ string, l *load) { l.stop() })
	elapsed := time.Since(start)
	end := snap()
	for _, o := range regions {
		admitted := end["eu"][o].admitted + end["us"][o].admitted
		bound := pacedBurst + pacedRate*elapsed.Seconds()
		t.Logf("key owned in %s: admitted %d (eu clients %d, us clients %d) over %s; the contract allows %.0f",
			o, admitted, end["eu"][o].admitted, end["us"][o].admitted, elapsed.Round(time.Millisecond), bound)
		if float64(admitted) > bound {
			t.Errorf("OVERSHOOT: key owned in %s admitted %d, above burst + rate x elapsed = %.1f", o, admitted, bound)
		}
		for _, c := range regions {
			requireClean(t, fmt.Sprintf("%s clients, key owned in %s, after the heal", c, o), end[c][o].sub(healed[c][o]), false)
		}
	}
}

// servedBy returns the number of partitions tn serves (serves), the shards
// bucket read on via's connection.
func servedBy(t *testing.T, tn, via *testNode) int {
	t.Helper()
	shards := readShards(t, via.nc)
	if !heldAll(t, tn, shards) {
		return 0
	}
	c := 0
	for _, e := range shards {
		if e.Node == tn.id {
			c++
		}
	}
	return c
}

// owned returns the number of partitions n serves now, by its own clock:
// a node cut off from JetStream stops serving at its self-fence, which
// neither the shards bucket (it cannot write there) nor its metrics show.
func owned(n *mesh.Node) int {
	c := 0
	for p := range mesh.DefaultPartitions {
		if n.Owns(p) {
			c++
		}
	}
	return c
}

// waitUnavailable waits (bounded by within) until n more 503s than in the
// snapshot from have been answered.
func (l *load) waitUnavailable(t *testing.T, from loadStats, n int, within time.Duration, what string) {
	t.Helper()
	deadline := time.Now().Add(within)
	for l.stats().unavailable-from.unavailable < n {
		if time.Now().After(deadline) {
			t.Fatalf("%s: fewer than %d 503s within %s (%v)", what, n, within, l.stats().sub(from))
		}
		time.Sleep(10 * time.Millisecond)
	}
}
