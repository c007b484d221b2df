package integration

import (
	"encoding/json"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/mesh"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
)

// slowPolicy refills so slowly (1 unit per hour) that a test never sees a
// refill of a whole unit: decisions depend only on what was spent.
const slowPolicy = `{"match": {"tenant": "*"}, "key": ["tenant"],
 "limits": [{"name": "rate", "algorithm": "token_bucket", "rate": "1/h", "burst": 40}]}`

// single starts one server and node with slowPolicy applied as "slow".
func single(t *testing.T) (*mesh.Embedded, *testNode, uint64) {
	t.Helper()
	e := server(t, t.TempDir())
	tn := startNode(t, e, mesh.NodeConfig{})
	rev := putPolicy(t, tn.nc, "rl_policies", "slow", slowPolicy)
	waitRevision(t, tn.nc, map[string]string{"tenant": "probe"}, rev)
	return e, tn, rev
}

// waitRevision polls with dry runs until desc is decided under rev.
func waitRevision(t *testing.T, nc *nats.Conn, desc map[string]string, rev uint64) {
	t.Helper()
	waitFor(t, "policy revision applied", func() bool {
		return decide(t, nc, "rl.v1.decide", req(desc, `"dry_run":true`)).Revision == rev
	})
}

// TestRefillAfterPause: an emptied Acme bucket (10/s) denies with
// retry_after_ms 100, and after a pause admits exactly what refilled. The
// node's clock moves only when the test moves it, so the counts are exact
// however slowly a loaded machine answers.
func TestRefillAfterPause(t *testing.T) {
	e := server(t, t.TempDir())
	var now atomic.Int64
	now.Store(time.Now().UnixNano())
	tn := startNode(t, e, mesh.NodeConfig{Clock: func() time.Time { return time.Unix(0, now.Load()) }})
	rev := putPolicy(t, tn.nc, "rl_policies", "acme-search", acmePolicy)
	waitRevision(t, tn.nc, acmeDesc, rev)
	if r := decide(t, tn.nc, "rl.v1.decide", req(acmeDesc, `"cost":40`)); !r.Allowed || r.Remaining != 0 {
		t.Fatalf("the whole burst: %+v", r)
	}
	denied := decide(t, tn.nc, "rl.v1.decide", req(acmeDesc, ""))
	if denied.Allowed || denied.RetryAfterMs != 100 {
		t.Fatalf("after the burst: %+v, want a denial with retry_after_ms 100", denied)
	}
	for _, step := range []struct {
		pause time.Duration
		want  int
	}{
		{99 * time.Millisecond, 0},  // 0.99 units
		{1 * time.Millisecond, 1},   // 1 unit
		{250 * time.Millisecond, 2}, // 2.5 units
		{50 * time.Millisecond, 1},  // 0.5 + 0.5 units
		{time.Hour, 40},             // full again: the burst, not 36,000
	} {
		now.Add(int64(step.pause))
		admitted := 0
		for range step.want + 5 {
			r := decide(t, tn.nc, "rl.v1.decide", req(acmeDesc, ""))
			if r.Code != "" {
				t.Fatalf("after a pause of %v: %+v", step.pause, r)
			}
			if r.Allowed {
				admitted++
			}
		}
		if admitted != step.want {
			t.Fatalf("admitted %d after a pause of %v, want %d (10/s, burst 40)", admitted, step.pause, step.want)
		}
	}
}

func TestWeightedCosts(t *testing.T) {
	_, tn, rev := single(t)
	d := map[string]string{"tenant": "w"}
	r := decide(t, tn.nc, "rl.v1.decide", req(d, `"cost":15`))
	if !r.Allowed || r.Remaining < 25 || r.Remaining >= 25.01 || r.Revision != rev {
		t.Fatalf("cost 15 of 40: %+v", r)
	}
	r = decide(t, tn.nc, "rl.v1.decide", req(d, `"cost":"20.5"`))
	if !r.Allowed || r.Remaining < 4.5 || r.Remaining >= 4.51 {
		t.Fatalf("cost 20.5: %+v", r)
	}
	r = decide(t, tn.nc, "rl.v1.decide", req(d, `"cost":5`))
	if r.Allowed || r.RetryAfterMs <= 0 || r.RetryAfterMs > 1810_000 {
		t.Fatalf("cost 5 with 4.5 left: %+v, want denied within about half an hour (1/h is 277 micro-units/s)", r)
	}
	r = decide(t, tn.nc, "rl.v1.decide", req(d, `"cost":4.5`))
	if !r.Allowed {
		t.Fatalf("cost 4.5 with 4.5 left denied: %+v", r)
	}
	// Above the burst: never.
	r = decide(t, tn.nc, "rl.v1.decide", req(map[string]string{"tenant": "fresh"}, `"cost":41`))
	if r.Allowed || r.RetryAfterMs != -1 {
		t.Fatalf("cost above burst: %+v, want retry_after_ms -1", r)
	}
	// A fresh key is full: a request within capacity is admitted.
	if r := decide(t, tn.nc, "rl.v1.decide", req(map[string]string{"tenant": "fresh"}, `"cost":40`)); !r.Allowed {
		t.Fatalf("cost = burst on a fresh key denied: %+v", r)
	}
}

func TestErrors(t *testing.T) {
	_, tn, _ := single(t)
	putPolicy(t, tn.nc, "rl_policies", "keyed", `{"match":{"app":"x"},"key":["app","user"],"limits":[{"algorithm":"gcra","rate":"1/s","burst":1}]}`)
	waitFor(t, "keyed policy", func() bool {
		return decide(t, tn.nc, "rl.v1.decide", `{"descriptor":{"app":"x","user":"u"},"dry_run":true}`).Policy == "keyed"
	})
	cases := []struct{ name, body, code, symbol string }{
		{"malformed JSON", `{"descriptor":`, "400", "bad_request"},
		{"not an object", `[1,2]`, "400", "bad_request"},
		{"missing descriptor", `{"cost":1}`, "400", "bad_request"},
		{"empty descriptor", `{"descriptor":{}}`, "400", "bad_request"},
		{"bad dimension name", `{"descriptor":{"Tenant":"a"}}`, "400", "bad_request"},
		{"empty value", `{"descriptor":{"tenant":""}}`, "400", "bad_request"},
		{"control character", `{"descriptor":{"tenant":"a\nb"}}`, "400", "bad_request"},
		{"value too long", `{"descriptor":{"tenant":"` + strings.Repeat("v", 129) + `"}}`, "400", "bad_request"},
		{"non-string value", `{"descriptor":{"tenant":7}}`, "400", "bad_request"},
		{"17 dimensions", manyDims(17), "400", "bad_request"},
		{"zero cost", `{"descriptor":{"tenant":"a"},"cost":0}`, "400", "bad_request"},
		{"negative cost", `{"descriptor":{"tenant":"a"},"cost":-2}`, "400", "bad_request"},
		{"exponent cost", `{"descriptor":{"tenant":"a"},"cost":1e2}`, "400", "bad_request"},
		{"too precise cost", `{"descriptor":{"tenant":"a"},"cost":"0.0000001"}`, "400", "bad_request"},
		{"huge cost", `{"descriptor":{"tenant":"a"},"cost":1000000001}`, "400", "bad_request"},
		{"long request_id", `{"descriptor":{"tenant":"a"},"request_id":"` + strings.Repeat("i", 129) + `"}`, "400", "bad_request"},
		{"missing key dimension", `{"descriptor":{"app":"x"}}`, "400", "bad_request"},
		{"over 4 KiB", `{"descriptor":{"tenant":"a"},"pad":"` + strings.Repeat("p", 4096) + `"}`, "413", "too_large"},
		// Bodies that parsers could read differently.
		{"invalid UTF-8", "{\"descriptor\":{\"tenant\":\"\xff\xfe\"}}", "400", "bad_request"},
		{"duplicate dimension", `{"descriptor":{"tenant":"x","tenant":"y"}}`, "400", "bad_request"},
		{"duplicate field", `{"descriptor":{"tenant":"a"},"cost":1,"cost":2}`, "400", "bad_request"},
		{"case-variant field", `{"descriptor":{"tenant":"a"},"Cost":2}`, "400", "bad_request"},
		{"escaped field name", `{"descriptor":{"tenant":"a"},"\u0063ost":2}`, "400", "bad_request"},
		{"unpaired surrogate", `{"descriptor":{"tenant":"a\ud800"}}`, "400", "bad_request"},
	}
	for _, c := range cases {
		r := decide(t, tn.nc, "rl.v1.decide", c.body)
		if r.Code != c.code || r.Error != c.symbol || r.Msg == "" {
			t.Errorf("%s: code %q body error %q message %q, want %s %s", c.name, r.Code, r.Error, r.Msg, c.code, c.symbol)
		}
		if strings.HasPrefix(r.Msg, "mesh:") {
			t.Errorf("%s: message %q leaks the package's error prefix", c.name, r.Msg)
		}
		if f, _, ok := strings.Cut(r.Msg, ":"); ok && strings.Count(r.Msg, f+":") > 1 {
			t.Errorf("%s: message %q names its field twice", c.name, r.Msg)
		}
	}
	// Exactly 4096 bytes is within the limit.
	body := `{"descriptor":{"tenant":"a"},"pad":"`
	body += strings.Repeat("p", 4096-len(body)-2) + `"}`
	if r := decide(t, tn.nc, "rl.v1.decide", body); r.Code != "" {
		t.Errorf("4096-byte body: %+v", r)
	}
	if v := metricValue(t, tn, `limitmesh_decide_errors_total{code="413"}`); v != 1 {
		t.Errorf("413 metric = %v, want 1", v)
	}
}

func manyDims(n int) string {
	m := map[string]string{}
	for i := 0; i < n; i++ {
		m["d"+strings.Repeat("x", i)] = "v"
	}
	b, _ := json.Marshal(map[string]any{"descriptor": m})
	return string(b)
}

func TestUnmatchedAndDryRun(t *testing.T) {
	_, tn, rev := single(t)
	r := decide(t, tn.nc, "rl.v1.decide", `{"descriptor":{"other":"x"}}`)
	if !r.Allowed || r.Policy != "" || r.Revision != 0 || r.Remaining != 0 || r.RetryAfterMs != 0 || r.ResetAfterMs != 0 {
		t.Fatalf("unmatched: %+v", r)
	}
	d := map[string]string{"tenant": "dry"}
	for i := 0; i < 3; i++ {
		r = decide(t, tn.nc, "rl.v1.decide", req(d, `"cost":40,"dry_run":true`))
		if !r.Allowed || r.Revision != rev || r.Remaining != 0 {
			t.Fatalf("dry run %d: %+v", i, r)
		}
	}
	if r := decide(t, tn.nc, "rl.v1.decide", req(d, `"cost":40`)); !r.Allowed {
		t.Fatalf("dry runs spent: %+v", r)
	}
}

// TestRequestIDDedupe: a retry with the same request_id (as after a lost
// reply) gets the first decision and spends once, on either of two nodes.
func TestRequestIDDedupe(t *testing.T) {
	e, tn, _ := single(t)
	other := startNode(t, e, mesh.NodeConfig{})
	d := map[string]string{"tenant": "dd"}
	first := decide(t, tn.nc, "rl.v1.decide", req(d, `"cost":10,"request_id":"req-1"`))
	if !first.Allowed || first.Remaining < 30 || first.Remaining >= 30.01 {
		t.Fatalf("first: %+v", first)
	}
	for i := 0; i < 6; i++ {
		nc := tn.nc
		if i%2 == 1 {
			nc = other.nc
		}
		r := decide(t, nc, "rl.v1.decide", req(d, `"cost":10,"request_id":"req-1"`))
		if r != first {
			t.Fatalf("retry %d: %+v, want the first decision %+v", i, r, first)
		}
	}
	// Spent once: 30 left, so a cost of 30 is admitted and then nothing.
	if r := decide(t, tn.nc, "rl.v1.decide", req(d, `"cost":30`)); !r.Allowed {
		t.Fatalf("after retries: %+v", r)
	}
	// A different id is a different request; a denial is remembered too.
	den := decide(t, tn.nc, "rl.v1.decide", req(d, `"cost":5,"request_id":"req-2"`))
	if den.Allowed {
		t.Fatalf("req-2: %+v", den)
	}
	if r := decide(t, other.nc, "rl.v1.decide", req(d, `"cost":5,"request_id":"req-2"`)); r != den {
		t.Fatalf("req-2 retry: %+v want %+v", r, den)
	}
}

// TestTwoNodesShareState: two nodes on one JetStream serving the same key
// at once admit exactly what one node would: 120 simultaneous requests
// over both nodes (each with a request_id, a 503 retried with it) admit
// exactly the burst of 40, no more (overshoot) and no fewer (a unit spent
// without an admission), and both nodes see the same state afterwards.
func TestTwoNodesShareState(t *testing.T) {
	e, tn, _ := single(t)
	other := startNode(t, e, mesh.NodeConfig{})
	conns := []*nats.Conn{tn.nc, other.nc}
	for i := 0; i < 4; i++ {
		conns = append(conns, connect(t, e))
	}
	d := map[string]string{"tenant": "shared"}
	replies, failed := burstDecisions(t, conns, d, 120)
	if admitted := admittedOf(replies); admitted != 40 {
		t.Fatalf("two nodes admitted %d of 120 (%d attempts retried after a 503 or no reply), want exactly the burst 40",
			admitted, failed)
	}
	// The state both wrote is one: both see it spent.
	for i, nc := range []*nats.Conn{tn.nc, other.nc} {
		if r := decide(t, nc, "rl.v1.decide", req(d, `"dry_run":true`)); r.Allowed || r.Remaining >= 1 {
			t.Fatalf("node %d after the burst: %+v, want the key spent", i, r)
		}
	}
	t.Logf("retried %d, conflicts %v + %v", failed,
		metricValue(t, tn, "limitmesh_cas_conflicts_total"), metricValue(t, other, "limitmesh_cas_conflicts_total"))
}

// TestServiceDiscovery: the node is a micro service named limitmesh with
// the decide endpoint on rl.v1.decide and the lease endpoint on
// rl.v1.lease, in queue group limitmesh.
func TestServiceDiscovery(t *testing.T) {
	_, tn, _ := single(t)
	m, err := tn.nc.Request("$SRV.INFO.limitmesh", nil, testTimeout)
	if err != nil {
		t.Fatal(err)
	}
	var info micro.Info
	if err := json.Unmarshal(m.Data, &info); err != nil {
		t.Fatal(err)
	}
	// Endpoints: decide, lease (gateways' sub-grants, leased mode), the
	// reservations' (CONTRACT §10) and decide_all (several descriptors all
	// or nothing: the Envoy bridge's).
	want := map[string]string{"decide": "rl.v1.decide", "lease": "rl.v1.lease", "reserve": "rl.v1.reserve",
		"settle": "rl.v1.settle", "release": "rl.v1.release", "renew": "rl.v1.renew", "decide_all": "rl.v1.decide.all"}
	ok := info.Name == "limitmesh" && len(info.Endpoints) == len(want)
	for _, e := range info.Endpoints {
		ok = ok && want[e.Name] == e.Subject && e.QueueGroup == "limitmesh"
	}
	if !ok {
		t.Fatalf("service info: %+v", info)
	}
}
