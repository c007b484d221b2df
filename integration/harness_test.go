// Package integration holds limitmesh's end-to-end tests: real embedded
// nats-servers with JetStream, real nodes, requests over NATS. Every wait
// is a bounded poll on observable state; nothing sleeps for a fixed time.
package integration

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/jstest"
	"github.com/limitmesh/limitmesh/mesh"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nats.go/micro"
)

// The bounds of these tests. They are generous on purpose: the machine is
// a shared, noisy 2-core VM where several test binaries may run at once,
// and a bound only matters when something is wrong (a poll ends as soon
// as its condition holds).
const (
	// testTimeout bounds one request, one JetStream call, or a node's
	// start or stop.
	testTimeout = 20 * time.Second
	// waitTimeout bounds a poll for observable state (waitFor): a policy
	// applied, a meta leader elected, a partition moved.
	waitTimeout = 60 * time.Second
	// faultTimeout bounds the recovery from an injected fault (a raft
	// election after a server died or was cut off, a lease expiring, a
	// process restarted) until decisions flow again.
	faultTimeout = 2 * time.Minute
)

// server starts an embedded server with a random client port and its data
// in dir (a t.TempDir() unless a restart test reuses one).
func server(t testing.TB, dir string) *mesh.Embedded {
	t.Helper()
	e, err := mesh.StartEmbedded(mesh.EmbeddedConfig{Listen: "127.0.0.1:-1", DataDir: dir})
	if err != nil {
		t.Fatalf("StartEmbedded: %v", err)
	}
	t.Cleanup(e.Shutdown)
	return e
}

// connect opens a TCP connection to e, closed at cleanup.
func connect(t testing.TB, e *mesh.Embedded) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(e.ClientURL())
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// testNode is a started node with its own connection.
type testNode struct {
	node *mesh.Node
	id   string // its NodeID
	nc   *nats.Conn
	http *httptest.Server
}

// nodeSeq numbers the nodes startNode names.
var nodeSeq atomic.Int64

// startNode runs the `limitmesh serve` sequence: connect, NewNode, Start,
// serve HTTPHandler; Stop at cleanup.
func startNode(t testing.TB, e *mesh.Embedded, cfg mesh.NodeConfig) *testNode {
	t.Helper()
	return runNode(t, connect(t, e), cfg)
}

// runNode runs the `limitmesh serve` sequence on nc: NewNode, Start,
// serve HTTPHandler; Stop at cleanup. A node without a NodeID is named
// "node<N>", N unique in the process.
func runNode(t testing.TB, nc *nats.Conn, cfg mesh.NodeConfig) *testNode {
	t.Helper()
	if cfg.NodeID == "" {
		cfg.NodeID = "node" + strconv.FormatInt(nodeSeq.Add(1), 10)
	}
	n, err := mesh.NewNode(nc, cfg)
	if err != nil {
		t.Fatalf("NewNode: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	if err := n.Start(ctx); err != nil {
		t.Fatalf("Start: %v", err)
	}
	hs := httptest.NewServer(n.HTTPHandler())
	tn := &testNode{node: n, id: cfg.NodeID, nc: nc, http: hs}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
		defer cancel()
		if err := n.Stop(ctx); err != nil {
			t.Errorf("Stop: %v", err)
		}
		hs.Close()
	})
	return tn
}

// partitionOf returns the partition of a limit key on a mesh of
// mesh.DefaultPartitions partitions, by the rule of docs/protocol.md:
// FNV-1a 32 of the key mod P.
func partitionOf(key string) int {
	h := fnv.New32a()
	h.Write([]byte(key))
	return int(h.Sum32() % mesh.DefaultPartitions)
}

// policyRevision returns the KV revision of the version of policy name
// in force on n, and false when n has no such policy.
func policyRevision(n *mesh.Node, name string) (uint64, bool) {
	if p := n.Policy(name); p != nil {
		return p.Revision, true
	}
	return 0, false
}

// putPolicy writes a policy with a plain put (as `nats kv put` does) and
// returns its revision.
func putPolicy(t testing.TB, nc *nats.Conn, bucket, name, doc string) uint64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	kv, err := js.KeyValue(ctx, bucket)
	if err != nil {
		t.Fatal(err)
	}
	// On a replicated bucket whose stream leader is still being elected a
	// put may get no response: retry those (bounded by ctx).
	for {
		rev, err := kv.Put(ctx, name, []byte(doc))
		if err == nil {
			return rev
		}
		if !errors.Is(err, jetstream.ErrNoStreamResponse) && !errors.Is(err, nats.ErrNoResponders) || ctx.Err() != nil {
			t.Fatalf("put policy %s: %v", name, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func deletePolicy(t testing.TB, nc *nats.Conn, bucket, name string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	js, _ := jetstream.New(nc)
	kv, err := js.KeyValue(ctx, bucket)
	if err != nil {
		t.Fatal(err)
	}
	if err := kv.Delete(ctx, name); err != nil {
		t.Fatal(err)
	}
}

// reply is a decoded decide reply (CONTRACT.md §2).
type reply struct {
	Allowed      bool    `json:"allowed"`
	Policy       string  `json:"policy"`
	Revision     uint64  `json:"revision"`
	Remaining    float64 `json:"remaining"`
	RetryAfterMs int64   `json:"retry_after_ms"`
	ResetAfterMs int64   `json:"reset_after_ms"`
	ShadowDenied bool    `json:"shadow_denied"`
	// Partition is the optional "partition" hint of a decision (the limit
	// key's partition, docs/protocol.md), -1 when the reply has none.
	Partition int `json:"partition"`

	// Set for error replies.
	Code  string `json:"-"`
	Error string `json:"error"`
	Msg   string `json:"message"`
}

// decide sends one raw request body and decodes the reply or micro error.
func decide(t testing.TB, nc *nats.Conn, subject string, body string) reply {
	t.Helper()
	m, err := nc.Request(subject, []byte(body), testTimeout)
	if err != nil {
		t.Fatalf("decide request: %v", err)
	}
	r, err := decodeReply(m)
	if err != nil {
		t.Fatalf("decide reply %q: %v", m.Data, err)
	}
	return r
}

// decodeReply decodes a decision or a micro error reply.
func decodeReply(m *nats.Msg) (reply, error) {
	r := reply{Partition: -1}
	if err := json.Unmarshal(m.Data, &r); err != nil {
		return reply{}, err
	}
	if m.Header != nil {
		r.Code = m.Header.Get(micro.ErrorCodeHeader)
	}
	return r, nil
}

// req builds a request body.
func req(desc map[string]string, extra string) string {
	b, _ := json.Marshal(map[string]any{"descriptor": desc})
	s := string(b)
	if extra != "" {
		s = strings.TrimSuffix(s, "}") + "," + extra + "}"
	}
	return s
}

// waitFor polls cond every few ms until it holds; it fails the test if
// waitTimeout passes first.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	waitWithin(t, waitTimeout, what, cond)
}

// waitWithin is waitFor with the bound limit.
func waitWithin(t testing.TB, limit time.Duration, what string, cond func() bool) {
	t.Helper()
	jstest.Eventually(t, limit, what, cond)
}

// metric returns the text exposition lines of the node's /metrics that
// start with prefix.
func metric(t testing.TB, tn *testNode, prefix string) []string {
	t.Helper()
	resp, err := http.Get(tn.http.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var sb strings.Builder
	buf := make([]byte, 32<<10)
	for {
		n, err := resp.Body.Read(buf)
		sb.Write(buf[:n])
		if err != nil {
			break
		}
	}
	var out []string
	for _, l := range strings.Split(sb.String(), "\n") {
		if strings.HasPrefix(l, prefix) {
			out = append(out, l)
		}
	}
	return out
}

func metricValue(t testing.TB, tn *testNode, series string) float64 {
	t.Helper()
	for _, l := range metric(t, tn, series) {
		if rest, ok := strings.CutPrefix(l, series+" "); ok {
			var v float64
			fmt.Sscan(rest, &v)
			return v
		}
	}
	return 0
}

// waitMetric waits until the node's series reaches want and fails if it
// is then above it.
func waitMetric(t testing.TB, tn *testNode, series string, want float64) {
	t.Helper()
	var v float64
	waitFor(t, fmt.Sprintf("%s at %v", series, want), func() bool {
		v = metricValue(t, tn, series)
		return v >= want
	})
	if v != want {
		t.Fatalf("%s = %v, want %v", series, v, want)
	}
}

const acmePolicy = `{"match": {"tenant": "acme", "operation": "search"},
 "key": ["tenant", "operation", "plan"],
 "limits": [{"name": "rate", "algorithm": "token_bucket", "rate": "10/s", "burst": 40}],
 "description": "Acme search contract"}`

var acmeDesc = map[string]string{"tenant": "acme", "operation": "search", "plan": "v7"}

// waitApplied waits until every one of nodes has policy name in force at
// revision rev or later. A request through a connection proves nothing
// about a particular node (the queue group may hand it to any node), and a
// node that has not applied a new policy yet answers its descriptors as
// unmatched (allowed), so multi-node tests wait on each node itself.
func waitApplied(t testing.TB, name string, rev uint64, nodes ...*testNode) {
	t.Helper()
	for i, n := range nodes {
		waitFor(t, fmt.Sprintf("node %d applies %s@%d", i, name, rev), func() bool {
			got, ok := policyRevision(n.node, name)
			return ok && got >= rev
		})
	}
}

// burstReplies sends n requests for desc at once (released together),
// request i on conns[i%len(conns)], and returns the replies in order. A
// request that gets no reply at all fails the test (after the burst: the
// goroutines never call t.Fatal themselves).
func burstReplies(t testing.TB, conns []*nats.Conn, desc map[string]string, n int) []reply {
	t.Helper()
	replies := make([]reply, n)
	errs := make([]error, n)
	body := []byte(req(desc, ""))
	var start, wg sync.WaitGroup
	start.Add(1)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			start.Wait()
			m, err := conns[i%len(conns)].Request("rl.v1.decide", body, testTimeout)
			if err != nil {
				errs[i] = err
				return
			}
			replies[i], errs[i] = decodeReply(m)
		}()
	}
	start.Done()
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("burst request %d: %v", i, err)
		}
	}
	return replies
}

// burstDecisions sends n requests for desc at once (released together),
// request i on conns[i%len(conns)], each with a request_id of its own, and
// sends a request again with the same id (bounded by waitTimeout) while it
// gets a 503 or no reply. It returns the decisions in order and the number
// of 503s and unanswered attempts. A request_id makes a retry spend at most
// once (CONTRACT.md §2), so the decisions account for every unit exactly:
// a burst of n over a limit of c units admits exactly min(n, c), however
// many attempts failed on a loaded machine.
func burstDecisions(t testing.TB, conns []*nats.Conn, desc map[string]string, n int) (replies []reply, failed int) {
	t.Helper()
	replies = make([]reply, n)
	errs := make([]error, n)
	fails := make([]int, n)
	run := fmt.Sprintf("%x", time.Now().UnixNano())
	var start, wg sync.WaitGroup
	start.Add(1)
	for i := range n {
		wg.Add(1)
		body := []byte(req(desc, fmt.Sprintf(`"request_id":"burst-%s-%d"`, run, i)))
		go func() {
			defer wg.Done()
			start.Wait()
			begin := time.Now()
			for {
				m, err := conns[i%len(conns)].Request("rl.v1.decide", body, testTimeout)
				if err == nil {
					replies[i], errs[i] = decodeReply(m)
					if errs[i] != nil || replies[i].Code != "503" {
						return
					}
				} else if !errors.Is(err, nats.ErrTimeout) && !errors.Is(err, nats.ErrNoResponders) {
					errs[i] = err
					return
				}
				fails[i]++
				if time.Since(begin) > waitTimeout {
					errs[i] = fmt.Errorf("no decision after %d attempts in %s (last: %+v, %v)", fails[i], waitTimeout, replies[i], err)
					return
				}
				time.Sleep(20 * time.Millisecond)
			}
		}()
	}
	start.Done()
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("burst request %d: %v", i, err)
		}
		if replies[i].Code != "" {
			t.Fatalf("burst request %d: error reply %+v", i, replies[i])
		}
		failed += fails[i]
	}
	return replies, failed
}

// admittedOf counts the admissions among decisions.
func admittedOf(replies []reply) int {
	n := 0
	for _, r := range replies {
		if r.Allowed {
			n++
		}
	}
	return n
}

// requireOwner fails unless the reply r names partition p (its
// "partition" hint) and the shards bucket names node owner for p: a test
// that kills the owner of a key's partition checks with it that it kills
// the right node.
func requireOwner(t testing.TB, r reply, p int, owner *testNode) {
	t.Helper()
	if r.Partition != p {
		t.Fatalf("reply %+v names partition %d, want %d", r, r.Partition, p)
	}
	if e := readShard(t, owner.nc, p); e.Node != owner.id {
		t.Fatalf("partition %d's entry names %q, not %s", p, e.Node, owner.id)
	}
}

// startOwnNode starts a node on nc and leaves stopping it to the test (for
// tests that stop, restart or kill it themselves).
func startOwnNode(t testing.TB, nc *nats.Conn) *mesh.Node {
	t.Helper()
	n, err := mesh.NewNode(nc, mesh.NodeConfig{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	if err := n.Start(ctx); err != nil {
		t.Fatal(err)
	}
	return n
}
