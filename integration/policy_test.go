package integration

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/mesh"
	"github.com/nats-io/nats.go/jetstream"
)

// TestLivePolicyUpdate: a changed policy applies without a restart, the
// decisions carry the new revision, and existing state follows §28 (a
// lowered burst clamps the tokens already stored).
func TestLivePolicyUpdate(t *testing.T) {
	_, tn, rev1 := single(t)
	d := map[string]string{"tenant": "live"}
	if r := decide(t, tn.nc, "rl.v1.decide", req(d, `"cost":10`)); !r.Allowed || r.Revision != rev1 {
		t.Fatalf("before update: %+v", r)
	}
	rev2 := putPolicy(t, tn.nc, "rl_policies", "slow", strings.Replace(slowPolicy, `"burst": 40`, `"burst": 5`, 1))
	waitRevision(t, tn.nc, d, rev2)
	r := decide(t, tn.nc, "rl.v1.decide", req(d, `"cost":1`))
	if !r.Allowed || r.Revision != rev2 || r.Remaining < 4 || r.Remaining >= 4.01 {
		t.Fatalf("after lowering burst to 5: %+v, want allowed at rev %d with 4 left", r, rev2)
	}
	// The node sets the gauge just after it puts the policy in force.
	waitFor(t, fmt.Sprintf("the policy revision gauge at %d", rev2), func() bool {
		return metricValue(t, tn, `limitmesh_policy_revision{policy="slow"}`) == float64(rev2)
	})
}

// TestInvalidPolicyRejected: an invalid value (and one the node's own
// rules refuse: a leased concurrency limit) is rejected and counted; the
// last valid version stays.
func TestInvalidPolicyRejected(t *testing.T) {
	_, tn, rev1 := single(t)
	d := map[string]string{"tenant": "inv"}
	putPolicy(t, tn.nc, "rl_policies", "slow", `{"match":{"tenant":"*"},"limits":[{"algorithm":"token_bucket","rate":"ten per second","burst":1}]}`)
	waitFor(t, "rejection counted", func() bool {
		return metricValue(t, tn, `limitmesh_policy_rejections_total{policy="slow"}`) == 1
	})
	putPolicy(t, tn.nc, "rl_policies", "slow", `{"match":{"tenant":"*"},"mode":"leased","limits":[{"algorithm":"concurrency","limit":3,"window":"1m"}]}`)
	waitFor(t, "leased concurrency rejected", func() bool {
		return metricValue(t, tn, `limitmesh_policy_rejections_total{policy="slow"}`) == 2
	})
	putPolicy(t, tn.nc, "rl_policies", "Bad.Name", slowPolicy)
	waitFor(t, "invalid name counted", func() bool {
		return metricValue(t, tn, `limitmesh_policy_rejections_total{policy="invalid_name"}`) == 1
	})
	r := decide(t, tn.nc, "rl.v1.decide", req(d, `"cost":40`))
	if !r.Allowed || r.Policy != "slow" || r.Revision != rev1 {
		t.Fatalf("after invalid updates: %+v, want the old version (rev %d) in force", r, rev1)
	}
}

func TestDeletePolicy(t *testing.T) {
	_, tn, _ := single(t)
	d := map[string]string{"tenant": "del"}
	if r := decide(t, tn.nc, "rl.v1.decide", req(d, `"cost":41`)); r.Allowed {
		t.Fatalf("before delete: %+v", r)
	}
	deletePolicy(t, tn.nc, "rl_policies", "slow")
	waitFor(t, "policy gone", func() bool {
		return decide(t, tn.nc, "rl.v1.decide", req(d, `"dry_run":true`)).Policy == ""
	})
	if r := decide(t, tn.nc, "rl.v1.decide", req(d, `"cost":41`)); !r.Allowed || r.Policy != "" || r.Revision != 0 {
		t.Fatalf("after delete: %+v", r)
	}
	if lines := metric(t, tn, `limitmesh_policy_revision{policy="slow"}`); len(lines) != 0 {
		t.Fatalf("revision gauge of a deleted policy: %v", lines)
	}
}

// TestShadowPolicy: a candidate ("shadow": true, CONTRACT v1.1 §7) never
// takes part in live decisions: descriptors it matches are decided by the
// live policies alone (here none: unlimited), replies carry no
// shadow_denied, and a live policy made a candidate stops applying.
func TestShadowPolicy(t *testing.T) {
	e := server(t, t.TempDir())
	tn := startNode(t, e, mesh.NodeConfig{})
	putPolicy(t, tn.nc, "rl_policies", "shadowed", `{"match":{"tenant":"*"},"shadow":true,"limits":[{"algorithm":"token_bucket","rate":"1/h","burst":2}]}`)
	// The watch applies entries in order: once this one is in force, the
	// candidate was seen.
	marker := putPolicy(t, tn.nc, "rl_policies", "marker", `{"match":{"app":"marker"},"limits":[{"algorithm":"token_bucket","rate":"1/h","burst":2}]}`)
	waitFor(t, "marker applied", func() bool { rev, ok := policyRevision(tn.node, "marker"); return ok && rev == marker })
	if _, ok := policyRevision(tn.node, "shadowed"); ok {
		t.Fatal("a candidate is in force")
	}
	d := map[string]string{"tenant": "s"}
	for i := range 4 {
		r := decide(t, tn.nc, "rl.v1.decide", req(d, ""))
		if !r.Allowed || r.Policy != "" || r.ShadowDenied {
			t.Fatalf("request %d: %+v, want allowed by no policy", i, r)
		}
	}
	if lines := metric(t, tn, `limitmesh_decisions_total{policy="shadowed"`); len(lines) != 0 {
		t.Fatalf("decisions counted for a candidate: %v", lines)
	}

	// A live policy that becomes a candidate stops applying.
	rev := putPolicy(t, tn.nc, "rl_policies", "slow", slowPolicy)
	waitRevision(t, tn.nc, d, rev)
	putPolicy(t, tn.nc, "rl_policies", "slow", strings.Replace(slowPolicy, "{", `{"shadow":true,`, 1))
	waitFor(t, "slow no longer live", func() bool {
		return decide(t, tn.nc, "rl.v1.decide", req(d, `"dry_run":true`)).Policy == ""
	})
}

// TestRestartKeepsState: state and policies survive a restart of the
// server and the node; no fresh burst after restarting.
func TestRestartKeepsState(t *testing.T) {
	dir := t.TempDir()
	e, err := mesh.StartEmbedded(mesh.EmbeddedConfig{Listen: "127.0.0.1:-1", DataDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	nc, err := e.Connect()
	if err != nil {
		t.Fatal(err)
	}
	n := startOwnNode(t, nc)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	rev := putPolicy(t, nc, "rl_policies", "slow", slowPolicy)
	d := map[string]string{"tenant": "restart"}
	waitRevision(t, nc, d, rev)
	if r := decide(t, nc, "rl.v1.decide", req(d, `"cost":40`)); !r.Allowed {
		t.Fatalf("first burst: %+v", r)
	}
	if err := n.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	nc.Close()
	e.Shutdown()

	e2 := server(t, dir)
	tn := startNode(t, e2, mesh.NodeConfig{})
	r := decide(t, tn.nc, "rl.v1.decide", req(d, ""))
	if r.Allowed || r.Policy != "slow" || r.Revision != rev {
		t.Fatalf("after restart: %+v, want a denial under slow@%d (no fresh burst)", r, rev)
	}
}

// TestBucketsNotNarrowed: existing buckets are used as they are, except
// that the state bucket is widened (never narrowed) to the retention
// horizon, for per-message TTLs (CONTRACT §3, state retention).
func TestBucketsNotNarrowed(t *testing.T) {
	e := server(t, t.TempDir())
	nc := connect(t, e)
	js, _ := jetstream.New(nc)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	if _, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "rl_policies", History: 40}); err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "rl_state", TTL: 3 * time.Hour, Storage: jetstream.MemoryStorage}); err != nil {
		t.Fatal(err)
	}
	startNode(t, e, mesh.NodeConfig{StateTTL: time.Minute})
	check := func(bucket string, history int64, ttl time.Duration) {
		kv, err := js.KeyValue(ctx, bucket)
		if err != nil {
			t.Fatal(err)
		}
		st, err := kv.Status(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if st.History() != history || st.TTL() != ttl {
			t.Errorf("%s: history %d ttl %v, want %d %v (unchanged)", bucket, st.History(), st.TTL(), history, ttl)
		}
	}
	check("rl_policies", 40, 0)
	check("rl_state", 1, mesh.RetentionHorizon)
}

// TestCreatedBuckets: a node creates the buckets with history >= 16 for
// policies and the retention horizon as the state bucket's age limit
// (records carry their own TTLs).
func TestCreatedBuckets(t *testing.T) {
	e := server(t, t.TempDir())
	tn := startNode(t, e, mesh.NodeConfig{Prefix: "px", StateTTL: 2 * time.Hour})
	js, _ := jetstream.New(tn.nc)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	pk, err := js.KeyValue(ctx, "px_policies")
	if err != nil {
		t.Fatal(err)
	}
	ps, _ := pk.Status(ctx)
	sk, err := js.KeyValue(ctx, "px_state")
	if err != nil {
		t.Fatal(err)
	}
	ss, _ := sk.Status(ctx)
	if ps.History() < 16 || ss.TTL() != mesh.RetentionHorizon {
		t.Fatalf("policies history %d, state ttl %v", ps.History(), ss.TTL())
	}
	if r := decide(t, tn.nc, "px.v1.decide", `{"descriptor":{"a":"b"}}`); !r.Allowed || r.Code != "" {
		t.Fatalf("decide on the prefixed subject: %+v", r)
	}
}

// TestHealthAndStop: /healthz, /readyz and /metrics; after Stop, /readyz
// is 503 and the service no longer answers.
func TestHealthAndStop(t *testing.T) {
	e := server(t, t.TempDir())
	nc := connect(t, e)
	n, err := mesh.NewNode(nc, mesh.NodeConfig{})
	if err != nil {
		t.Fatal(err)
	}
	h := n.HTTPHandler()
	get := func(path string) int {
		rec := &statusRecorder{header: http.Header{}}
		r, _ := http.NewRequest("GET", path, nil)
		h.ServeHTTP(rec, r)
		return rec.code
	}
	if c := get("/readyz"); c != 503 {
		t.Fatalf("readyz before start = %d", c)
	}
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	if err := n.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if get("/readyz") != 200 || get("/healthz") != 200 || get("/metrics") != 200 || !n.Ready() {
		t.Fatal("health endpoints after start")
	}
	if err := n.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if c := get("/readyz"); c != 503 || n.Ready() {
		t.Fatalf("readyz after stop = %d", c)
	}
	if _, err := nc.Request("rl.v1.decide", []byte(`{"descriptor":{"a":"b"}}`), 200*time.Millisecond); err == nil {
		t.Fatal("a stopped node still answers")
	}
	if err := n.Start(ctx); err == nil {
		t.Fatal("Start after Stop succeeded")
	}
}

type statusRecorder struct {
	header http.Header
	code   int
}

func (r *statusRecorder) Header() http.Header { return r.header }
func (r *statusRecorder) Write(b []byte) (int, error) {
	if r.code == 0 {
		r.code = 200
	}
	return len(b), nil
}
func (r *statusRecorder) WriteHeader(c int) { r.code = c }
