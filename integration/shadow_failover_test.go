package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"reflect"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/usagetest"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/limitmesh/limitmesh/mesh"
	"github.com/limitmesh/limitmesh/policies"
	"github.com/limitmesh/limitmesh/shadow"
	"github.com/limitmesh/limitmesh/usage"
)

// failoverCandidates are the candidates of the cluster failover test.
var failoverCandidates = map[string]string{
	"per-user": `{"match": {"user": "*"}, "key": ["tenant", "user"],
		"limits": [{"algorithm": "sliding_window", "limit": 5, "window": "1s"}], "shadow": true}`,
	"per-tenant": `{"match": {"tenant": "*"}, "key": ["tenant"],
		"limits": [{"algorithm": "token_bucket", "rate": "20/s", "burst": 30}], "shadow": true}`,
}

// clusterEvaluator is one node's shadow evaluator in the failover test.
type clusterEvaluator struct {
	server *mesh.Embedded
	nc     *nats.Conn
	reg    *prometheus.Registry
	stop   context.CancelFunc
	done   chan error
}

// leads reports whether the evaluator runs the evaluation now.
func (c *clusterEvaluator) leads() bool {
	mfs, _ := c.reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() == "limitmesh_shadow_leader" {
			return mf.GetMetric()[0].GetGauge().GetValue() == 1
		}
	}
	return false
}

// retryJS runs op until it succeeds, while the cluster elects leaders.
func retryJS(t *testing.T, what string, op func(ctx context.Context) error) {
	t.Helper()
	var last error
	waitWithin(t, 60*time.Second, what, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		last = op(ctx)
		return last == nil
	})
	if last != nil {
		t.Fatalf("%s: %v", what, last)
	}
}

// publishRecords publishes recs in batches of 40 through js (retrying a
// batch with the same Nats-Msg-Id until it is acknowledged, so the stream
// stores it once) and returns them in stream order.
func publishRecords(t *testing.T, js jetstream.JetStream, recs []usage.Record) []usage.Record {
	t.Helper()
	for i := 0; i < len(recs); i += 40 {
		batch := recs[i:min(i+40, len(recs))]
		m := nats.NewMsg(usage.Subject("rl", ""))
		m.Data = usagetest.AppendBatch(nil, &usage.Batch{Node: "n1", Policy: "", Records: batch})
		m.Header.Set(jetstream.MsgIDHeader, batch[0].ID)
		retryJS(t, "publish a usage batch", func(ctx context.Context) error {
			_, err := js.PublishMsg(ctx, m)
			return err
		})
	}
	return recs
}

// failoverTraffic returns n records over 5 tenants and 20 users, t_us
// 2 ms apart from start.
func failoverTraffic(start int64, n int, seed uint64) []usage.Record {
	rng := rand.New(rand.NewPCG(seed, 9))
	out := make([]usage.Record, n)
	for i := range out {
		d, _ := policies.NewDescriptor([]policies.Dim{
			{Name: "tenant", Value: fmt.Sprintf("t%d", rng.IntN(5))},
			{Name: "user", Value: fmt.Sprintf("u%d", rng.IntN(20))},
		})
		out[i] = usage.Record{ID: fmt.Sprintf("f%d.%d", seed, i), TimeUs: start + int64(i)*2000, Descriptor: d,
			Cost: 1_000_000, Allowed: rng.IntN(6) > 0}
	}
	return out
}

// TestShadowEvaluatorClusterFailover: three servers in a JetStream cluster
// (R3 buckets and stream), an evaluator on each; the active evaluator's
// server is shut down (and its process with it) while traffic goes on; one
// of the others takes over from the last checkpoint, and once the stream
// is consumed the summaries equal one uninterrupted evaluation of it.
func TestShadowEvaluatorClusterFailover(t *testing.T) {
	if testing.Short() {
		t.Skip("cluster test")
	}
	servers := embeddedCluster(t, 3)
	admin, err := nats.Connect(servers[0].ClientURL() + "," + servers[1].ClientURL() + "," + servers[2].ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(admin.Close)
	js, _ := jetstream.New(admin)
	var pkv jetstream.KeyValue
	retryJS(t, "R3 policy bucket", func(ctx context.Context) error {
		var err error
		pkv, err = js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "rl_policies", History: 16, Replicas: 3})
		return err
	})
	retryJS(t, "R3 usage stream", func(ctx context.Context) error {
		_, err := usage.EnsureStream(ctx, js, usage.StreamConfig{Replicas: 3})
		return err
	})
	var cands []*policies.Policy
	for name, doc := range failoverCandidates {
		var rev uint64
		retryJS(t, "put "+name, func(ctx context.Context) error {
			var err error
			rev, err = pkv.Put(ctx, name, []byte(doc))
			return err
		})
		p, err := policies.Parse(name, []byte(doc))
		if err != nil {
			t.Fatal(err)
		}
		p.Revision = rev
		cands = append(cands, p)
	}

	evs := make([]*clusterEvaluator, 3)
	for i, s := range servers {
		nc, err := nats.Connect(s.ClientURL(), nats.MaxReconnects(-1))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		ejs, _ := jetstream.New(nc)
		reg := prometheus.NewRegistry()
		ev, err := shadow.NewEvaluator(ejs, shadow.Config{NodeID: fmt.Sprintf("n%d", i), Replicas: 3, Registerer: reg,
			Lease: time.Second, FlushInterval: 100 * time.Millisecond, CheckpointInterval: 200 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		ce := &clusterEvaluator{server: s, nc: nc, reg: reg, stop: cancel, done: make(chan error, 1)}
		go func() { ce.done <- ev.Run(ctx) }()
		t.Cleanup(func() { cancel(); <-ce.done })
		evs[i] = ce
	}
	var active *clusterEvaluator
	waitWithin(t, 60*time.Second, "an active evaluator", func() bool {
		for _, ce := range evs {
			if ce.leads() {
				active = ce
				return true
			}
		}
		return false
	})

	start := time.Now().UnixMicro()
	stream := publishRecords(t, js, failoverTraffic(start, 2000, 1))
	var skv jetstream.KeyValue
	retryJS(t, "open rl_shadow", func(ctx context.Context) error {
		var err error
		skv, err = js.KeyValue(ctx, "rl_shadow")
		return err
	})
	waitWithin(t, 60*time.Second, "a checkpoint of some of the traffic", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		e, err := skv.Get(ctx, shadow.CheckpointKey)
		if err != nil {
			return false
		}
		var p struct{ Seq uint64 }
		json.Unmarshal(e.Value(), &p)
		return p.Seq > 0
	})

	// The active node dies with its server: its connection goes first, so
	// the evaluator can neither write a last checkpoint nor release its
	// lease (its Run is cancelled at cleanup, long after).
	done := make(chan []usage.Record)
	go func() { done <- publishRecords(t, js, failoverTraffic(start+4_000_000, 2000, 2)) }()
	active.nc.Close()
	active.server.Shutdown()
	stream = append(stream, <-done...)
	stream = append(stream, publishRecords(t, js, failoverTraffic(start+8_000_000, 1000, 3))...)

	r := shadow.NewReplay(shadow.Options{})
	r.SetCandidates(cands)
	for i := range stream {
		r.Apply(&stream[i])
	}
	want := map[string]shadow.Summary{}
	for _, s := range r.Summaries() {
		want[s.Policy] = s
	}
	var got map[string]shadow.Summary
	var lastErr error
	equal := func() bool {
		got, lastErr = map[string]shadow.Summary{}, nil
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		for name := range want {
			e, err := skv.Get(ctx, name)
			if err != nil {
				lastErr = fmt.Errorf("get %s: %w", name, err)
				return false
			}
			var s shadow.Summary
			if err := json.Unmarshal(e.Value(), &s); err != nil {
				lastErr = fmt.Errorf("summary %s: %w", name, err)
				return false
			}
			s.UpdatedUs = 0
			got[name] = s
		}
		return reflect.DeepEqual(got, want)
	}
	for deadline := time.Now().Add(90 * time.Second); !equal(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			// Say how they differ: fewer records evaluated is a lag or a
			// loss, more is a double count.
			for name, w := range want {
				t.Errorf("%s: got %+v\nwant %+v", name, got[name], w)
			}
			t.Fatalf("timed out waiting for the survivors' summaries to equal one uninterrupted evaluation (90s; last error %v; %d survivors lead)",
				lastErr, leadersBut(evs, active))
		}
	}
	if leaders := leadersBut(evs, active); leaders != 1 {
		t.Errorf("%d survivors lead, want 1", leaders)
	}
}

// leadersBut counts the evaluators other than skip that lead.
func leadersBut(evs []*clusterEvaluator, skip *clusterEvaluator) int {
	n := 0
	for _, ce := range evs {
		if ce != skip && ce.leads() {
			n++
		}
	}
	return n
}
