package integration

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/usagetest"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/limitmesh/limitmesh/mesh"
	"github.com/limitmesh/limitmesh/policies"
	"github.com/limitmesh/limitmesh/shadow"
	"github.com/limitmesh/limitmesh/usage"
)

// overheadCandidates are ten candidates on the traffic of
// BenchmarkShadowCandidatesOverhead: every algorithm, keys finer and
// coarser than the live policy's; each evaluates every record.
var overheadCandidates = []string{
	`{"match": {"tenant": "*"}, "key": ["tenant", "user"], "limits": [{"algorithm": "token_bucket", "rate": "5/s", "burst": 10}], "shadow": true}`,
	`{"match": {"tenant": "*"}, "key": ["tenant"], "limits": [{"algorithm": "gcra", "rate": "500/s", "burst": 100}], "shadow": true}`,
	`{"match": {"tenant": "*"}, "key": ["tenant", "user"], "limits": [{"algorithm": "fixed_window", "limit": 20, "window": "1s"}], "shadow": true}`,
	`{"match": {"tenant": "*"}, "key": ["tenant", "user"], "limits": [{"algorithm": "sliding_window", "limit": 10, "window": "1s"}], "shadow": true}`,
	`{"match": {"tenant": "*"}, "key": ["user"], "limits": [{"algorithm": "sliding_log", "limit": 5, "window": "1s"}], "shadow": true}`,
	`{"match": {"user": "*"}, "key": ["user"], "limits": [{"algorithm": "token_bucket", "rate": "2/s", "burst": 4}, {"name": "day", "algorithm": "fixed_window", "limit": 1000, "window": "24h"}], "shadow": true}`,
	`{"match": {}, "key": ["tenant"], "limits": [{"algorithm": "token_bucket", "rate": "1000/s", "burst": 2000}], "shadow": true}`,
	`{"match": {"tenant": "*", "user": "*"}, "key": ["tenant", "user"], "limits": [{"algorithm": "gcra", "rate": "50/s", "burst": 50}], "shadow": true}`,
	`{"match": {"tenant": "*"}, "key": ["tenant", "user"], "limits": [{"algorithm": "quota", "limit": 1000, "period": "day"}], "shadow": true}`,
	`{"match": {"tenant": "*"}, "key": ["tenant", "user"], "limits": [{"algorithm": "token_bucket", "rate": "1/s", "burst": 3}], "shadow": true}`,
}

// BenchmarkShadowCandidatesOverhead: one node (strict mode, 64 requests in
// flight over 4 connections, 50 tenants x 200 users) alternates slices
// without candidates and with the ten above, in the order ABBA ABBA ...
// (candidates put before a B slice and deleted before an A slice, each
// slice measured once the evaluator has taken the change in), so that the
// two sample the same drift of a shared machine. It reports the decisions
// per second of each and their ratio (ten / none), the CPU time of the
// process (node, embedded server and load) per decision of each and their
// ratio (none / ten: the throughput ratio to expect when the machine is
// saturated, less sensitive to what else runs on it), and the largest
// limitmesh_shadow_lag_seconds seen during the B slices. Run with
// -benchtime 1x; SHADOW_SLICE sets the slice length (default 2s), and
// SHADOW_ROUNDS the number of ABBA groups (default 4).
func BenchmarkShadowCandidatesOverhead(b *testing.B) {
	slice := envDuration("SHADOW_SLICE", 2*time.Second)
	rounds := int(envDuration("SHADOW_ROUNDS", 4))
	e := server(b, b.TempDir())
	tn := startNode(b, e, mesh.NodeConfig{})
	rev := putPolicy(b, tn.nc, "rl_policies", "live",
		`{"match": {"tenant": "*"}, "key": ["tenant", "user"], "limits": [{"algorithm": "token_bucket", "rate": "100/s", "burst": 50}]}`)
	waitApplied(b, "live", rev, tn)
	js, _ := jetstream.New(tn.nc)

	var done atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for c := range 4 {
		nc := connect(b, e)
		for w := range 16 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; ; i++ {
					select {
					case <-stop:
						return
					default:
					}
					k := (i*16+w)*4 + c
					body := fmt.Appendf(nil, `{"descriptor":{"tenant":"t%d","user":"u%d"}}`, k%50, (k/50)%200)
					m, err := nc.Request("rl.v1.decide", body, testTimeout)
					if err == nil && m.Header.Get("Nats-Service-Error-Code") == "" {
						done.Add(1)
					}
				}
			}()
		}
	}
	defer func() { close(stop); wg.Wait() }()

	toggle := func(on bool) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		kv, err := js.KeyValue(ctx, "rl_policies")
		if err != nil {
			b.Fatal(err)
		}
		for i, doc := range overheadCandidates {
			name := fmt.Sprintf("cand-%d", i)
			if on {
				_, err = kv.Put(ctx, name, []byte(doc))
			} else {
				err = kv.Delete(ctx, name)
			}
			if err != nil {
				b.Fatal(err)
			}
		}
		// Until the evaluator has taken the change in: every summary
		// written and evaluating (on), or every summary gone (off).
		waitWithin(b, time.Minute, "the evaluator to take the candidates in or out", func() bool {
			skv, err := js.KeyValue(ctx, shadow.Bucket("rl"))
			if err != nil {
				return false
			}
			for i := range overheadCandidates {
				e, err := skv.Get(ctx, fmt.Sprintf("cand-%d", i))
				if on && (err != nil || len(e.Value()) == 0) || !on && !errors.Is(err, jetstream.ErrKeyNotFound) {
					return false
				}
			}
			return true
		})
	}

	var none, ten, cpuNone, cpuTen []float64
	maxLag := 0.0
	measure := func(on bool) {
		toggle(on)
		time.Sleep(slice / 4) // settle
		n0, t0, c0 := done.Load(), time.Now(), processCPU()
		deadline := t0.Add(slice)
		for time.Now().Before(deadline) {
			time.Sleep(slice / 10)
			if on {
				maxLag = max(maxLag, metricValue(b, tn, "limitmesh_shadow_lag_seconds"))
			}
		}
		n := float64(done.Load() - n0)
		rate, cpu := n/time.Since(t0).Seconds(), (processCPU()-c0).Seconds()*1e6/n
		if on {
			ten, cpuTen = append(ten, rate), append(cpuTen, cpu)
		} else {
			none, cpuNone = append(none, rate), append(cpuNone, cpu)
		}
	}
	b.ResetTimer()
	for range b.N {
		for range rounds {
			for _, on := range []bool{false, true, true, false} {
				measure(on)
			}
		}
	}
	b.StopTimer()
	mean := func(v []float64) float64 {
		s := 0.0
		for _, x := range v {
			s += x
		}
		return s / float64(len(v))
	}
	ratios := make([]float64, 0, len(none))
	for i := range none {
		ratios = append(ratios, ten[i]/none[i])
	}
	slices.Sort(ratios)
	b.ReportMetric(mean(none), "none-decisions/s")
	b.ReportMetric(mean(ten), "ten-decisions/s")
	b.ReportMetric(mean(ten)/mean(none), "ratio")
	b.ReportMetric(ratios[len(ratios)/2], "median-pair-ratio")
	b.ReportMetric(maxLag, "max-lag-s")
	b.ReportMetric(mean(cpuNone), "none-cpu-µs/decision")
	b.ReportMetric(mean(cpuTen), "ten-cpu-µs/decision")
	b.ReportMetric(mean(cpuNone)/mean(cpuTen), "cpu-ratio")
	b.Logf("decisions/s none %.0f\n                ten  %.0f\ncpu µs/decision none %.1f\n                ten  %.1f", none, ten, cpuNone, cpuTen)
}

// processCPU is the CPU time (user and system) this process has used: the
// node, its embedded server and the load together.
func processCPU() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// envDuration reads a duration (or, for a plain number, that count) from
// the environment variable name, else def.
func envDuration(name string, def time.Duration) time.Duration {
	v, ok := os.LookupEnv(name)
	if !ok {
		return def
	}
	if d, err := time.ParseDuration(v); err == nil {
		return d
	}
	var n int64
	if _, err := fmt.Sscan(v, &n); err == nil {
		return time.Duration(n)
	}
	return def
}

// BenchmarkShadowEvaluatorVsDecide: how many times the node's strict
// decision rate the shadow evaluator can evaluate with ten candidates,
// both measured in one process, alternating, so that they see the same
// machine: a slice of decide load on a node (as in
// BenchmarkShadowCandidatesOverhead, without candidates), then an
// evaluator of an installation of its own (prefix ev<k>) catching up on
// SHADOW_RECORDS records (default 100,000, batches of 500, over the same
// 50 x 200 keys, published before) with the ten candidates, each record
// evaluated by all ten; SHADOW_ROUNDS times (default 4). It reports the
// decisions per second, the records evaluated per second and their ratio.
func BenchmarkShadowEvaluatorVsDecide(b *testing.B) {
	slice := envDuration("SHADOW_SLICE", 2*time.Second)
	rounds := int(envDuration("SHADOW_ROUNDS", 4))
	nrec := int(envDuration("SHADOW_RECORDS", 100_000))
	e := server(b, b.TempDir())
	tn := startNode(b, e, mesh.NodeConfig{})
	rev := putPolicy(b, tn.nc, "rl_policies", "live",
		`{"match": {"tenant": "*"}, "key": ["tenant", "user"], "limits": [{"algorithm": "token_bucket", "rate": "100/s", "burst": 50}]}`)
	waitApplied(b, "live", rev, tn)
	js, _ := jetstream.New(tn.nc)

	var done atomic.Int64
	var loadOn atomic.Bool
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for c := range 4 {
		nc := connect(b, e)
		for w := range 16 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; ; i++ {
					select {
					case <-stop:
						return
					default:
					}
					if !loadOn.Load() {
						time.Sleep(5 * time.Millisecond)
						continue
					}
					k := (i*16+w)*4 + c
					body := fmt.Appendf(nil, `{"descriptor":{"tenant":"t%d","user":"u%d"}}`, k%50, (k/50)%200)
					m, err := nc.Request("rl.v1.decide", body, testTimeout)
					if err == nil && m.Header.Get("Nats-Service-Error-Code") == "" {
						done.Add(1)
					}
				}
			}()
		}
	}
	defer func() { close(stop); wg.Wait() }()

	// The records of the catch-up: t_us 100 µs apart, live results as
	// the node would give them (all admitted).
	start := time.Now().Add(-time.Hour).UnixMicro()
	recs := make([]usage.Record, nrec)
	for i := range recs {
		d, _ := policies.NewDescriptor([]policies.Dim{{Name: "tenant", Value: fmt.Sprintf("t%d", i%50)}, {Name: "user", Value: fmt.Sprintf("u%d", (i/50)%200)}})
		recs[i] = usage.Record{ID: fmt.Sprintf("b.%d", i), TimeUs: start + int64(i)*100, Descriptor: d, Cost: 1_000_000,
			Allowed: true, Key: "p.live.x", Revision: 1}
	}
	catchUp := func(k int) float64 {
		prefix := fmt.Sprintf("ev%d", k)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		if _, err := usage.EnsureStream(ctx, js, usage.StreamConfig{Prefix: prefix}); err != nil {
			b.Fatal(err)
		}
		kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: prefix + "_policies", History: 16})
		if err != nil {
			b.Fatal(err)
		}
		for i, doc := range overheadCandidates {
			if _, err := kv.Put(ctx, fmt.Sprintf("cand-%d", i), []byte(doc)); err != nil {
				b.Fatal(err)
			}
		}
		for i := 0; i < len(recs); i += 500 {
			body := usagetest.AppendBatch(nil, &usage.Batch{Node: "n1", Policy: "live", Records: recs[i:min(i+500, len(recs))]})
			if _, err := js.Publish(ctx, usage.Subject(prefix, "live"), body); err != nil {
				b.Fatal(err)
			}
		}
		ev, err := shadow.NewEvaluator(js, shadow.Config{Prefix: prefix, NodeID: "bench", FlushInterval: 100 * time.Millisecond})
		if err != nil {
			b.Fatal(err)
		}
		ectx, stopEv := context.WithCancel(ctx)
		evDone := make(chan error, 1)
		began := time.Now()
		go func() { evDone <- ev.Run(ectx) }()
		want := uint64(len(recs) * len(overheadCandidates))
		waitWithin(b, 5*time.Minute, "the evaluator to catch up", func() bool {
			skv, err := js.KeyValue(ctx, shadow.Bucket(prefix))
			if err != nil {
				return false
			}
			var n uint64
			for i := range overheadCandidates {
				e, err := skv.Get(ctx, fmt.Sprintf("cand-%d", i))
				if err != nil {
					return false
				}
				var s shadow.Summary
				if json.Unmarshal(e.Value(), &s) == nil {
					n += s.Evaluated
				}
			}
			return n == want
		})
		rate := float64(len(recs)) / time.Since(began).Seconds()
		stopEv()
		<-evDone
		return rate
	}

	// Warm-up: the node's first decisions of each key create its state.
	loadOn.Store(true)
	time.Sleep(2 * slice)
	var decideRates, evalRates []float64
	b.ResetTimer()
	for k := range rounds * b.N {
		loadOn.Store(true)
		time.Sleep(slice / 4)
		n0, t0 := done.Load(), time.Now()
		time.Sleep(slice)
		decideRates = append(decideRates, float64(done.Load()-n0)/time.Since(t0).Seconds())
		loadOn.Store(false)
		evalRates = append(evalRates, catchUp(k))
	}
	b.StopTimer()
	ratios := make([]float64, len(evalRates))
	for i := range ratios {
		ratios[i] = evalRates[i] / decideRates[i]
	}
	slices.Sort(ratios)
	b.ReportMetric(ratios[len(ratios)/2], "median-ratio")
	b.ReportMetric(ratios[0], "min-ratio")
	b.Logf("decisions/s %.0f\nrecords/s   %.0f", decideRates, evalRates)
}
