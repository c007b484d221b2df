package integration

import (
	"bytes"
	"context"
	binenc "encoding/binary"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/cli"
	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/policies"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/limitmesh/limitmesh/mesh"
)

// modePolicy is slowPolicy (1/h, burst 40) in the given mode.
func modePolicy(mode string) string {
	return strings.Replace(slowPolicy, `"key"`, `"mode": "`+mode+`", "key"`, 1)
}

// stateKV opens the node's state bucket.
func stateKV(t *testing.T, nc *nats.Conn) jetstream.KeyValue {
	t.Helper()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	kv, err := js.KeyValue(ctx, "rl_state")
	if err != nil {
		t.Fatal(err)
	}
	return kv
}

// limitKey is the state key of tenant under slowPolicy.
func limitKey(t *testing.T, tenant string) string {
	t.Helper()
	p, err := policies.Parse("slow", []byte(slowPolicy))
	if err != nil {
		t.Fatal(err)
	}
	d, err := policies.NewDescriptor([]policies.Dim{{Name: "tenant", Value: tenant}})
	if err != nil {
		t.Fatal(err)
	}
	k, err := p.LimitKey(d)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// storedUnits reads the whole units of the first limit in key's latest
// durable record (journalled or in the state bucket: mesh.ReadStateRecord;
// docs/protocol.md: format, policy, revision, version, rest_at, states), or -1 when the
// key has none.
func storedUnits(t *testing.T, nc *nats.Conn, key string) int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	val, err := mesh.ReadStateRecord(ctx, js, "rl", key)
	if errors.Is(err, kvstate.ErrNotFound) {
		return -1
	} else if err != nil {
		t.Fatal(err)
	}
	r := bytes.NewReader(val)
	format, _ := r.ReadByte()
	if format < 1 || format > 3 {
		t.Fatalf("record format %d", format)
	}
	n, _ := binenc.ReadUvarint(r)
	r.Seek(int64(n), 1)
	binenc.ReadUvarint(r) // revision
	if format >= 2 {
		binenc.ReadUvarint(r) // the record's version
	}
	if format >= 3 {
		binenc.ReadVarint(r) // the instant it comes to rest
	}
	n, _ = binenc.ReadUvarint(r)
	st := make([]byte, n)
	r.Read(st)
	states, err := kvstate.DecodeStates(st, nil)
	if err != nil || len(states) != 1 {
		t.Fatalf("stored states %v %v", states, err)
	}
	return states[0].Tokens / kvstate.Unit
}

// burstAt sends n decisions for tenant at once over conns and returns how
// many were admitted (any error reply fails the test).
func burstAt(t *testing.T, conns []*nats.Conn, tenant string, n int) int {
	t.Helper()
	replies := burstReplies(t, conns, map[string]string{"tenant": tenant}, n)
	admitted := 0
	for _, r := range replies {
		if r.Code != "" {
			t.Fatalf("error reply: %+v", r)
		}
		if r.Allowed {
			admitted++
		}
	}
	return admitted
}

// TestAsyncMode: an async policy admits within its bound (here exactly its
// burst: one node, no failure) and its state reaches KV within the
// write-behind interval.
func TestAsyncMode(t *testing.T) {
	e := server(t, t.TempDir())
	tn := startNode(t, e, mesh.NodeConfig{AsyncInterval: 30 * time.Millisecond})
	rev := putPolicy(t, tn.nc, "rl_policies", "slow", modePolicy("async"))
	waitRevision(t, tn.nc, map[string]string{"tenant": "probe"}, rev)
	p, _ := mesh.ParsePolicy("slow", []byte(modePolicy("async")))
	bound, err := mesh.OvershootBound(p, mesh.BoundParams{Nodes: 1, AsyncInterval: 30 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	conns := []*nats.Conn{tn.nc, connect(t, e), connect(t, e)}
	admitted := burstAt(t, conns, "a", 80)
	if int64(admitted) > 40+bound.Limits[0].Units/kvstate.Unit || admitted != 40 {
		t.Fatalf("async admitted %d of 80, want 40 (bound 40 + %s)", admitted, bound.Limits[0].Arithmetic)
	}
	key := limitKey(t, "a")
	waitFor(t, "async state written behind", func() bool { return storedUnits(t, tn.nc, key) == 0 })
	// A retry with a request_id reaching the same owner is deduped.
	first := decide(t, tn.nc, "rl.v1.decide", req(map[string]string{"tenant": "b"}, `"request_id":"r-1"`))
	again := decide(t, tn.nc, "rl.v1.decide", req(map[string]string{"tenant": "b"}, `"request_id":"r-1"`))
	if !first.Allowed || again != first || first.Remaining != 39 {
		t.Fatalf("dedupe in async mode: %+v then %+v", first, again)
	}
	waitFor(t, "deduped state written", func() bool { return storedUnits(t, tn.nc, limitKey(t, "b")) == 39 })
}

// TestAsyncGracefulStop: a graceful stop writes the async changes still
// waiting for their write-behind (here a whole hour away) before it hands
// the partitions over, so the next owner finds them in the state bucket.
func TestAsyncGracefulStop(t *testing.T) {
	e := server(t, t.TempDir())
	tn := startNode(t, e, mesh.NodeConfig{AsyncInterval: time.Hour, CheckpointInterval: time.Hour})
	rev := putPolicy(t, tn.nc, "rl_policies", "slow", modePolicy("async"))
	waitRevision(t, tn.nc, map[string]string{"tenant": "probe"}, rev)
	for i := range 12 {
		if r := decide(t, tn.nc, "rl.v1.decide", req(map[string]string{"tenant": "g"}, "")); !r.Allowed || int(r.Remaining) != 39-i {
			t.Fatalf("spend %d: %+v", i, r)
		}
	}
	key := limitKey(t, "g")
	if got := storedUnits(t, tn.nc, key); got != -1 {
		t.Fatalf("stored %d units before the stop: the test needs the write-behind still pending", got)
	}
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	if err := tn.node.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if got := storedUnits(t, tn.nc, key); got != 28 {
		t.Fatalf("stored %d units after a graceful stop, want 28", got)
	}
	if v := metricValue(t, tn, "limitmesh_async_lost_writes_total"); v != 0 {
		t.Fatalf("%v async writes lost", v)
	}
}

// TestLocalModeTwoNodes: a local policy is enforced by each node alone
// (two nodes admit up to 2 × burst in total) and writes nothing to the
// state bucket.
func TestLocalModeTwoNodes(t *testing.T) {
	e := server(t, t.TempDir())
	a := startNode(t, e, mesh.NodeConfig{})
	b := startNode(t, e, mesh.NodeConfig{})
	rev := putPolicy(t, a.nc, "rl_policies", "slow", modePolicy("local"))
	waitApplied(t, "slow", rev, a, b)
	conns := []*nats.Conn{a.nc, b.nc, connect(t, e), connect(t, e)}
	// The queue group spreads 240 requests over both nodes; each admits
	// its own 40 and no more.
	admitted := burstAt(t, conns, "l", 240)
	if admitted > 80 || admitted <= 40 {
		t.Fatalf("two local nodes admitted %d, want more than one burst and at most 2 × 40", admitted)
	}
	js, _ := jetstream.New(a.nc)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	st, err := js.Stream(ctx, "KV_rl_state")
	if err != nil {
		t.Fatal(err)
	}
	// No limit key's record (keys "p.…"); a node's journal mark
	// ("_journal.<node>") may be there: every claim appends a tenure
	// marker to the claimer's journal.
	info, err := st.Info(ctx, jetstream.WithSubjectFilter("$KV.rl_state.p.>"))
	if err != nil {
		t.Fatal(err)
	}
	if len(info.State.Subjects) != 0 {
		t.Fatalf("local mode wrote to rl_state: %v", info.State.Subjects)
	}
	t.Logf("admitted %d of 240 on two nodes", admitted)
}

// TestModeSwitch: a policy switched strict → async → strict keeps one
// state: nothing spent is forgotten across the switches.
func TestModeSwitch(t *testing.T) {
	_, tn, _ := single(t)
	d := map[string]string{"tenant": "sw"}
	key := limitKey(t, "sw")
	spend := func(n int, want float64) {
		t.Helper()
		for i := range n {
			r := decide(t, tn.nc, "rl.v1.decide", req(d, ""))
			if !r.Allowed || (i == n-1 && int(r.Remaining) != int(want)) {
				t.Fatalf("spend %d: %+v, want %v left", i, r, want)
			}
		}
	}
	spend(10, 30)
	if got := storedUnits(t, tn.nc, key); got != 30 {
		t.Fatalf("strict: stored %d, want 30 at once", got)
	}
	rev := putPolicy(t, tn.nc, "rl_policies", "slow", modePolicy("async"))
	waitRevision(t, tn.nc, d, rev)
	spend(10, 20)
	waitFor(t, "async state written", func() bool { return storedUnits(t, tn.nc, key) == 20 })
	rev = putPolicy(t, tn.nc, "rl_policies", "slow", slowPolicy)
	waitRevision(t, tn.nc, d, rev)
	spend(5, 15)
	if got := storedUnits(t, tn.nc, key); got != 15 {
		t.Fatalf("strict again: stored %d, want 15 at once", got)
	}
}

// TestCorruptRecordConservative: a state value that cannot be decoded
// starts the key empty (denied until it refills), never with a fresh burst.
func TestCorruptRecordConservative(t *testing.T) {
	_, tn, _ := single(t)
	kv := stateKV(t, tn.nc)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	if _, err := kv.Put(ctx, limitKey(t, "bad"), []byte("\x07garbage")); err != nil {
		t.Fatal(err)
	}
	r := decide(t, tn.nc, "rl.v1.decide", req(map[string]string{"tenant": "bad"}, ""))
	// Less than a unit left (a fresh burst leaves 39): the key starts
	// empty when its record is loaded, and the policy's 1/h refills only
	// micro-units (about 3 in 10 ms) before the decision reads the clock.
	if r.Allowed || r.Remaining >= 1 || r.Code != "" {
		t.Fatalf("decision on a corrupt record: %+v, want denied with less than a unit left", r)
	}
	if got := metricValue(t, tn, "limitmesh_corrupt_records_total"); got != 1 {
		t.Fatalf("corrupt records counted %v, want 1", got)
	}
}

// TestPolicyExplainFromBucket: `limitmesh policy explain NAME --nodes N`
// reads the policy from the bucket and prints its bound as a number.
func TestPolicyExplainFromBucket(t *testing.T) {
	e := server(t, t.TempDir())
	tn := startNode(t, e, mesh.NodeConfig{})
	putPolicy(t, tn.nc, "rl_policies", "acme", `{"match":{"tenant":"acme"},"mode":"local","limits":[{"name":"rate","algorithm":"token_bucket","rate":"10/s","burst":40}]}`)
	var out, errOut bytes.Buffer
	code := cli.Main(context.Background(), []string{"policy", "explain", "acme", "--nodes", "3", "--nats-url", e.ClientURL()},
		nil, strings.NewReader(""), &out, &errOut)
	if code != 0 || !strings.Contains(out.String(), "local: rate: (3 − 1) × 40 = 80 units") || !strings.Contains(out.String(), "revision") {
		t.Fatalf("explain: exit %d\n%s%s", code, out.String(), errOut.String())
	}
	code = cli.Main(context.Background(), []string{"policy", "explain", "nope", "--nats-url", e.ClientURL()},
		nil, strings.NewReader(""), &out, &errOut)
	if code == 0 {
		t.Fatal("explain of a missing policy exited 0")
	}
}
