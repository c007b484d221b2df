package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"sync"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/mesh"
	"github.com/limitmesh/limitmesh/mesh/client"
	"github.com/nats-io/nats.go"
)

// layeredReply is a decide reply with its layers (CONTRACT §11).
type layeredReply struct {
	reply
	Layers []struct {
		Layer     string  `json:"layer"`
		Policy    string  `json:"policy"`
		Revision  uint64  `json:"revision"`
		Allowed   bool    `json:"allowed"`
		Remaining float64 `json:"remaining"`
	} `json:"layers"`
}

func layeredDecide(t testing.TB, nc *nats.Conn, body string) layeredReply {
	t.Helper()
	m, err := nc.Request("rl.v1.decide", []byte(body), testTimeout)
	if err != nil {
		t.Fatalf("decide: %v", err)
	}
	var r layeredReply
	r.Partition = -1
	if err := json.Unmarshal(m.Data, &r); err != nil {
		t.Fatalf("reply %q: %v", m.Data, err)
	}
	if m.Header != nil {
		r.Code = m.Header.Get("Nats-Service-Error-Code")
	}
	return r
}

// layersOf returns a layered reply's remaining units by policy.
func (r layeredReply) remaining() map[string]float64 {
	out := map[string]float64{}
	for _, l := range r.Layers {
		out[l.Policy] = l.Remaining
	}
	return out
}

// The §18 example: a user's own budget, the tenant's aggregate, a search
// cluster's protection limit and a monthly quota, each in its layer. Rates
// of 1/h keep the counts exact however slowly the machine answers.
var layerPolicies = map[string]string{
	"per-user":       `{"match":{"tenant":"*","user":"*"},"key":["tenant","user"],"layer":"user","limits":[{"algorithm":"token_bucket","rate":"1/h","burst":5}]}`,
	"tenant-agg":     `{"match":{"tenant":"*"},"key":["tenant"],"layer":"tenant","limits":[{"algorithm":"token_bucket","rate":"1/h","burst":8}]}`,
	"search-protect": `{"match":{"destination":"search-cluster"},"layer":"protection","limits":[{"algorithm":"token_bucket","rate":"1/h","burst":50}]}`,
	"monthly":        `{"match":{"tenant":"*"},"key":["tenant"],"layer":"quota","limits":[{"algorithm":"quota","limit":1000,"period":"month"}]}`,
}

func putLayerPolicies(t *testing.T, nc *nats.Conn, nodes ...*testNode) {
	t.Helper()
	for name, doc := range layerPolicies {
		rev := putPolicy(t, nc, "rl_policies", name, doc)
		waitApplied(t, name, rev, nodes...)
	}
}

func userReq(user string, extra string) string {
	return req(map[string]string{"tenant": "acme", "user": user, "destination": "search-cluster"}, extra)
}

// TestLayersAllOrNothing: a request meets four layers and is admitted only
// when all admit, spending in all; a user denied by the tenant aggregate
// spends nothing of its own budget, nor of the protection limit and the
// quota. The reply names the denying layer and lists every layer.
func TestLayersAllOrNothing(t *testing.T) {
	e := server(t, t.TempDir())
	tn := startNode(t, e, mesh.NodeConfig{UsageInterval: 50 * time.Millisecond, LeaseTime: ownershipLease})
	putLayerPolicies(t, tn.nc, tn)

	for i := range 5 {
		r := layeredDecide(t, tn.nc, userReq("u1", ""))
		if r.Code != "" || !r.Allowed || len(r.Layers) != 4 {
			t.Fatalf("u1 request %d: %+v", i, r)
		}
		// Admitted: the layer with the least left names the reply.
		if r.Policy != "per-user" || !near(r.Remaining, float64(4-i)) || r.RetryAfterMs != 0 {
			t.Fatalf("u1 request %d: %+v, want per-user with %d left", i, r, 4-i)
		}
	}
	// u1's own budget is spent: the user layer denies, and nothing is
	// spent in the others.
	r := layeredDecide(t, tn.nc, userReq("u1", ""))
	if r.Allowed || r.Policy != "per-user" || r.RetryAfterMs <= 0 {
		t.Fatalf("u1's sixth: %+v", r)
	}
	// u2 gets the 3 the tenant has left; then the tenant aggregate denies.
	for i := range 3 {
		if r := layeredDecide(t, tn.nc, userReq("u2", "")); !r.Allowed {
			t.Fatalf("u2 request %d: %+v", i, r)
		}
	}
	r = layeredDecide(t, tn.nc, userReq("u2", ""))
	if r.Allowed || r.Policy != "tenant-agg" {
		t.Fatalf("u2 beyond the tenant aggregate: %+v", r)
	}
	rem := r.remaining()
	if !near(rem["per-user"], 2) || !near(rem["tenant-agg"], 0) || !near(rem["search-protect"], 42) || !near(rem["monthly"], 992) {
		t.Fatalf("layers after the denial: %+v", r.Layers)
	}
	// A dry run once it is quiet: the denial spent nothing anywhere (a
	// denied request's layers show what they hold, as it leaves them).
	d := layeredDecide(t, tn.nc, userReq("u2", `"dry_run":true`))
	rem = d.remaining()
	if d.Allowed || !near(rem["per-user"], 2) || !near(rem["search-protect"], 42) || !near(rem["monthly"], 992) {
		t.Fatalf("dry run after the denial: %+v", d.Layers)
	}
	// A descriptor meeting one layer only is decided as before (no layers
	// in the reply).
	one := decide(t, tn.nc, "rl.v1.decide", req(map[string]string{"destination": "search-cluster"}, ""))
	if !one.Allowed || one.Policy != "search-protect" {
		t.Fatalf("one layer: %+v", one)
	}
	// The ledger counts each layer's admissions under its own policy.
	day := time.Now().UTC().Format("2006-01-02")
	var last string
	defer func() { t.Logf("ledger: %s", last) }()
	waitFor(t, "the layers' ledger entries", func() bool {
		u1, ok1 := ledgerTotals(t, tn.nc, "per-user", day, "p.per-user.tenant=acme.user=u1")
		ta, ok2 := ledgerTotals(t, tn.nc, "tenant-agg", day, "p.tenant-agg.tenant=acme")
		sp, ok3 := ledgerTotals(t, tn.nc, "search-protect", day, "p.search-protect.destination=search-cluster")
		last = fmt.Sprintf("%v %+v %v %+v %v %+v", ok1, u1, ok2, ta, ok3, sp)
		return ok1 && ok2 && ok3 && u1.Allowed == 5 && u1.Denied == 1 && ta.Allowed == 8 && sp.Allowed == 9 && ta.Denied == 1
	})
}

// TestLayersUnderLoad: many connections send the §18 scenario's requests
// at once for two users; every layer admits at most its burst, and each
// admitted request spent in every layer (the layers' totals agree).
func TestLayersUnderLoad(t *testing.T) {
	e := server(t, t.TempDir())
	tn := startNode(t, e, mesh.NodeConfig{UsageInterval: 50 * time.Millisecond, LeaseTime: ownershipLease})
	putLayerPolicies(t, tn.nc, tn)
	conns := make([]*nats.Conn, 8)
	for i := range conns {
		conns[i] = connect(t, e)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	admitted := map[string]int{}
	for i := range 200 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			user := fmt.Sprintf("u%d", i%3)
			m, err := conns[i%len(conns)].Request("rl.v1.decide", []byte(userReq(user, "")), testTimeout)
			if err != nil {
				t.Errorf("request: %v", err)
				return
			}
			var r layeredReply
			if err := json.Unmarshal(m.Data, &r); err != nil || m.Header.Get("Nats-Service-Error-Code") != "" {
				t.Errorf("reply %q: %v", m.Data, err)
				return
			}
			if r.Allowed {
				mu.Lock()
				admitted[user]++
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	total := 0
	for u, n := range admitted {
		if n > 5 {
			t.Errorf("user %s admitted %d, its burst is 5", u, n)
		}
		total += n
	}
	if total != 8 {
		t.Errorf("admitted %d in all (%v), the tenant's burst is 8 and the users' 15", total, admitted)
	}
	// Dry runs (denied: the tenant is spent, so they show what the
	// layers hold): every admission spent in every layer, no denial in any.
	d := layeredDecide(t, tn.nc, userReq("u9", `"dry_run":true`))
	rem := d.remaining()
	if d.Allowed || !near(rem["tenant-agg"], 0) || !near(rem["search-protect"], float64(50-total)) || !near(rem["monthly"], float64(1000-total)) {
		t.Fatalf("after the load: %+v", d.Layers)
	}
	for u, n := range admitted {
		if d := layeredDecide(t, tn.nc, userReq(u, `"dry_run":true`)); !near(d.remaining()["per-user"], float64(5-n)) {
			t.Errorf("user %s admitted %d, its layer has %v left", u, n, d.remaining()["per-user"])
		}
	}
}

// near reports whether units a are b give or take what a 1/h bucket
// refills while a test runs.
func near(a, b float64) bool { return a >= b && a < b+0.01 }

// TestDecideAll: the SDK's DecideAll (the node's decide_all endpoint, the
// Envoy bridge's): several descriptors all or nothing; when one is
// denied, the others spend nothing.
func TestDecideAll(t *testing.T) {
	e := server(t, t.TempDir())
	tn := startNode(t, e, mesh.NodeConfig{UsageInterval: 50 * time.Millisecond, LeaseTime: ownershipLease})
	putLayerPolicies(t, tn.nc, tn)
	c, err := client.New(connect(t, e))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	user := map[string]string{"tenant": "acme", "user": "u5"}
	search := map[string]string{"destination": "search-cluster"}
	allowed, res, err := c.DecideAll(ctx, []client.Item{{Descriptor: user, Cost: 5}, {Descriptor: search, Cost: 1}})
	if err != nil || !allowed || len(res) != 2 || !res[0].Allowed || !res[1].Allowed || res[1].Policy != "search-protect" {
		t.Fatalf("first: %v %+v %v", allowed, res, err)
	}
	// u5's budget is spent: the pair is denied, and the search limit
	// spends nothing.
	allowed, res, err = c.DecideAll(ctx, []client.Item{{Descriptor: user, Cost: 1}, {Descriptor: search, Cost: 10}})
	if err != nil || allowed || res[0].Allowed || res[0].Policy != "per-user" || !res[1].Allowed {
		t.Fatalf("second: %v %+v %v", allowed, res, err)
	}
	if r := decide(t, tn.nc, "rl.v1.decide", req(search, `"dry_run":true`)); !near(r.Remaining, 48) {
		t.Fatalf("the search limit after the denied pair: %+v (want 48 left after a request of 1)", r)
	}
	// A descriptor no policy matches is admitted, and does not stop the rest.
	allowed, res, err = c.DecideAll(ctx, []client.Item{{Descriptor: map[string]string{"other": "x"}, Cost: 1}, {Descriptor: search, Cost: 1}})
	if err != nil || !allowed || res[0].Policy != "" || !res[1].Allowed {
		t.Fatalf("unmatched: %v %+v %v", allowed, res, err)
	}
}

// TestLayersOwnerKilled: the §18 layers on three serve processes, under
// load from every process; the owner of the tenant aggregate's key is
// SIGKILLed mid-load. No layer admits beyond its burst (the rates are
// 1/h: the bursts are the contract), every request a client saw admitted
// spent in every layer, and once HoldTTL has passed no hold is left: the
// layers' spends, read by dry runs, stay where they are.
func TestLayersOwnerKilled(t *testing.T) {
	if testing.Short() {
		t.Skip("kill test with three processes")
	}
	procs := startProcs(t, procSpec{n: 3})
	urls := clientURLs(procs)
	admin := connectURLs(t, urls...)
	policies := map[string]string{
		"per-user":       `{"match":{"tenant":"*","user":"*"},"key":["tenant","user"],"layer":"user","limits":[{"algorithm":"token_bucket","rate":"1/h","burst":120}]}`,
		"tenant-agg":     `{"match":{"tenant":"*"},"key":["tenant"],"layer":"tenant","limits":[{"algorithm":"token_bucket","rate":"1/h","burst":300}]}`,
		"search-protect": `{"match":{"destination":"search-cluster"},"layer":"protection","limits":[{"algorithm":"token_bucket","rate":"1/h","burst":1000}]}`,
	}
	for name, doc := range policies {
		rev := putPolicy(t, admin, "rl_policies", name, doc)
		waitProcsApplied(t, name, rev, procs...)
	}
	conns := make([]*nats.Conn, len(procs))
	for i := range procs {
		conns[i] = connectURLs(t, append(urls[i:i+1:i+1], urls...)...)
	}
	var (
		mu       sync.Mutex
		admitted = map[string]int{}
		failed   int // lost or 503: may have spent (A3, A4)
		stop     = make(chan struct{})
		wg       sync.WaitGroup
	)
	count := func() int {
		mu.Lock()
		defer mu.Unlock()
		n := 0
		for _, v := range admitted {
			n += v
		}
		return n
	}
	for g := range 12 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			nc := conns[g%len(conns)]
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				user := fmt.Sprintf("u%d", (g+i)%4)
				m, err := nc.Request("rl.v1.decide", []byte(userReq(user, "")), 2*time.Second)
				if err != nil || m.Header.Get("Nats-Service-Error-Code") != "" {
					mu.Lock()
					failed++ // lost or 503: its holds end within HoldTTL
					mu.Unlock()
					continue
				}
				var r layeredReply
				if json.Unmarshal(m.Data, &r) == nil && r.Allowed {
					mu.Lock()
					admitted[user]++
					mu.Unlock()
				}
			}
		}()
	}
	waitFor(t, "admissions before the kill", func() bool { return count() >= 60 })
	h := fnv.New32a()
	h.Write([]byte("p.tenant-agg.tenant=acme"))
	owner := procOfNode(t, procs, partOwner(admin, int(h.Sum32()%64)))
	if owner < 0 {
		t.Fatal("no process owns the tenant key's partition")
	}
	before := count()
	procs[owner].kill()
	survivor := conns[(owner+1)%len(conns)]
	waitWithin(t, faultTimeout, "admissions after the kill", func() bool { return count() > before+20 || count() >= 300 })
	close(stop)
	wg.Wait()
	total := 0
	for u, n := range admitted {
		if n > 120 {
			t.Errorf("user %s admitted %d, its burst is 120", u, n)
		}
		total += n
	}
	if total > 300 {
		t.Errorf("admitted %d, the tenant's burst is 300", total)
	}
	// Holds end within HoldTTL (1 s): then the layers are still.
	var still layeredReply
	waitWithin(t, faultTimeout, "the layers still", func() bool {
		still = layeredDecide(t, survivor, userReq("u9", `"dry_run":true`))
		time.Sleep(1500 * time.Millisecond)
		again := layeredDecide(t, survivor, userReq("u9", `"dry_run":true`))
		if still.Code != "" || again.Code != "" || len(still.Layers) != 3 {
			return false
		}
		for name, v := range again.remaining() {
			if !near(v, still.remaining()[name]) { // a 1/h refill moves it by less
				return false
			}
		}
		return true
	})
	rem := still.remaining()
	// A dry run denied (the tenant spent) shows what the layers hold; one
	// admitted shows it less the request's 1.
	adj := 0.0
	if still.Allowed {
		adj = 1
	}
	// Every admission spent in every layer, and no layer beyond its burst.
	// A request answered 503 or lost may have spent in some layers (its
	// holds that could not be released, or whose coordinator died, end as
	// spent: A3, A4), at most once per such request and layer.
	tenantSpent := 300 - rem["tenant-agg"] - adj
	protectSpent := 1000 - rem["search-protect"] - adj
	for name, spent := range map[string]float64{"tenant": tenantSpent, "protection": protectSpent} {
		if spent < float64(total)-0.01 || spent > float64(total+failed)+0.01 {
			t.Errorf("admitted %d, %d lost or 503: the %s layer spent %v", total, failed, name, spent)
		}
	}
	if tenantSpent > 300.01 {
		t.Errorf("the tenant layer spent %v, beyond its burst", tenantSpent)
	}
	t.Logf("killed %s; admitted %d (%v), %d lost or 503; spent: tenant %v, protection %v", procs[owner].name, total, admitted, failed, tenantSpent, protectSpent)
}
