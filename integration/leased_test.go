package integration

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/mesh"
	"github.com/limitmesh/limitmesh/mesh/client"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
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

// leaseReply is a reply of the lease subjects (docs/protocol.md).
type leaseReply struct {
	Result     string `json:"result"`
	Policy     string `json:"policy"`
	Revision   uint64 `json:"revision"`
	Grant      uint64 `json:"grant"`
	Epoch      uint64 `json:"epoch"`
	Units      int64  `json:"units"`
	TTL        int64  `json:"ttl_ns"`
	RetryAfter int64  `json:"retry_after_ns"`
	Refunded   int64  `json:"refunded"`
	ReportTo   string `json:"report_to"`
}

// askOwner sends one request of the holder-node protocol to the owner of
// partition part (the test plays a holder node) and decodes the reply.
func askOwner(t *testing.T, nc *nats.Conn, part int, body map[string]any) leaseReply {
	t.Helper()
	b, _ := json.Marshal(body)
	// A node serves a partition (Owns) a moment before its subscription of
	// the partition's subjects reaches the server: "no responders" means
	// nobody got the request, which is then sent again (as holders do).
	var m *nats.Msg
	var err error
	waitFor(t, "a subscriber of the partition's lease subject", func() bool {
		m, err = nc.Request(fmt.Sprintf("rl.v1.lease.shard.%d", part), b, testTimeout)
		return !errors.Is(err, nats.ErrNoResponders)
	})
	if err != nil {
		t.Fatalf("lease request %s: %v", b, err)
	}
	var r leaseReply
	if err := json.Unmarshal(m.Data, &r); err != nil {
		t.Fatalf("lease reply %q: %v", m.Data, err)
	}
	return r
}

func acquireBody(key, holder string, want int64) map[string]any {
	return map[string]any{"op": "acquire", "policy": "leased", "key": key, "holder": holder, "want": want, "min": 1_000_000}
}

func reportBody(op, key string, grant, epoch uint64, spent int64) map[string]any {
	return map[string]any{"op": op, "policy": "leased", "key": key, "grant": grant, "epoch": epoch, "spent": spent}
}

// grantsOf reads the grants in key's latest durable record (in the state
// bucket or, not yet checkpointed, in its owner's journal).
func grantsOf(t *testing.T, nc *nats.Conn, key string) []recordGrant {
	t.Helper()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	b, err := mesh.ReadStateRecord(ctx, js, "rl", key)
	if err != nil {
		t.Fatalf("ReadStateRecord(%s): %v", key, err)
	}
	gs, err := decodeRecordGrants(b)
	if err != nil {
		t.Fatalf("the record of %s: %v (%x)", key, err, b)
	}
	return gs
}

// TestLeasedGrantProtocol: the owner's answers to a holder node: grants of
// at most size until max_outstanding is reached (then "full"); cumulative
// reports lower what is outstanding; a report naming an unknown grant, or
// the grant's id with another epoch, is refused; a return refunds the
// unspent units into the key (a strict decision sees them) and cannot be
// repeated.
func TestLeasedGrantProtocol(t *testing.T) {
	e := server(t, t.TempDir())
	tn := startNode(t, e, mesh.NodeConfig{})
	// A burst above max_outstanding, refilling slowly: the bucket's
	// tokens are plain arithmetic in this test.
	rev := putPolicy(t, tn.nc, "rl_policies", "leased", `{"match": {"tenant": "*"}, "key": ["tenant"], "mode": "leased",
 "lease": {"size": 10, "ttl": "2s", "max_outstanding": 40},
 "limits": [{"name": "rate", "algorithm": "token_bucket", "rate": "1/h", "burst": 100}]}`)
	waitApplied(t, "leased", rev, tn)
	key := leasedKey("proto")
	part := partitionOf(key)
	var grants []leaseReply
	for i := range 4 {
		r := askOwner(t, tn.nc, part, acquireBody(key, "h1", 25_000_000))
		if r.Result != "granted" || r.Units != 10_000_000 || r.Epoch != epochOf(t, tn, part) || r.TTL != int64(2*time.Second) || r.Revision != rev {
			t.Fatalf("acquire %d: %+v (epoch %d)", i, r, epochOf(t, tn, part))
		}
		grants = append(grants, r)
	}
	if r := askOwner(t, tn.nc, part, acquireBody(key, "h2", 10_000_000)); r.Result != "full" {
		t.Fatalf("acquire beyond max_outstanding: %+v", r)
	}
	if gs := grantsOf(t, tn.nc, key); len(gs) != 4 || gs[3].Holder != "h1" || gs[3].Units != 10_000_000 {
		t.Fatalf("record grants %+v", gs)
	}
	g := grants[0]
	if r := askOwner(t, tn.nc, part, reportBody("report", key, 99, g.Epoch, 1)); r.Result != "unknown_grant" {
		t.Fatalf("unknown grant: %+v", r)
	}
	if r := askOwner(t, tn.nc, part, reportBody("report", key, g.Grant, g.Epoch-1, 1)); r.Result != "stale_epoch" {
		t.Fatalf("older epoch: %+v", r)
	}
	if r := askOwner(t, tn.nc, part, reportBody("report", key, g.Grant, g.Epoch+1, 1)); r.Result != "unknown_grant" {
		t.Fatalf("another epoch: %+v", r)
	}
	if r := askOwner(t, tn.nc, part, reportBody("report", key, g.Grant, g.Epoch, 11_000_000)); r.Result != "bad_spend" {
		t.Fatalf("spend above the grant: %+v", r)
	}
	// 4 of grant 1 spent: 36 outstanding, 4 more may be granted.
	if r := askOwner(t, tn.nc, part, reportBody("report", key, g.Grant, g.Epoch, 4_000_000)); r.Result != "ok" {
		t.Fatalf("report: %+v", r)
	}
	if r := askOwner(t, tn.nc, part, acquireBody(key, "h2", 10_000_000)); r.Result != "granted" || r.Units != 4_000_000 {
		t.Fatalf("acquire after the report: %+v", r)
	}
	// Grant 2 returned having spent 3: 7 go back into the bucket (100 −
	// 44 granted + 7 = 63).
	g2 := grants[1]
	r := askOwner(t, tn.nc, part, reportBody("return", key, g2.Grant, g2.Epoch, 3_000_000))
	if r.Result != "ok" || r.Refunded != 7_000_000 {
		t.Fatalf("return: %+v", r)
	}
	if r := askOwner(t, tn.nc, part, reportBody("return", key, g2.Grant, g2.Epoch, 3_000_000)); r.Result != "unknown_grant" {
		t.Fatalf("second return: %+v", r)
	}
	if d := decide(t, tn.nc, "rl.v1.decide", req(map[string]string{"tenant": "proto"}, `"dry_run":true`)); whole(d) != 62 {
		t.Fatalf("the refunded units are not there: %+v, want 62 remaining after a dry run of 1", d)
	}
	if r := askOwner(t, tn.nc, part, map[string]any{"op": "acquire", "policy": "nope", "key": "p.nope", "holder": "h"}); r.Result != "not_leased" {
		t.Fatalf("unknown policy: %+v", r)
	}
	if r := askOwner(t, tn.nc, part, map[string]any{"op": "grab"}); r.Result != "bad_request" {
		t.Fatalf("bad op: %+v", r)
	}
}

// slowLeased is a leased policy whose bucket barely refills (1/h, burst
// 100) and whose grants (10 each, at most 40 outstanding) last 4 s: long
// enough to outlive a takeover.
const slowLeased = `{"match": {"tenant": "*"}, "key": ["tenant"], "mode": "leased",
 "lease": {"size": 10, "ttl": "4s", "max_outstanding": 40},
 "limits": [{"name": "rate", "algorithm": "token_bucket", "rate": "1/h", "burst": 100}]}`

// leasedTenantOwnedBy finds a tenant whose leased key node i owns (the
// shards bucket names it).
func leasedTenantOwnedBy(t *testing.T, nodes []*testNode, i int) string {
	t.Helper()
	shards := readShards(t, nodes[i].nc)
	for k := range 10000 {
		tenant := fmt.Sprintf("t%d", k)
		if shards[partitionOf(leasedKey(tenant))].Node == nodes[i].id {
			return tenant
		}
	}
	t.Fatalf("node %d owns no partition", i)
	return ""
}

// TestLeasedOwnerKilled: the owner of a leased key dies (its connection
// closes, no graceful stop) with three grants outstanding. The node that
// takes its partition over (in a greater epoch, adopting its journal)
// knows the grants: it counts them against max_outstanding (one more
// grant fits, then "full"), refuses their reports and returns (an older
// epoch: their holders spend them to their deadline at most, and nothing
// is refunded), and once they expired (ttl plus the margin) grants again
// and still refuses returns of the old grants (unknown).
func TestLeasedOwnerKilled(t *testing.T) {
	e := server(t, t.TempDir())
	cfg := func(id string) mesh.NodeConfig {
		return mesh.NodeConfig{NodeID: id, LeaseTime: ownershipLease, CheckpointInterval: time.Hour}
	}
	n0 := startNode(t, e, cfg("n0"))
	n1, kill := startKillableNode(t, e, cfg("n1"))
	nodes := []*testNode{n0, n1}
	rev := putPolicy(t, n0.nc, "rl_policies", "leased", slowLeased)
	waitApplied(t, "leased", rev, nodes...)
	waitExclusive(t, nodes)
	tenant := leasedTenantOwnedBy(t, nodes, 1)
	key := leasedKey(tenant)
	part := partitionOf(key)
	var old []leaseReply
	for range 3 {
		r := askOwner(t, n0.nc, part, acquireBody(key, "h1", 10_000_000))
		if r.Result != "granted" {
			t.Fatalf("acquire from n1: %+v", r)
		}
		old = append(old, r)
	}
	e1 := old[0].Epoch
	kill()
	waitFor(t, "n0 takes the partition over", func() bool { return serves(t, n0, part) })
	if e2 := epochOf(t, n0, part); e2 <= e1 {
		t.Fatalf("taken over in epoch %d, not above %d", e2, e1)
	}
	if gs := grantsOf(t, n0.nc, key); len(gs) != 3 || gs[0].Epoch != e1 || gs[0].Holder != "h1" {
		t.Fatalf("the new owner's record holds %+v, want the 3 grants of epoch %d", gs, e1)
	}
	for _, op := range []string{"report", "return"} {
		if r := askOwner(t, n0.nc, part, reportBody(op, key, old[0].Grant, e1, 1_000_000)); r.Result != "stale_epoch" {
			t.Fatalf("%s of an old grant: %+v", op, r)
		}
	}
	if r := askOwner(t, n0.nc, part, acquireBody(key, "h2", 10_000_000)); r.Result != "granted" || r.Epoch <= e1 {
		t.Fatalf("acquire from the new owner: %+v", r)
	}
	if r := askOwner(t, n0.nc, part, acquireBody(key, "h2", 10_000_000)); r.Result != "full" {
		t.Fatalf("acquire beyond max_outstanding with the old grants: %+v", r)
	}
	// The old grants stop counting 4.4 s after they were made: then the
	// units come back (grants again), with nothing refunded.
	waitFor(t, "the old grants to expire", func() bool {
		return askOwner(t, n0.nc, part, acquireBody(key, "h3", 10_000_000)).Result == "granted"
	})
	if r := askOwner(t, n0.nc, part, reportBody("return", key, old[1].Grant, e1, 0)); r.Result != "stale_epoch" {
		t.Fatalf("return of an expired old grant: %+v", r)
	}
	if d := decide(t, n0.nc, "rl.v1.decide", req(map[string]string{"tenant": tenant}, `"dry_run":true`)); whole(d) > 100-50-1 {
		t.Fatalf("remaining %v: the expired grants were refunded", d.Remaining)
	}
}

// TestLeasedOwnerStopped: a graceful stop of a leased key's owner hands
// its partition over with the grants in the checkpointed record: the next
// owner counts them and refuses their reports.
func TestLeasedOwnerStopped(t *testing.T) {
	e := server(t, t.TempDir())
	cfg := func(id string) mesh.NodeConfig { return mesh.NodeConfig{NodeID: id, LeaseTime: ownershipLease} }
	n0 := startNode(t, e, cfg("n0"))
	nc1 := connect(t, e)
	n1, err := mesh.NewNode(nc1, cfg("n1"))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	if err := n1.Start(ctx); err != nil {
		t.Fatal(err)
	}
	hs1 := httptest.NewServer(n1.HTTPHandler())
	t.Cleanup(hs1.Close)
	nodes := []*testNode{n0, {node: n1, id: "n1", nc: nc1, http: hs1}}
	rev := putPolicy(t, n0.nc, "rl_policies", "leased", slowLeased)
	waitApplied(t, "leased", rev, nodes...)
	waitExclusive(t, nodes)
	key := leasedKey(leasedTenantOwnedBy(t, nodes, 1))
	part := partitionOf(key)
	g := askOwner(t, n0.nc, part, acquireBody(key, "h1", 10_000_000))
	if g.Result != "granted" {
		t.Fatalf("acquire: %+v", g)
	}
	if err := n1.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "n0 takes the partition over", func() bool { return serves(t, n0, part) })
	if gs := grantsOf(t, n0.nc, key); len(gs) != 1 || gs[0].ID != g.Grant || gs[0].Epoch != g.Epoch {
		t.Fatalf("after the handoff the record holds %+v", gs)
	}
	if r := askOwner(t, n0.nc, part, reportBody("report", key, g.Grant, g.Epoch, 1)); r.Result != "stale_epoch" {
		t.Fatalf("report after the handoff: %+v", r)
	}
}

// gateways starts n leasing SDK clients, each on its own connection from
// conn(i), closed (their grants returned) at cleanup.
func gateways(t *testing.T, n int, conn func(i int) *nats.Conn, opts ...client.Option) []*client.Client {
	t.Helper()
	gs := make([]*client.Client, n)
	for i := range gs {
		c, err := client.New(conn(i), append([]client.Option{client.Leasing(fmt.Sprintf("gw-%d", i)),
			client.Timeout(2 * time.Second)}, opts...)...)
		if err != nil {
			t.Fatal(err)
		}
		gs[i] = c
		t.Cleanup(func() { _ = c.Close() })
	}
	return gs
}

// tally counts decisions of a run.
type tally struct {
	mu                      sync.Mutex
	admitted, denied, local int
	errors                  int
	firstErr                error
}

func (tl *tally) add(r *client.Result, err error) {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	switch {
	case err != nil:
		tl.errors++
		if tl.firstErr == nil {
			tl.firstErr = err
		}
		return
	case r.Allowed:
		tl.admitted++
	default:
		tl.denied++
	}
	if r.Source == client.SourceLease {
		tl.local++
	}
}

func (tl *tally) get() (admitted, denied, local, errs int) {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	return tl.admitted, tl.denied, tl.local, tl.errors
}

// burstGateways sends n decisions at once, request i through gws[i%len].
func burstGateways(gws []*client.Client, d map[string]string, n int, tl *tally) {
	var start, wg sync.WaitGroup
	start.Add(1)
	for i := range n {
		wg.Go(func() {
			start.Wait()
			ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
			defer cancel()
			tl.add(gws[i%len(gws)].Decide(ctx, d, 1))
		})
	}
	start.Done()
	wg.Wait()
}

// loadGateways runs every gateway in a loop of decisions (a pause of
// pause between them) until stop is closed.
func loadGateways(gws []*client.Client, d map[string]string, pause time.Duration, tl *tally, stop chan struct{}) *sync.WaitGroup {
	var wg sync.WaitGroup
	for _, g := range gws {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
				tl.add(g.Decide(ctx, d, 1))
				cancel()
				if pause > 0 {
					time.Sleep(pause)
				}
			}
		})
	}
	return &wg
}

// TestLeasedGateways: Acme's story on one server with two nodes: six SDK
// gateways hold sub-grants of the nodes' grants and spend them locally;
// 80 requests at once admit at most the burst plus the bound (40 + 40);
// under load above the contract, most decisions are local, and the whole
// run admits no more than burst + rate × elapsed + bound. Closing the
// gateways returns their grants.
func TestLeasedGateways(t *testing.T) {
	e := server(t, t.TempDir())
	nodes := []*testNode{startNode(t, e, mesh.NodeConfig{}), startNode(t, e, mesh.NodeConfig{})}
	rev := putPolicy(t, nodes[0].nc, "rl_policies", "leased", leasedPolicy)
	waitApplied(t, "leased", rev, nodes...)
	gws := gateways(t, 6, func(int) *nats.Conn { return connect(t, e) })
	d := map[string]string{"tenant": "acme"}
	var tl tally
	start := time.Now()
	burstGateways(gws, d, 80, &tl)
	admitted, denied, local, errs := tl.get()
	if errs > 0 || admitted+denied != 80 {
		t.Fatalf("burst: %d admitted, %d denied, %d errors (%v)", admitted, denied, errs, tl.firstErr)
	}
	if admitted > int(leasedBurst+leasedBound) {
		t.Fatalf("80 at once admitted %d, above 40 + bound 40", admitted)
	}
	t.Logf("80 at once: %d admitted (%d decided locally)", admitted, local)
	stop := make(chan struct{})
	wg := loadGateways(gws, d, time.Millisecond, &tl, stop)
	time.Sleep(3 * time.Second)
	close(stop)
	wg.Wait()
	elapsed := time.Since(start).Seconds()
	admitted, denied, local, errs = tl.get()
	total := admitted + denied
	if errs > 0 {
		t.Fatalf("%d errors: %v", errs, tl.firstErr)
	}
	if limit := leasedBurst + leasedRate*elapsed + leasedBound; float64(admitted) > limit {
		t.Fatalf("admitted %d in %.2fs, above the contract plus the bound (%.1f)", admitted, elapsed, limit)
	}
	if local*2 < total {
		t.Fatalf("only %d of %d decisions local", local, total)
	}
	t.Logf("run of %.2fs: %d admitted (contract %.0f + bound %.0f), %d denied, %.1f%% local",
		elapsed, admitted, leasedBurst+leasedRate*elapsed, leasedBound, denied, 100*float64(local)/float64(total))
	for _, g := range gws {
		if err := g.Close(); err != nil {
			t.Fatalf("Close: %v", err)
		}
	}
}

// stamped counts decisions with the instants of the admissions.
type stamped struct {
	mu       sync.Mutex
	admits   []time.Time
	local    int
	failures int // failure-behaviour results (no node could decide)
	other    int // every other result
}

func (s *stamped) add(r *client.Result, err error) {
	now := time.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case err != nil:
		s.failures++
		return
	case r.Source == client.SourceFailClosed:
		s.failures++
		return
	case r.Allowed:
		s.admits = append(s.admits, now)
	}
	if r.Source == client.SourceLease {
		s.local++
	}
	s.other++
}

// admittedIn counts the admissions in [from, to).
func (s *stamped) admittedIn(from, to time.Time) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, at := range s.admits {
		if !at.Before(from) && at.Before(to) {
			n++
		}
	}
	return n
}

// decided returns the decisions made by a node or from a grant (not by
// the failure behaviour) so far.
func (s *stamped) decided() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.other
}

// TestLeasedRegionsCut: leased mode on a two-region supercluster (the
// buckets and the journal live in eu), three SDK gateways per region on
// two keys, one owned by the eu node and one by the us node, under load
// above the contract. The gateway links of us are cut for longer than the
// grant ttl (2 s): us gateways keep admitting only within the grants they
// and their node held at the cut, at most max_outstanding per key, and
// nothing once those expired (their decisions then fail closed); eu keeps
// deciding both keys (it takes the us node's partitions over, with the
// grants in its journal). After the heal both regions decide again
// (within a bounded poll; the time is logged), and over the whole run
// each key admits at most burst + rate × elapsed + the bound.
func TestLeasedRegionsCut(t *testing.T) {
	if testing.Short() {
		t.Skip("supercluster partition test")
	}
	rn := startRegionNodes(t, mesh.NodeConfig{LeaseTime: regionLease})
	rev := putPolicy(t, rn.eu.nc, "rl_policies", "leased", leasedPolicy)
	waitApplied(t, "leased", rev, rn.nodes()...)
	regions := []string{"eu", "us"}
	tenants := map[string]string{ // by the region of the key's owner
		"eu": rn.tenantOwnedIn(t, "eu", leasedKey),
		"us": rn.tenantOwnedIn(t, "us", leasedKey),
	}
	failClosed := client.OnUnavailable(func(string, map[string]string) client.Failure { return client.FailClosed() })
	gws := map[string][]*client.Client{}
	for _, r := range regions {
		conns := rn.regionConns(t, r, 3)
		gws[r] = gateways(t, 3, func(i int) *nats.Conn { return conns[i] }, failClosed, client.Timeout(time.Second))
	}
	// tallies[gateway region][owner region]
	tallies := map[string]map[string]*stamped{}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	start := time.Now()
	for _, c := range regions {
		tallies[c] = map[string]*stamped{}
		for _, o := range regions {
			st := &stamped{}
			tallies[c][o] = st
			d := map[string]string{"tenant": tenants[o]}
			for _, g := range gws[c] {
				wg.Go(func() {
					for {
						select {
						case <-stop:
							return
						default:
						}
						ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
						st.add(g.Decide(ctx, d, 1))
						cancel()
						time.Sleep(2 * time.Millisecond)
					}
				})
			}
		}
	}
	t.Cleanup(func() {
		select {
		case <-stop:
		default:
			close(stop)
		}
		wg.Wait()
	})
	for _, c := range regions {
		for _, o := range regions {
			st := tallies[c][o]
			waitFor(t, fmt.Sprintf("%s gateways spend the key owned in %s locally", c, o), func() bool {
				st.mu.Lock()
				defer st.mu.Unlock()
				return st.local > 0
			})
		}
	}

	ttl := 2 * time.Second
	rn.sc.IsolateRegion(t, "us")
	cutAt := time.Now()
	time.Sleep(ttl + 3*time.Second)
	healAt := time.Now()
	rn.sc.HealRegion(t, "us")
	healed := time.Now()
	for _, o := range regions {
		during := tallies["us"][o].admittedIn(cutAt, healAt)
		late := tallies["us"][o].admittedIn(cutAt.Add(ttl+500*time.Millisecond), healAt)
		t.Logf("cut: us gateways, key owned in %s: %d admitted while cut, %d of them more than ttl+0.5s after the cut", o, during, late)
		if float64(during) > leasedBound {
			t.Errorf("us gateways admitted %d of the key owned in %s while cut off, above max_outstanding %v", during, o, leasedBound)
		}
		if late > 0 {
			t.Errorf("us gateways admitted %d of the key owned in %s after every grant had expired", late, o)
		}
		if n := tallies["eu"][o].admittedIn(cutAt.Add(ttl+500*time.Millisecond), healAt); n == 0 {
			t.Errorf("eu gateways admitted nothing of the key owned in %s while us was cut off", o)
		}
	}
	before := map[string]map[string]int{"eu": {}, "us": {}}
	for _, c := range regions {
		for _, o := range regions {
			before[c][o] = tallies[c][o].decided()
		}
	}
	back := map[string]time.Duration{}
	waitWithin(t, superclusterFormTimeout+ttl, "both regions decide both keys after the heal", func() bool {
		for _, c := range regions {
			for _, o := range regions {
				what := c + " gateways, key owned in " + o
				if _, ok := back[what]; !ok && tallies[c][o].decided()-before[c][o] >= 20 {
					back[what] = time.Since(healAt).Round(time.Millisecond)
				}
			}
		}
		return len(back) == 4
	})
	t.Logf("healed (the supercluster formed again %s after the heal began): decisions again after %v",
		healed.Sub(healAt).Round(time.Millisecond), back)
	close(stop)
	wg.Wait()
	elapsed := time.Since(start).Seconds()
	for _, o := range regions {
		admitted := tallies["eu"][o].admittedIn(start, time.Now()) + tallies["us"][o].admittedIn(start, time.Now())
		limit := leasedBurst + leasedRate*elapsed + leasedBound
		t.Logf("key owned in %s: admitted %d over %.1fs; contract %.0f + bound %.0f", o, admitted, elapsed,
			leasedBurst+leasedRate*elapsed, leasedBound)
		if float64(admitted) > limit {
			t.Errorf("OVERSHOOT: key owned in %s admitted %d, above the contract plus the bound (%.1f)", o, admitted, limit)
		}
	}
}

// crashLeased: one grant at a time (max_outstanding = size = 10) lasting
// 1 s, from a bucket of 100 that barely refills, so who holds the grant
// is plain to see.
const crashLeased = `{"match": {"tenant": "*"}, "key": ["tenant"], "mode": "leased",
 "lease": {"size": 10, "ttl": "1s", "max_outstanding": 10},
 "limits": [{"name": "rate", "algorithm": "token_bucket", "rate": "1/h", "burst": 100}]}`

// TestLeasedHolderCrash: a gateway holding the key's only grant (through
// its node: a sub-grant of all of it) crashes after spending 3: its
// connection closes, nothing is returned. Meanwhile another gateway is
// decided remotely (strict: the grant is outstanding, no other fits).
// The crashed gateway's units are never refunded: its node reports its
// grant used (a sub-grant counts as spent until it is given back), which
// makes room again, and returns it at its deadline; the node asks for a
// new grant and the other gateway spends locally again.
func TestLeasedHolderCrash(t *testing.T) {
	e := server(t, t.TempDir())
	tn := startNode(t, e, mesh.NodeConfig{})
	rev := putPolicy(t, tn.nc, "rl_policies", "leased", crashLeased)
	waitApplied(t, "leased", rev, tn)
	d := map[string]string{"tenant": "crash"}
	crashConn := connect(t, e)
	gws := gateways(t, 2, func(i int) *nats.Conn {
		if i == 0 {
			return crashConn
		}
		return connect(t, e)
	})
	ctx := context.Background()
	for i := range 3 {
		r, err := gws[0].Decide(ctx, d, 1)
		if err != nil || !r.Allowed || r.Source != client.SourceLease {
			t.Fatalf("gateway 0, decision %d: %+v %v", i, r, err)
		}
	}
	crashConn.Close()
	crashed := time.Now()
	r, err := gws[1].Decide(ctx, d, 1)
	if err != nil || !r.Allowed || r.Source != client.SourceService {
		t.Fatalf("gateway 1 while the grant is held: %+v %v, want a remote admission", r, err)
	}
	remote := 1
	waitFor(t, "gateway 1 spends locally", func() bool {
		r, err := gws[1].Decide(ctx, d, 1)
		if err != nil || !r.Allowed {
			t.Fatalf("gateway 1: %+v %v", r, err)
		}
		if r.Source == client.SourceService {
			remote++
		}
		return r.Source == client.SourceLease
	})
	t.Logf("gateway 1 spent locally %s after the crash (%d remote decisions before)", time.Since(crashed).Round(time.Millisecond), remote)
	// Debited from the key: the crashed gateway's grant (3 spent and 7
	// never refunded), the node's next grant of 10 (gateway 1's sub-grant
	// and any remote decision the node answered from it), and each remote
	// decision the owner made itself: 100 − 10 − 10 − (remote − answered
	// from the node's grant) remain, less the dry run's 1.
	fromGrant := int64(metricValue(t, tn, `limitmesh_lease_local_decisions_total{policy="leased",result="allowed"}`))
	dr := decide(t, tn.nc, "rl.v1.decide", req(d, `"dry_run":true`))
	if want := int64(100-10-10-1) - (int64(remote) - fromGrant); whole(dr) != want {
		t.Fatalf("remaining %v, want %d (%d remote decisions, %d of them from the node's grant; the crashed grant's 7 units are not refunded)",
			dr.Remaining, want, remote, fromGrant)
	}
}

// skewedClock returns a clock that is off by offset and runs at rate
// times real time.
func skewedClock(offset time.Duration, rate float64) func() time.Time {
	base := time.Now()
	return func() time.Time {
		return base.Add(offset + time.Duration(float64(time.Since(base))*rate))
	}
}

// TestLeasedClockSkew: gateways whose clocks are off by an hour either
// way, run 25% fast, or run 9% slow (within the documented margin: a
// tenth of the ttl) spend their grants locally, and under load above the
// contract the key still admits at most burst + rate × elapsed + the
// bound. (Holders count a grant's life from their own instant of asking,
// so an offset changes nothing; a slow clock is what the margin is for.)
func TestLeasedClockSkew(t *testing.T) {
	e := server(t, t.TempDir())
	nodes := []*testNode{startNode(t, e, mesh.NodeConfig{}), startNode(t, e, mesh.NodeConfig{})}
	rev := putPolicy(t, nodes[0].nc, "rl_policies", "leased", strings.Replace(leasedPolicy, `"ttl": "2s"`, `"ttl": "500ms"`, 1))
	waitApplied(t, "leased", rev, nodes...)
	clocks := []func() time.Time{skewedClock(time.Hour, 1), skewedClock(-time.Hour, 1), skewedClock(0, 1.25), skewedClock(0, 0.91)}
	d := map[string]string{"tenant": "skew"}
	var gws []*client.Client
	tallies := make([]*tally, len(clocks))
	for i, clk := range clocks {
		gws = append(gws, gateways(t, 1, func(int) *nats.Conn { return connect(t, e) }, client.Clock(clk))...)
		tallies[i] = &tally{}
	}
	stop := make(chan struct{})
	start := time.Now()
	var wgs []*sync.WaitGroup
	for i, g := range gws {
		wgs = append(wgs, loadGateways([]*client.Client{g}, d, time.Millisecond, tallies[i], stop))
	}
	time.Sleep(3 * time.Second)
	close(stop)
	for _, wg := range wgs {
		wg.Wait()
	}
	elapsed := time.Since(start).Seconds()
	admitted := 0
	for i, tl := range tallies {
		a, dn, local, errs := tl.get()
		if errs > 0 {
			t.Fatalf("gateway %d: %d errors: %v", i, errs, tl.firstErr)
		}
		if local == 0 {
			t.Errorf("gateway %d (skewed clock) never decided locally", i)
		}
		t.Logf("gateway %d: %d admitted, %d denied, %d local", i, a, dn, local)
		admitted += a
	}
	if limit := leasedBurst + leasedRate*elapsed + leasedBound; float64(admitted) > limit {
		t.Fatalf("admitted %d in %.2fs, above the contract plus the bound (%.1f)", admitted, elapsed, limit)
	}
	t.Logf("admitted %d in %.2fs: contract %.0f + bound %.0f", admitted, elapsed, leasedBurst+leasedRate*elapsed, leasedBound)
}
