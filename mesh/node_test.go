package mesh

import (
	"context"
	"encoding/json"
	"log/slog"
	"runtime"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/policies"
	"github.com/nats-io/nats.go/micro"
	"github.com/prometheus/client_golang/prometheus"
)

// fakeRequest is a micro.Request that records the reply on a channel.
type fakeRequest struct {
	data []byte
	out  chan fakeReply
}

type fakeReply struct {
	code string
	body []byte
}

func (r *fakeRequest) Respond(b []byte, _ ...micro.RespondOpt) error {
	r.out <- fakeReply{body: append([]byte(nil), b...)}
	return nil
}
func (r *fakeRequest) RespondJSON(v any, _ ...micro.RespondOpt) error {
	b, _ := json.Marshal(v)
	return r.Respond(b)
}
func (r *fakeRequest) Error(code, _ string, data []byte, _ ...micro.RespondOpt) error {
	r.out <- fakeReply{code: code, body: append([]byte(nil), data...)}
	return nil
}
func (r *fakeRequest) Data() []byte           { return r.data }
func (r *fakeRequest) Headers() micro.Headers { return nil }
func (r *fakeRequest) Subject() string        { return "rl.v1.decide" }
func (r *fakeRequest) Reply() string          { return "_INBOX.x" }

// offlineNode is a Node wired to a store without NATS: the handler, the
// key runners and the owner cores are the real ones.
func offlineNode(t testing.TB, store kvstate.Store, timeout time.Duration, ps ...*policies.Policy) *Node {
	t.Helper()
	n := &Node{
		cfg:   NodeConfig{Prefix: "rl", DecisionTimeout: timeout, MaxConflicts: DefaultMaxConflicts, StateTTL: time.Hour},
		log:   slog.New(slog.DiscardHandler),
		reg:   prometheus.NewRegistry(),
		clock: time.Now,
		store: store,
		keys:  newKeyTable(),
	}
	n.policies = newPolicySet()
	for _, p := range ps {
		n.policies.remember(policyVersion{p: p})
		n.policies.snap.Store(n.policies.snap.Load().With(p))
	}
	m, err := newMetrics(n.reg, func() float64 { return 0 })
	if err != nil {
		t.Fatal(err)
	}
	n.metrics = m
	n.watcher = &policyWatcher{set: n.policies, log: n.log, metrics: m}
	return n
}

func (n *Node) decideOffline(t *testing.T, body string) fakeReply {
	t.Helper()
	r := &fakeRequest{data: []byte(body), out: make(chan fakeReply, 1)}
	n.handleDecide(r)
	select {
	case rep := <-r.out:
		// The count drops right after the reply is handed over (so that
		// Stop never drains before the reply is out): wait for it, bounded.
		deadline := time.Now().Add(5 * time.Second)
		for n.inflight.Load() != 0 {
			if time.Now().After(deadline) {
				t.Errorf("in-flight count %d after the reply", n.inflight.Load())
				break
			}
			runtime.Gosched()
		}
		return rep
	case <-time.After(10 * time.Second):
		t.Fatal("no reply")
		return fakeReply{}
	}
}

func TestNodeOffline(t *testing.T) {
	p := tbPolicy(t, "p", 4, "1/h", 2, "")
	n := offlineNode(t, kvstate.NewMemStore(), time.Second, p)
	for i, want := range []string{
		`{"allowed":true,"policy":"p","revision":4,"remaining":1,`,
		`{"allowed":true,"policy":"p","revision":4,"remaining":0,`,
		`{"allowed":false,"policy":"p","revision":4,"remaining":0,`,
	} {
		rep := n.decideOffline(t, `{"descriptor":{"tenant":"a"}}`)
		if rep.code != "" || len(rep.body) < len(want) || string(rep.body[:len(want)]) != want {
			t.Fatalf("request %d: %s %s, want prefix %s", i, rep.code, rep.body, want)
		}
	}
	if rep := n.decideOffline(t, `{"descriptor":{"nope":"x"}}`); string(rep.body) != `{"allowed":true,"policy":"","revision":0,"remaining":0,"retry_after_ms":0,"reset_after_ms":0}` {
		t.Fatalf("unmatched: %s", rep.body)
	}
	if rep := n.decideOffline(t, `{"descriptor":`); rep.code != "400" || !json.Valid(rep.body) {
		t.Fatalf("malformed: %s %s", rep.code, rep.body)
	}
}

// panicStore panics on every call.
type panicStore struct{}

func (panicStore) Get(context.Context, string) ([]byte, uint64, error) { panic("store bug") }
func (panicStore) Update(context.Context, string, []byte, uint64) (uint64, error) {
	panic("store bug")
}

func TestNodePanicIs500(t *testing.T) {
	n := offlineNode(t, panicStore{}, time.Second, tbPolicy(t, "p", 1, "1/s", 2, ""))
	rep := n.decideOffline(t, `{"descriptor":{"tenant":"a"}}`)
	var body struct{ Error string }
	if rep.code != "500" || json.Unmarshal(rep.body, &body) != nil || body.Error != "internal" {
		t.Fatalf("panicking store: %s %s, want 500 internal", rep.code, rep.body)
	}
	// The key was reset: the node still answers.
	if rep := n.decideOffline(t, `{"descriptor":{"tenant":"a"}}`); rep.code != "500" {
		t.Fatalf("second request: %s %s", rep.code, rep.body)
	}
}

// hungStore blocks until the operation's context ends.
type hungStore struct{}

func (hungStore) Get(ctx context.Context, _ string) ([]byte, uint64, error) {
	<-ctx.Done()
	return nil, 0, ctx.Err()
}
func (hungStore) Update(ctx context.Context, _ string, _ []byte, _ uint64) (uint64, error) {
	<-ctx.Done()
	return 0, ctx.Err()
}

func TestNodeHungStoreIs503(t *testing.T) {
	n := offlineNode(t, hungStore{}, 20*time.Millisecond, tbPolicy(t, "p", 1, "1/s", 2, ""))
	rep := n.decideOffline(t, `{"descriptor":{"tenant":"a"}}`)
	var body struct{ Error string }
	if rep.code != "503" || json.Unmarshal(rep.body, &body) != nil || body.Error != "unavailable" {
		t.Fatalf("hung store: %s %s, want 503 unavailable", rep.code, rep.body)
	}
}
