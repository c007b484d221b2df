package shadow

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"os"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/limitmesh/limitmesh/internal/jstest"
	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/policies"
	"github.com/limitmesh/limitmesh/usage"
)

// The candidates of the evaluator tests: one on acme's searches (a live
// policy's descriptors), one on everything per user (mostly unmatched
// records), one on writes per tenant with two limits.
var testCandidates = map[string]string{
	"acme-search-v2": `{"match": {"tenant": "acme", "operation": "search"}, "key": ["tenant", "plan"],
		"limits": [{"algorithm": "token_bucket", "rate": "20/s", "burst": 10}], "shadow": true}`,
	"per-user": `{"match": {"user": "*"}, "key": ["tenant", "user"],
		"limits": [{"algorithm": "sliding_window", "limit": 4, "window": "1s"}], "shadow": true}`,
	"writes": `{"match": {"operation": "write"}, "key": ["tenant"],
		"limits": [{"name": "rate", "algorithm": "gcra", "rate": "50/s", "burst": 10},
		           {"name": "window", "algorithm": "fixed_window", "limit": 150, "window": "2s"}], "shadow": true}`,
}

// liveDoc is a live (not shadow) policy: never a candidate.
const liveDoc = `{"match": {"tenant": "acme", "operation": "search"}, "limits": [{"algorithm": "token_bucket", "rate": "10/s", "burst": 40}]}`

// putCandidates puts the test candidates and the live policy and returns
// the candidates as parsed, with their revisions.
func putCandidates(t testing.TB, kv jetstream.KeyValue) []*policies.Policy {
	t.Helper()
	putDoc(t, kv, "acme-search", liveDoc)
	var out []*policies.Policy
	for _, name := range []string{"acme-search-v2", "per-user", "writes"} {
		rev := putDoc(t, kv, name, testCandidates[name])
		out = append(out, mustPolicy(t, name, rev, testCandidates[name]))
	}
	return out
}

// readSummaries reads the summaries of the bucket by name (without
// updated_us).
func readSummaries(t testing.TB, js jetstream.JetStream, prefix string) map[string]Summary {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	kv, err := js.KeyValue(ctx, Bucket(prefix))
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		return nil
	} else if err != nil {
		t.Fatal(err)
	}
	keys, err := kvstate.Keys(ctx, js, kv.Bucket(), "") // not kv.ListKeys, which can miss a key being rewritten
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]Summary{}
	for _, k := range keys {
		if !isSummaryKey(k) {
			continue
		}
		e, err := kv.Get(ctx, k)
		if err != nil {
			continue
		}
		var s Summary
		if err := json.Unmarshal(e.Value(), &s); err != nil {
			t.Fatalf("summary %s: %v (%s)", k, err, e.Value())
		}
		s.UpdatedUs = 0
		out[k] = s
	}
	return out
}

// expected is one uninterrupted evaluation of recs by cands.
func expected(cands []*policies.Policy, recs []usage.Record) map[string]Summary {
	r := NewReplay(Options{})
	r.SetCandidates(cands)
	for i := range recs {
		r.Apply(&recs[i])
	}
	out := map[string]Summary{}
	for _, s := range r.Summaries() {
		out[s.Policy] = s
	}
	return out
}

// waitSummaries waits until the bucket's summaries equal want.
func waitSummaries(t *testing.T, js jetstream.JetStream, prefix string, want map[string]Summary) {
	t.Helper()
	deadline := time.Now().Add(waitLimit)
	var got map[string]Summary
	for {
		got = readSummaries(t, js, prefix)
		if reflect.DeepEqual(got, want) {
			return
		}
		if time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	for name, w := range want {
		g := got[name]
		g.Series, w.Series = nil, nil
		t.Errorf("%s:\n got %+v\nwant %+v", name, g, w)
	}
	t.Fatalf("the summaries never matched (%d in the bucket, %d wanted)", len(got), len(want))
}

// runEvaluator runs an evaluator on js until cleanup (or stop).
func runEvaluator(t testing.TB, js jetstream.JetStream, cfg Config) (stop func()) {
	t.Helper()
	if cfg.Lease == 0 {
		cfg.Lease = 300 * time.Millisecond
	}
	if cfg.FlushInterval == 0 {
		cfg.FlushInterval = 50 * time.Millisecond
	}
	if cfg.CheckpointInterval == 0 {
		cfg.CheckpointInterval = 100 * time.Millisecond
	}
	if cfg.Logger == nil && os.Getenv("SHADOW_TEST_LOG") != "" {
		cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	e, err := NewEvaluator(js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("Run: %v", err)
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

// TestEvaluatorCountsStream: the evaluator's summaries equal a replay of
// the stream computed independently (the naive replay): live policy
// records and unmatched records alike; a live policy is no candidate; an
// invalid usage message is skipped and counted.
func TestEvaluatorCountsStream(t *testing.T) {
	s := startServer(t)
	nc, js := connectJS(t, s)
	kv := installation(t, js, "rl")
	cands := putCandidates(t, kv)
	recs := genStream(t, 3000, 1)

	reg := prometheus.NewRegistry()
	runEvaluator(t, js, Config{Prefix: "rl", NodeID: "n1", Registerer: reg})
	stream := publishBatches(t, js, "rl", "n1", recs[:1000], 100, livePolicyOf)
	if err := nc.Publish(usage.Subject("rl", "acme-search"), []byte(`{"node":"n1","policy":"acme-search","records":[{}]}`)); err != nil {
		t.Fatal(err)
	}
	stream = append(stream, publishBatches(t, js, "rl", "n2", recs[1000:], 100, livePolicyOf)...)

	want := naiveReplay(cands, stream)
	got := waitNaive(t, js, want)
	if got["acme-search-v2"].Skipped == 0 || got["acme-search-v2"].LiveDenied == 0 || got["per-user"].WouldDeny == 0 {
		t.Fatalf("the stream should have records without a user and live denials: %+v", got)
	}
	if v := metricValue(t, reg, "limitmesh_shadow_invalid_batches_total", nil); v != 1 {
		t.Errorf("invalid batches counted: %v, want 1", v)
	}
	var total float64
	for _, c := range cands {
		total += metricValue(t, reg, "limitmesh_shadow_decisions_total", map[string]string{"policy": c.Name, "result": "would_deny"})
	}
	if want := float64(want["acme-search-v2"].WouldDeny + want["per-user"].WouldDeny + want["writes"].WouldDeny); total != want {
		t.Errorf("limitmesh_shadow_decisions_total{result=would_deny} sums to %v, want %v", total, want)
	}
}

// waitNaive waits until the bucket's summaries agree with the naive
// replay's (the fields it computes) and returns them.
func waitNaive(t *testing.T, js jetstream.JetStream, want map[string]Summary) map[string]Summary {
	t.Helper()
	deadline := time.Now().Add(waitLimit)
	for {
		got := readSummaries(t, js, "rl")
		diff := ""
		for name, w := range want {
			g, ok := got[name]
			if !ok {
				diff = name + " missing"
				break
			}
			cmp := g
			cmp.Series, cmp.LastUs, cmp.UpdatedUs = nil, w.LastUs, 0
			cmp.Keys = w.Keys
			if !reflect.DeepEqual(cmp, w) {
				diff = name + ": got " + jsonString(g) + "\nwant " + jsonString(w)
				break
			}
		}
		if diff == "" && len(got) == len(want) {
			return got
		}
		if time.Now().After(deadline) {
			t.Fatalf("the summaries never agreed with the naive replay: %s", diff)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func jsonString(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

// metricValue sums the series of the metric name in reg whose labels
// include labels.
func metricValue(t testing.TB, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	v := 0.0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if want, ok := labels[lp.GetName()]; ok && want != lp.GetValue() {
					continue series
				}
			}
			v += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return v
}

// TestEvaluatorRevisionAndRemoval: a new revision of a candidate restarts
// its summary at 0 (then counts the records after it); a candidate made
// live (no "shadow") or deleted loses its summary.
func TestEvaluatorRevisionAndRemoval(t *testing.T) {
	s := startServer(t)
	_, js := connectJS(t, s)
	kv := installation(t, js, "rl")
	cands := putCandidates(t, kv)
	recs := genStream(t, 600, 2)
	runEvaluator(t, js, Config{Prefix: "rl", NodeID: "n1"})
	first := publishBatches(t, js, "rl", "n1", recs[:300], 50, livePolicyOf)
	waitSummaries(t, js, "rl", expected(cands, first))

	doc := strings.Replace(testCandidates["writes"], `"burst": 10`, `"burst": 5`, 1)
	rev := putDoc(t, kv, "writes", doc)
	waitFor(t, "the new revision's summary", func() bool {
		s, ok := readSummaries(t, js, "rl")["writes"]
		return ok && s.Revision == rev && s.Evaluated == 0
	})
	second := publishBatches(t, js, "rl", "n1", recs[300:], 50, livePolicyOf)
	want := expected(cands, append(first, second...))
	w2 := expected([]*policies.Policy{mustPolicy(t, "writes", rev, doc)}, second)
	want["writes"] = w2["writes"]
	waitSummaries(t, js, "rl", want)

	putDoc(t, kv, "per-user", strings.Replace(testCandidates["per-user"], `"shadow": true`, `"shadow": false`, 1))
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	if err := kv.Delete(ctx, "acme-search-v2"); err != nil {
		t.Fatal(err)
	}
	delete(want, "per-user")
	delete(want, "acme-search-v2")
	waitSummaries(t, js, "rl", want)
}

// TestEvaluatorFailover: two evaluators on two connections; the active
// one's connection is closed while the stream is being published; the
// other takes over from the last checkpoint, and the final summaries equal
// one uninterrupted evaluation. Then the survivor is stopped and started
// again (a graceful hand-over to itself): still equal, nothing counted
// twice.
func TestEvaluatorFailover(t *testing.T) {
	s := startServer(t)
	_, js := connectJS(t, s)
	kv := installation(t, js, "rl")
	cands := putCandidates(t, kv)
	recs := genStream(t, 4000, 3)

	ncA, jsA := connectJS(t, s)
	_, jsB := connectJS(t, s)
	regA, regB := prometheus.NewRegistry(), prometheus.NewRegistry()
	runEvaluator(t, jsA, Config{Prefix: "rl", NodeID: "a", Registerer: regA})
	waitFor(t, "a leads", func() bool { return metricValue(t, regA, "limitmesh_shadow_leader", nil) == 1 })
	stopB := runEvaluator(t, jsB, Config{Prefix: "rl", NodeID: "b", Registerer: regB})

	stream := publishBatches(t, js, "rl", "n1", recs[:1500], 50, livePolicyOf)
	waitFor(t, "a evaluates and checkpoints", func() bool {
		return readSummaries(t, js, "rl")["per-user"].Evaluated > 0 && checkpointSeq(t, js, "rl") > 0
	})
	done := make(chan []usage.Record)
	go func() { done <- publishBatches(t, js, "rl", "n1", recs[1500:3000], 25, livePolicyOf) }()
	ncA.Close() // mid-stream
	stream = append(stream, <-done...)
	stream = append(stream, publishBatches(t, js, "rl", "n2", recs[3000:], 50, livePolicyOf)...)
	waitFor(t, "b leads", func() bool { return metricValue(t, regB, "limitmesh_shadow_leader", nil) == 1 })
	want := expected(cands, stream)
	waitSummaries(t, js, "rl", want)
	var total, byB float64
	for _, c := range cands {
		total += float64(want[c.Name].Evaluated)
		byB += metricValue(t, regB, "limitmesh_shadow_decisions_total", map[string]string{"policy": c.Name})
	}
	if byB == 0 || byB >= total {
		t.Fatalf("b evaluated %v of %v records: it should have resumed from a's checkpoint", byB, total)
	}

	stopB()
	runEvaluator(t, jsB, Config{Prefix: "rl", NodeID: "b2"})
	more := genStream(t, 500, 4)
	for i := range more {
		more[i].TimeUs += recs[len(recs)-1].TimeUs - t0
		more[i].ID = "later." + more[i].ID
	}
	stream = append(stream, publishBatches(t, js, "rl", "n1", more, 50, livePolicyOf)...)
	waitSummaries(t, js, "rl", expected(cands, stream))
}

// checkpointSeq returns the sequence of the current checkpoint (0: none).
func checkpointSeq(t testing.TB, js jetstream.JetStream, prefix string) uint64 {
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	kv, err := js.KeyValue(ctx, Bucket(prefix))
	if err != nil {
		return 0
	}
	e, err := kv.Get(ctx, CheckpointKey)
	if err != nil {
		return 0
	}
	var p pointer
	json.Unmarshal(e.Value(), &p)
	return p.Seq
}

// waitFor polls cond until it holds or waitLimit passes.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	jstest.Eventually(t, waitLimit, what, cond)
}

// TestEvaluatorStartsAtPutTime: candidates with nothing to resume start at
// the first record stored after they were put, and an evaluator without
// candidates reads nothing of the stream. An evaluator started on a stream
// with history evaluates only what came after the candidates' put; once
// its candidates are gone it stops reading; candidates put again start at
// their new put time, not at the records published while it had none.
func TestEvaluatorStartsAtPutTime(t *testing.T) {
	s := startServer(t)
	_, js := connectJS(t, s)
	kv := installation(t, js, "rl")
	putDoc(t, kv, "acme-search", liveDoc)
	recs := genStream(t, 4000, 5)
	publishBatches(t, js, "rl", "n1", recs[:1000], 100, livePolicyOf) // before any candidate
	cands := putCandidates(t, kv)
	before := streamLast(t, js)
	mid := publishBatches(t, js, "rl", "n1", recs[1000:2000], 100, livePolicyOf)
	after := streamLast(t, js)

	runEvaluator(t, js, Config{Prefix: "rl", NodeID: "n1"})
	waitSummaries(t, js, "rl", expected(cands, mid))
	if d := consumerDelivered(t, js); d != after-before {
		t.Errorf("the consumer delivered %d messages, want the %d after the candidates' put", d, after-before)
	}

	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	for _, c := range cands {
		if err := kv.Delete(ctx, c.Name); err != nil {
			t.Fatal(err)
		}
	}
	waitSummaries(t, js, "rl", map[string]Summary{})
	publishBatches(t, js, "rl", "n1", recs[2000:3000], 100, livePolicyOf) // while it has none
	var again []*policies.Policy
	for _, c := range cands {
		rev := putDoc(t, kv, c.Name, testCandidates[c.Name])
		again = append(again, mustPolicy(t, c.Name, rev, testCandidates[c.Name]))
	}
	before = streamLast(t, js)
	post := publishBatches(t, js, "rl", "n1", recs[3000:], 100, livePolicyOf)
	after = streamLast(t, js)
	waitSummaries(t, js, "rl", expected(again, post))
	// A resume resets the consumer, so its count starts again there.
	if d := consumerDelivered(t, js); d != after-before {
		t.Errorf("the consumer delivered %d messages since the candidates came back, want %d: none published while there was none", d, after-before)
	}
}

// streamLast returns the usage stream's last sequence.
func streamLast(t *testing.T, js jetstream.JetStream) uint64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	st, err := js.Stream(ctx, usage.StreamName("rl"))
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return info.State.LastSeq
}

// consumerDelivered returns how many messages the evaluator's consumer
// has delivered.
func consumerDelivered(t *testing.T, js jetstream.JetStream) uint64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	c, err := js.Consumer(ctx, usage.StreamName("rl"), usage.ShadowConsumer)
	if err != nil {
		t.Fatal(err)
	}
	info, err := c.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return info.Delivered.Consumer
}

// TestEvaluatorWaitsForStream: an evaluator with candidates started before
// the usage stream exists waits for it, then evaluates what it receives.
func TestEvaluatorWaitsForStream(t *testing.T) {
	s := startServer(t)
	_, js := connectJS(t, s)
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "rl_policies", History: 16})
	if err != nil {
		t.Fatal(err)
	}
	cands := putCandidates(t, kv)
	reg := prometheus.NewRegistry()
	runEvaluator(t, js, Config{Prefix: "rl", NodeID: "n1", Registerer: reg})
	waitFor(t, "the evaluator leads", func() bool { return metricValue(t, reg, "limitmesh_shadow_leader", nil) == 1 })
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: usage.StreamName("rl"),
		Subjects: []string{usage.Subjects("rl")}, Storage: jetstream.FileStorage}); err != nil {
		t.Fatal(err)
	}
	stream := publishBatches(t, js, "rl", "n1", genStream(t, 600, 6), 100, livePolicyOf)
	waitSummaries(t, js, "rl", expected(cands, stream))
}
