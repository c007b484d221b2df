package integration

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/mesh"
	"github.com/limitmesh/limitmesh/mesh/client"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// ownershipLease is the lease of the ownership tests: short, so a killed
// owner's partitions move within the test's bounds.
const ownershipLease = 600 * time.Millisecond

// meshNodes starts k nodes on e (each with its own connection) with a
// short lease and slowPolicy applied, and waits until every partition has
// exactly one owner among them.
func meshNodes(t *testing.T, servers []*mesh.Embedded, k int) []*testNode {
	t.Helper()
	nodes := make([]*testNode, k)
	for i := range nodes {
		nodes[i] = startNode(t, servers[i%len(servers)], mesh.NodeConfig{
			LeaseTime: ownershipLease, NodeID: fmt.Sprintf("n%d", i), Replicas: replicasFor(servers)})
	}
	rev := putPolicy(t, nodes[0].nc, "rl_policies", "slow", slowPolicy)
	waitApplied(t, "slow", rev, nodes...)
	waitExclusive(t, nodes)
	return nodes
}

func replicasFor(servers []*mesh.Embedded) int {
	if len(servers) >= 3 {
		return 3
	}
	return 1
}

// owners returns, per partition, the indexes of the nodes that serve it
// (serves), the bucket read on the first non-nil node's connection.
func owners(t testing.TB, nodes []*testNode) [][]int {
	t.Helper()
	out := make([][]int, mesh.DefaultPartitions)
	var shards map[int]shardEntry
	for _, n := range nodes {
		if n != nil {
			shards = readShards(t, n.nc)
			break
		}
	}
	for i, n := range nodes {
		if n == nil || !heldAll(t, n, shards) {
			continue
		}
		for p := range out {
			if shards[p].Node == n.id {
				out[p] = append(out[p], i)
			}
		}
	}
	return out
}

// waitExclusive waits until the shards bucket shows every partition
// served by one of the (non-nil) nodes (serves) and each node serving
// some.
func waitExclusive(t *testing.T, nodes []*testNode) {
	t.Helper()
	waitFor(t, "every partition owned by exactly one node", func() bool {
		count := map[int]int{}
		for _, o := range owners(t, nodes) {
			if len(o) != 1 {
				return false
			}
			count[o[0]]++
		}
		for i, n := range nodes {
			if n != nil && count[i] == 0 {
				return false
			}
		}
		return true
	})
}

// limitKey is slowPolicy's limit key of a tenant.
func slowKey(tenant string) string { return "p.slow.tenant=" + tenant }

// ownerOf returns the index of the node owning the tenant's partition.
func ownerOf(t *testing.T, nodes []*testNode, tenant string) int {
	t.Helper()
	p := partitionOf(slowKey(tenant))
	o := owners(t, nodes)[p]
	if len(o) != 1 {
		t.Fatalf("partition %d owners %v", p, o)
	}
	return o[0]
}

// burst sends total requests for desc at once, spread over conns (with
// burstDecisions: a 503 is retried with the request's id), and returns the
// admitted count and the failed attempts.
func burst(t *testing.T, conns []*nats.Conn, desc map[string]string, total int) (admitted, failed int) {
	t.Helper()
	replies, failed := burstDecisions(t, conns, desc, total)
	return admittedOf(replies), failed
}

// TestOwnershipSpreadAndRouting: three nodes on one server share the 64
// partitions evenly, each partition has one owner, a hot key sent to every
// node is decided by its owner only (the others forward), and the Acme
// burst over connections to all nodes admits exactly 40.
func TestOwnershipSpreadAndRouting(t *testing.T) {
	e := server(t, t.TempDir())
	nodes := meshNodes(t, []*mesh.Embedded{e}, 3)
	count := map[int]int{}
	for _, o := range owners(t, nodes) {
		count[o[0]]++
	}
	for i := range nodes {
		if count[i] < 10 {
			t.Fatalf("uneven spread: %v", count)
		}
		waitFor(t, fmt.Sprintf("node %d's owned gauge at %d", i, count[i]), func() bool {
			return int(metricValue(t, nodes[i], "limitmesh_owned_partitions")) == count[i]
		})
	}
	t.Logf("partitions per node: %v", count)

	hot := map[string]string{"tenant": "hot"}
	owner := ownerOf(t, nodes, "hot")
	conns := []*nats.Conn{nodes[0].nc, nodes[1].nc, nodes[2].nc}
	for range 3 {
		conns = append(conns, connect(t, e))
	}
	admitted, failed := burst(t, conns, hot, 80)
	if admitted != 40 {
		t.Fatalf("burst over three nodes admitted %d (%d attempts retried), want exactly 40", admitted, failed)
	}
	for i, n := range nodes {
		decided := metricValue(t, n, `limitmesh_decisions_total{policy="slow",result="allowed"}`) +
			metricValue(t, n, `limitmesh_decisions_total{policy="slow",result="denied"}`)
		forwarded := metricValue(t, n, `limitmesh_forwarded_total{outcome="ok"}`)
		// Each request is decided once; a retried attempt may be decided
		// again (its first attempt's decision came too late to answer).
		if i == owner && (decided < 80 || decided > float64(80+failed)) {
			t.Fatalf("owner node %d decided %v of 80 (%d attempts retried)", i, decided, failed)
		}
		if i != owner && (decided != 0 || forwarded == 0) {
			t.Fatalf("node %d (not the owner) decided %v, forwarded %v", i, decided, forwarded)
		}
		if v := metricValue(t, n, `limitmesh_cas_conflicts_total`); v != 0 {
			t.Fatalf("node %d: %v CAS conflicts with a single owner", i, v)
		}
	}
}

// TestOwnershipReplicatedCluster: three servers in one JetStream cluster
// (R3 buckets), one node on each: partitions spread, a burst of 80 admits
// exactly 40 over connections to every server.
func TestOwnershipReplicatedCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("cluster test")
	}
	servers := startCluster(t)
	nodes := meshNodes(t, servers, 3)
	var conns []*nats.Conn
	for i := range 6 {
		conns = append(conns, connect(t, servers[i%3]))
	}
	admitted, failed := burst(t, conns, acmeTenant, 80)
	if admitted != 40 {
		t.Fatalf("R3 mesh admitted %d of 80 (%d attempts retried), want exactly 40", admitted, failed)
	}
	_ = nodes
}

var acmeTenant = map[string]string{"tenant": "acme"}

// startCluster starts three embedded servers in one JetStream cluster and
// waits for a meta leader.
func startCluster(t *testing.T) []*mesh.Embedded {
	t.Helper()
	servers := embeddedCluster(t, 3)
	// The first node creates R3 buckets; retry while the cluster settles.
	waitFor(t, "R3 buckets usable", func() bool {
		nc, err := nats.Connect(servers[0].ClientURL())
		if err != nil {
			return false
		}
		defer nc.Close()
		js, _ := jetstream.New(nc)
		ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
		defer cancel()
		_, err = js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "probe", Replicas: 3})
		return err == nil
	})
	return servers
}

// TestGracefulHandoff: a node stopped gracefully hands its partitions over
// (the others claim them at once in greater epochs) and decisions continue
// with no overshoot: what was admitted before stays spent.
func TestGracefulHandoff(t *testing.T) {
	e := server(t, t.TempDir())
	nodes := meshNodes(t, []*mesh.Embedded{e}, 3)
	// Pick a tenant owned by node 1, the one to stop.
	tenant := tenantOwnedBy(t, nodes, 1)
	desc := map[string]string{"tenant": tenant}
	p := partitionOf(slowKey(tenant))
	epoch := epochOf(t, nodes[1], p)
	if r := decide(t, nodes[0].nc, "rl.v1.decide", req(desc, `"cost":30`)); !r.Allowed {
		t.Fatalf("first spend: %+v", r)
	}
	// Traffic keeps flowing while node 1 stops.
	stopped := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
		defer cancel()
		stopped <- nodes[1].node.Stop(ctx)
	}()
	admitted := 0
	for range 20 {
		r := decide(t, nodes[0].nc, "rl.v1.decide", req(desc, ""))
		if r.Code != "" {
			t.Fatalf("during the handoff: %+v", r)
		}
		if r.Allowed {
			admitted++
		}
	}
	if err := <-stopped; err != nil {
		t.Fatalf("Stop: %v", err)
	}
	rest := []*testNode{nodes[0], nil, nodes[2]}
	waitExclusive(t, rest)
	newOwner := owners(t, rest)[p][0]
	if e2 := epochOf(t, rest[newOwner], p); e2 <= epoch {
		t.Fatalf("partition %d taken over in epoch %d, not above %d", p, e2, epoch)
	}
	for range 20 {
		if r := decide(t, nodes[2].nc, "rl.v1.decide", req(desc, "")); r.Allowed {
			admitted++
		}
	}
	if admitted != 10 {
		t.Fatalf("admitted %d after spending 30 of 40, want exactly 10", admitted)
	}
}

// tenantOwnedBy finds a tenant whose partition node i owns (the shards
// bucket names it).
func tenantOwnedBy(t *testing.T, nodes []*testNode, i int) string {
	t.Helper()
	shards := readShards(t, nodes[i].nc)
	for k := range 10000 {
		tenant := "t" + strconv.Itoa(k)
		if shards[partitionOf(slowKey(tenant))].Node == nodes[i].id {
			return tenant
		}
	}
	t.Fatalf("node %d owns no partition", i)
	return ""
}

// TestKilledOwnerTakeover: an owner whose connection dies (no graceful
// stop) loses its partitions after the lease; the other nodes take them
// over in greater epochs with the state loaded from KV (nothing admitted
// before is forgotten).
func TestKilledOwnerTakeover(t *testing.T) {
	e := server(t, t.TempDir())
	nodes := meshNodes(t, []*mesh.Embedded{e}, 3)
	tenant := tenantOwnedBy(t, nodes, 2)
	desc := map[string]string{"tenant": tenant}
	p := partitionOf(slowKey(tenant))
	epoch := epochOf(t, nodes[2], p)
	r := decide(t, nodes[0].nc, "rl.v1.decide", req(desc, `"cost":38`))
	if !r.Allowed {
		t.Fatalf("first spend: %+v", r)
	}
	requireOwner(t, r, p, nodes[2])
	killed := time.Now()
	nodes[2].nc.Close() // the node's process is gone as far as NATS can tell
	rest := []*testNode{nodes[0], nodes[1], nil}
	waitExclusive(t, rest)
	moved := time.Since(killed)
	t.Logf("partitions moved %v after the kill (lease %v)", moved, ownershipLease)
	newOwner := owners(t, rest)[p][0]
	if e2 := epochOf(t, rest[newOwner], p); e2 <= epoch {
		t.Fatalf("partition %d taken over in epoch %d, not above %d", p, e2, epoch)
	}
	waitFor(t, "a claim counted", func() bool {
		return metricValue(t, rest[newOwner], `limitmesh_ownership_changes_total{change="claimed"}`) > 0
	})
	admitted := 0
	for range 10 {
		r := decide(t, nodes[0].nc, "rl.v1.decide", req(desc, ""))
		if r.Code != "" {
			t.Fatalf("after the takeover: %+v", r)
		}
		if r.Allowed {
			admitted++
		}
	}
	if admitted != 2 {
		t.Fatalf("admitted %d after the takeover, want exactly 2 (38 of 40 were spent before the kill)", admitted)
	}
}

// TestDeposedOwnerFenced: another writer takes a partition from its owner
// in the shards bucket (as a new owner would) and writes the key's state;
// the deposed owner does not decide against its stale cache: it stops
// serving the partition, drops it, and answers only through the
// partition's owner (503 here, since the intruder is no node). When the
// intruder never renews, the node claims the partition back in a greater
// epoch and decides against the intruder's state.
func TestDeposedOwnerFenced(t *testing.T) {
	e := server(t, t.TempDir())
	nodes := meshNodes(t, []*mesh.Embedded{e}, 1)
	n := nodes[0]
	desc := map[string]string{"tenant": "fenced"}
	key := slowKey("fenced")
	p := partitionOf(key)
	if r := decide(t, n.nc, "rl.v1.decide", req(desc, `"cost":10`)); !r.Allowed {
		t.Fatalf("first spend: %+v", r)
	}
	epoch := epochOf(t, n, p)
	js, _ := jetstream.New(n.nc)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	shards, err := js.KeyValue(ctx, "rl_shards")
	if err != nil {
		t.Fatal(err)
	}
	state, err := js.KeyValue(ctx, "rl_state")
	if err != nil {
		t.Fatal(err)
	}
	// The key's latest record, as the intruder would adopt it from the
	// node's journal (it may be there only).
	val, err := mesh.ReadStateRecord(ctx, js, "rl", key)
	if err != nil {
		t.Fatal(err)
	}
	// The intruder claims with CAS, retrying over the owner's renewals.
	partKey := "part." + strconv.Itoa(p)
	waitFor(t, "intruder claim", func() bool {
		cur, err := shards.Get(ctx, partKey)
		if err != nil {
			return false
		}
		_, err = shards.Update(ctx, partKey, []byte(`{"node":"intruder"}`), cur.Revision())
		return err == nil
	})
	// The intruder spends the rest of the key (it decides against that
	// record: copy it with a CAS write, so the node's cached revision is
	// stale).
	var rev uint64
	if cur, err := state.Get(ctx, key); err == nil {
		rev = cur.Revision()
	}
	if _, err := state.Update(ctx, key, val, rev); err != nil {
		t.Fatal(err)
	}
	// The node counts the partition lost as it stops serving it.
	waitMetric(t, n, `limitmesh_ownership_changes_total{change="lost"}`, 1)
	r := decide(t, n.nc, "rl.v1.decide", req(desc, ""))
	if r.Code != "503" {
		t.Fatalf("deposed owner answered %+v, want 503 (no decision against its stale state)", r)
	}
	// The intruder never renews: the node takes the partition back.
	waitFor(t, "partition reclaimed", func() bool { return serves(t, n, p) })
	if e2 := epochOf(t, n, p); e2 <= epoch {
		t.Fatalf("reclaimed in epoch %d, not above %d", e2, epoch)
	}
	got := decide(t, n.nc, "rl.v1.decide", req(desc, `"cost":30`))
	if !got.Allowed || got.Remaining >= 1 {
		t.Fatalf("after the reclaim: %+v, want 30 of the 30 left admitted", got)
	}
}

// TestClaimBackOwnEntry: an owner whose renewal is refused by an entry
// naming itself that it cannot tell from a write of its own (a claim of
// its, epoch 0; or its renewal, when the read of the entry after the
// conflict lags as well: seen right after a network partition healed, a
// stream leader cut off from the others, not yet aware it was replaced,
// answered first) drops its partition, then claims it back over the entry
// naming itself and adopts the partition's records from its own journal,
// read up to a barrier it appends (not up to the journal's end as a read
// reports it, which that stale leader answered too). Nothing spent before
// is forgotten.
func TestClaimBackOwnEntry(t *testing.T) {
	o := spendOnOwner(t, "back")
	o.overwrite(t, "an entry naming the owner written", fmt.Appendf(nil, `{"node":%q}`, o.n.id))
	waitFor(t, "partition claimed back", func() bool { return serves(t, o.n, o.p) && epochOf(t, o.n, o.p) > o.epoch })
	o.checkRest(t, 1, "after the claim-back")
}

// TestRenewalLandedUnseen: an owner whose renewal landed but whose
// acknowledgement was lost (a timeout under load) sends it again over the
// old revision and is refused; it reads the entry, finds its own renewal
// (its name, its epoch, a later revision) and keeps the partition in the
// same epoch, instead of dropping it and claiming it back (seen in
// TestJournalClaimerKilled: a loaded node gave up a dozen partitions nobody
// else claimed).
func TestRenewalLandedUnseen(t *testing.T) {
	o := spendOnOwner(t, "unseen")
	written := o.overwrite(t, "the owner's renewal written again", fmt.Appendf(nil, `{"node":%q,"epoch":%d}`, o.n.id, o.epoch))
	waitFor(t, "the owner renews over the entry", func() bool {
		cur, err := o.shards.Get(o.ctx, o.partKey)
		return err == nil && cur.Revision() > written
	})
	// The entry past the overwrite is the owner's renewal in its epoch: it
	// kept the partition (a claim back would be in a new epoch).
	if e := readShard(t, o.n.nc, o.p); e.Node != o.n.id || !e.Renewed || e.Epoch != o.epoch {
		t.Fatalf("entry %+v, want the partition kept by %s in epoch %d", e, o.n.id, o.epoch)
	}
	if v := metricValue(t, o.n, `limitmesh_ownership_changes_total{change="lost"}`); v != 0 {
		t.Fatalf("lost changes %v, want 0", v)
	}
	o.checkRest(t, 0, "after the renewal")
}

// ownerSpent is a one-node mesh whose node owns partition p (in epoch) of
// a slowPolicy key of which 10 of 40 units are spent.
type ownerSpent struct {
	n       *testNode
	desc    map[string]string
	p       int
	epoch   uint64
	ctx     context.Context
	shards  jetstream.KeyValue
	partKey string
}

func spendOnOwner(t *testing.T, tenant string) *ownerSpent {
	t.Helper()
	e := server(t, t.TempDir())
	o := &ownerSpent{n: meshNodes(t, []*mesh.Embedded{e}, 1)[0], desc: map[string]string{"tenant": tenant}}
	o.p = partitionOf(slowKey(tenant))
	if r := decide(t, o.n.nc, "rl.v1.decide", req(o.desc, `"cost":10`)); !r.Allowed {
		t.Fatalf("first spend: %+v", r)
	}
	o.epoch = epochOf(t, o.n, o.p)
	js, _ := jetstream.New(o.n.nc)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	t.Cleanup(cancel)
	o.ctx = ctx
	var err error
	if o.shards, err = js.KeyValue(ctx, "rl_shards"); err != nil {
		t.Fatal(err)
	}
	o.partKey = "part." + strconv.Itoa(o.p)
	return o
}

// overwrite writes val over the partition's entry with CAS (retrying over
// the owner's renewals) and returns the revision written.
func (o *ownerSpent) overwrite(t *testing.T, what string, val []byte) uint64 {
	t.Helper()
	var written uint64
	waitFor(t, what, func() bool {
		cur, err := o.shards.Get(o.ctx, o.partKey)
		if err != nil {
			return false
		}
		written, err = o.shards.Update(o.ctx, o.partKey, val, cur.Revision())
		return err == nil
	})
	return written
}

// checkRest checks the losses counted and that the 30 units left, and no
// more, are admitted.
func (o *ownerSpent) checkRest(t *testing.T, lost float64, when string) {
	t.Helper()
	waitMetric(t, o.n, `limitmesh_ownership_changes_total{change="lost"}`, lost)
	if got := decide(t, o.n.nc, "rl.v1.decide", req(o.desc, `"cost":30`)); !got.Allowed || got.Remaining >= 1 {
		t.Fatalf("%s: %+v, want 30 of the 30 left admitted", when, got)
	}
	if got := decide(t, o.n.nc, "rl.v1.decide", req(o.desc, "")); got.Allowed {
		t.Fatalf("%s: %+v admitted beyond the 40 units", when, got)
	}
}

// TestPartitionCountMismatch: a node with another partition count than
// the one recorded in the shards bucket does not start.
func TestPartitionCountMismatch(t *testing.T) {
	e := server(t, t.TempDir())
	startNode(t, e, mesh.NodeConfig{})
	nc := connect(t, e)
	n, err := mesh.NewNode(nc, mesh.NodeConfig{Partitions: 32})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	err = n.Start(ctx)
	defer n.Stop(ctx)
	if err == nil || !errors.Is(err, mesh.ErrPartitionMismatch) {
		t.Fatalf("Start with 32 partitions on a 64-partition mesh: %v", err)
	}
}

// TestShardSubjectAndClientHint: the reply carries the partition header;
// a request sent straight to a shard subject is decided (or forwarded when
// the key belongs elsewhere); the SDK sends straight to the owner once it
// knows the partition, saving the hop.
func TestShardSubjectAndClientHint(t *testing.T) {
	e := server(t, t.TempDir())
	nodes := meshNodes(t, []*mesh.Embedded{e}, 2)
	desc := map[string]string{"tenant": "hinted"}
	p := partitionOf(slowKey("hinted"))
	m, err := nodes[0].nc.Request("rl.v1.decide", []byte(req(desc, `"dry_run":true`)), testTimeout)
	if err != nil {
		t.Fatal(err)
	}
	var hint struct {
		Partition *int `json:"partition"`
	}
	if err := json.Unmarshal(m.Data, &hint); err != nil || hint.Partition == nil || *hint.Partition != p {
		t.Fatalf("reply %s: partition hint missing or not %d (%v)", m.Data, p, err)
	}
	if len(m.Header) != 0 {
		t.Fatalf("decision reply with headers %v, want none", m.Header)
	}
	// The wrong shard subject still routes correctly (a policy change can
	// move a descriptor to another key).
	wrong := (p + 1) % mesh.DefaultPartitions
	if r := decide(t, nodes[0].nc, "rl.v1.shard."+strconv.Itoa(wrong), req(desc, `"cost":5`)); !r.Allowed || r.Remaining != 35 {
		t.Fatalf("via the wrong shard subject: %+v", r)
	}
	owner := ownerOf(t, nodes, "hinted")
	other := 1 - owner
	c, err := client.New(connect(t, e))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	before := metricValue(t, nodes[other], `limitmesh_forwarded_total{outcome="ok"}`)
	for range 10 {
		res, err := c.Decide(ctx, desc, 1)
		if err != nil || !res.Allowed {
			t.Fatalf("client decide: %+v %v", res, err)
		}
	}
	after := metricValue(t, nodes[other], `limitmesh_forwarded_total{outcome="ok"}`)
	// The first request may go through the other node; the next nine go
	// straight to the owner.
	if after-before > 1 {
		t.Fatalf("node %d forwarded %v of the client's 10 requests, want at most 1", other, after-before)
	}
}
