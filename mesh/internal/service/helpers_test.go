package service

import (
	"context"
	"encoding/json"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/jstest"
	"github.com/limitmesh/limitmesh/internal/storetest"
	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/keys"
	"github.com/limitmesh/limitmesh/mesh/internal/policyset"
	"github.com/limitmesh/limitmesh/mesh/internal/rt"
	"github.com/limitmesh/limitmesh/policies"
	"github.com/nats-io/nats.go/jetstream"
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

// memStore is storetest.Mem as a keys.Store: each operation answers on
// a goroutine of its own, as the JetStream store does.
type memStore struct{ *storetest.Mem }

func (m memStore) GetAsync(key string, _ time.Duration, done func([]byte, uint64, error)) {
	go func() { done(m.Get(context.Background(), key)) }()
}

func (m memStore) UpdateAsync(key string, val []byte, _ []keyrec.Usage, rev uint64, _ time.Duration, done func(uint64, error)) {
	go func() { done(m.Update(context.Background(), key, val, rev)) }()
}

// offline is a decide service without NATS: the handler, the key table and
// the owner cores are the real ones, on store.
type offline struct {
	*Service
	set *policyset.Set
	reg *prometheus.Registry
}

func offlineService(t testing.TB, store keys.Store, timeout time.Duration, ps ...*policies.Policy) *offline {
	t.Helper()
	return offlineServiceOn(t, rt.Real, store, timeout, ps...)
}

// frozen is the real runtime with a clock that stands still at at.
type frozen struct {
	rt.Runtime
	at time.Time
}

func (f frozen) Now() time.Time { return f.at }

// offlineServiceOn is offlineService on runtime r.
func offlineServiceOn(t testing.TB, r rt.Runtime, store keys.Store, timeout time.Duration, ps ...*policies.Policy) *offline {
	t.Helper()
	reg := prometheus.NewRegistry()
	set := policyset.New()
	for _, p := range ps {
		set.Put(p, 0)
	}
	km, err := keys.NewMetrics(reg, func() float64 { return 0 })
	if err != nil {
		t.Fatal(err)
	}
	sm, err := NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	kt := keys.New(keys.Config{Env: set, Store: store, Runtime: r, DecisionTimeout: timeout,
		MaxConflicts: 8, TTL: time.Hour, Metrics: km})
	s := New(Config{Policies: set, Keys: kt, Runtime: r, DecisionTimeout: timeout, Metrics: sm})
	return &offline{Service: s, set: set, reg: reg}
}

func (n *offline) decideOffline(t *testing.T, body string) fakeReply {
	t.Helper()
	r := &fakeRequest{data: []byte(body), out: make(chan fakeReply, 1)}
	n.Handle(r)
	select {
	case rep := <-r.out:
		// The count drops right after the reply is handed over (so that
		// Stop never drains before the reply is out): wait for it, bounded.
		deadline := time.Now().Add(5 * time.Second)
		for n.Inflight() != 0 {
			if time.Now().After(deadline) {
				t.Errorf("in-flight count %d after the reply", n.Inflight())
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

// counterValue returns the value of the counter name (without labels).
func (n *offline) counterValue(t *testing.T, name string) float64 {
	t.Helper()
	mfs, err := n.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			var v float64
			for _, m := range mf.GetMetric() {
				v += m.GetCounter().GetValue()
			}
			return v
		}
	}
	return 0
}

func tbPolicy(t testing.TB, name string, rev uint64, rate string, burst int, extra string) *policies.Policy {
	t.Helper()
	doc := fmt.Sprintf(`{"match":{"tenant":"*"},"limits":[{"name":"rate","algorithm":"token_bucket","rate":%q,"burst":%d}]%s}`, rate, burst, extra)
	p, err := policies.Parse(name, []byte(doc))
	if err != nil {
		t.Fatalf("Parse: %v", err)
	}
	p.Revision = rev
	return p
}

// jsStateStore starts an embedded server (stopped at cleanup) with a
// "rl_state" bucket and returns it with the JetStream store on it.
func jsStateStore(t *testing.T) (jetstream.JetStream, jetstream.KeyValue, *kvstate.JetStreamStore) {
	t.Helper()
	js := jstest.StartJetStream(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "rl_state"})
	if err != nil {
		t.Fatal(err)
	}
	st, err := kvstate.NewJetStreamStore(ctx, js, "rl_state")
	if err != nil {
		t.Fatal(err)
	}
	return js, kv, st
}
