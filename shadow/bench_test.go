package shadow

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/usagetest"
	"github.com/limitmesh/limitmesh/policies"
	"github.com/limitmesh/limitmesh/usage"
)

// tenCandidates are ten candidates of every algorithm over the
// descriptors of benchRecords, most of them matching most records.
func tenCandidates(b testing.TB) []*policies.Policy {
	docs := []string{
		`{"match": {"tenant": "*"}, "key": ["tenant", "user"], "limits": [{"algorithm": "token_bucket", "rate": "5/s", "burst": 10}]}`,
		`{"match": {"tenant": "*"}, "key": ["tenant"], "limits": [{"algorithm": "gcra", "rate": "500/s", "burst": 100}]}`,
		`{"match": {"operation": "search"}, "key": ["tenant", "user"], "limits": [{"algorithm": "fixed_window", "limit": 20, "window": "1s"}]}`,
		`{"match": {"operation": "write"}, "key": ["tenant", "user"], "limits": [{"algorithm": "sliding_window", "limit": 10, "window": "1s"}]}`,
		`{"match": {"tenant": "t1"}, "key": ["user"], "limits": [{"algorithm": "sliding_log", "limit": 5, "window": "1s"}]}`,
		`{"match": {"user": "*"}, "key": ["user"], "limits": [{"algorithm": "token_bucket", "rate": "2/s", "burst": 4}, {"name": "day", "algorithm": "fixed_window", "limit": 1000, "window": "24h"}]}`,
		`{"match": {}, "key": ["operation"], "limits": [{"algorithm": "token_bucket", "rate": "1000/s", "burst": 2000}]}`,
		`{"match": {"tenant": "*", "operation": "search"}, "key": ["tenant", "plan"], "limits": [{"algorithm": "gcra", "rate": "50/s", "burst": 50}]}`,
		`{"match": {"plan": "free"}, "key": ["tenant", "user"], "limits": [{"algorithm": "token_bucket", "rate": "1/s", "burst": 3}]}`,
		`{"match": {"tenant": "*"}, "key": ["tenant", "operation", "user"], "limits": [{"algorithm": "concurrency", "limit": 3, "window": "200ms"}]}`,
	}
	out := make([]*policies.Policy, len(docs))
	for i, d := range docs {
		out[i] = mustPolicy(b, fmt.Sprintf("cand-%d", i), uint64(i+1), d)
	}
	return out
}

// benchRecords returns n records over 50 tenants of 200 users (10,000
// keys per user-keyed candidate), about 10,000 records per second of
// record time.
func benchRecords(b testing.TB, n int) []usage.Record {
	rng := rand.New(rand.NewPCG(7, 7))
	out := make([]usage.Record, n)
	at := t0
	for i := range out {
		at += int64(rng.IntN(200))
		d, err := policies.NewDescriptor([]policies.Dim{
			{Name: "tenant", Value: fmt.Sprintf("t%d", rng.IntN(50))},
			{Name: "user", Value: fmt.Sprintf("u%d", rng.IntN(200))},
			{Name: "operation", Value: []string{"search", "write"}[rng.IntN(2)]},
			{Name: "plan", Value: []string{"free", "pro"}[rng.IntN(2)]},
		})
		if err != nil {
			b.Fatal(err)
		}
		out[i] = usage.Record{ID: fmt.Sprintf("n1.1.%d", i), TimeUs: at, Descriptor: d, Cost: unit, Allowed: rng.IntN(10) > 0,
			Key: "p.live.tenant=x", Revision: 1}
	}
	return out
}

// BenchmarkReplayTenCandidates: records evaluated per second by the pure
// core with ten candidates (each record decided by about seven of them),
// and the process's CPU time per record (steadier than the rate on a
// shared machine).
func BenchmarkReplayTenCandidates(b *testing.B) {
	recs := benchRecords(b, 200_000)
	replayBench(b, tenCandidates(b), recs)
}

// replayBench replays recs (again and again, a minute later each round)
// through cands b.N times and reports records/s and CPU per record.
func replayBench(b *testing.B, cands []*policies.Policy, recs []usage.Record) {
	r := NewReplay(Options{})
	r.SetCandidates(cands)
	b.ReportAllocs()
	b.ResetTimer()
	cpu0 := cpuTime()
	for i := 0; i < b.N; i++ {
		rec := recs[i%len(recs)]
		rec.TimeUs += int64(i/len(recs)) * 60_000_000
		r.Apply(&rec)
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "records/s")
	b.ReportMetric(float64(cpuTime()-cpu0)/float64(b.N), "cpu-ns/record")
}

// BenchmarkReplayBenchCandidates: the candidates `limitmesh bench
// --candidates 10` puts (eight keyed like the bench policy, two by run
// only) over 10,000 Zipf keys: eight share one key group, so the group's
// index finds a record's state for all eight in one lookup. The documents
// are those of cli.benchCandidateDoc (cli imports shadow, not the other
// way round).
func BenchmarkReplayBenchCandidates(b *testing.B) {
	var cands []*policies.Policy
	for i := range 10 {
		key := `["bench_run","key"]`
		if i%5 == 3 {
			key = `["bench_run"]`
		}
		limits := []string{
			`[{"algorithm":"token_bucket","rate":"500/s","burst":50}]`,
			`[{"algorithm":"gcra","rate":"200/s","burst":20}]`,
			`[{"algorithm":"fixed_window","limit":100,"window":"1s"}]`,
			`[{"algorithm":"sliding_window","limit":5000,"window":"1s"}]`,
			`[{"name":"rate","algorithm":"token_bucket","rate":"100/s","burst":100},{"name":"minute","algorithm":"fixed_window","limit":3000,"window":"1m"}]`,
		}[i%5]
		cands = append(cands, mustPolicy(b, fmt.Sprintf("bench-shadow-r1-%d", i), 1, `{"match":{"bench_run":"r1"},"key":`+key+`,"limits":`+limits+`}`))
	}
	rng := rand.New(rand.NewPCG(1, 2))
	z := rand.NewZipf(rng, 1.1, 1, 9999)
	recs := make([]usage.Record, 200_000)
	at := t0
	for i := range recs {
		at += int64(rng.IntN(30))
		recs[i] = usage.Record{TimeUs: at, Descriptor: desc(b, "bench_run", "r1", "key", fmt.Sprintf("k%d", z.Uint64())), Cost: unit, Allowed: true}
	}
	replayBench(b, cands, recs)
}

// BenchmarkDecodeReplayTenCandidates: what the evaluator does per usage
// message, per record: decode the batch (usage.DecodeBatch) and replay it
// through ten candidates. Batches of 500 records.
func BenchmarkDecodeReplayTenCandidates(b *testing.B) {
	recs := benchRecords(b, 200_000)
	var msgs [][]byte
	for i := 0; i < len(recs); i += 500 {
		msgs = append(msgs, usagetest.AppendBatch(nil, &usage.Batch{Node: "n1", Policy: "live", Records: recs[i : i+500]}))
	}
	r := NewReplay(Options{})
	r.SetCandidates(tenCandidates(b))
	b.ReportAllocs()
	b.ResetTimer()
	cpu0 := cpuTime()
	n := 0
	for i := 0; n < b.N; i++ {
		batch, err := usage.DecodeBatch(msgs[i%len(msgs)])
		if err != nil {
			b.Fatal(err)
		}
		shift := int64(i/len(msgs)) * 60_000_000
		for j := range batch.Records {
			batch.Records[j].TimeUs += shift
			r.Apply(&batch.Records[j])
		}
		n += len(batch.Records)
	}
	b.ReportMetric(float64(n)/b.Elapsed().Seconds(), "records/s")
	b.ReportMetric(float64(cpuTime()-cpu0)/float64(n), "cpu-ns/record")
}

// BenchmarkBacktest: a backtest through a real server's stream of 200,000
// records in batches of 500 (read, decoded and replayed through one
// candidate): records per second, the rate `limitmesh shadow backtest`
// replays a day of history at.
func BenchmarkBacktest(b *testing.B) {
	s := startServer(b)
	_, js := connectJS(b, s)
	installation(b, js, "rl")
	recs := benchRecords(b, 200_000)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for i := 0; i < len(recs); i += 500 {
		body := usagetest.AppendBatch(nil, &usage.Batch{Node: "n1", Policy: "live", Records: recs[i : i+500]})
		if _, err := js.Publish(ctx, usage.Subject("rl", "live"), body); err != nil {
			b.Fatal(err)
		}
	}
	p := tenCandidates(b)[0]
	b.ResetTimer()
	var total uint64
	var elapsed time.Duration
	for i := 0; i < b.N; i++ {
		res, err := Backtest(ctx, js, p, BacktestConfig{Prefix: "rl"})
		if err != nil {
			b.Fatal(err)
		}
		if res.Records != uint64(len(recs)) {
			b.Fatalf("replayed %d records of %d", res.Records, len(recs))
		}
		total += res.Records
		elapsed += res.Elapsed
	}
	b.ReportMetric(float64(total)/elapsed.Seconds(), "records/s")
}

// BenchmarkEvaluatorTenCandidates: the live evaluator, elected and
// consuming the durable consumer, catching up on 200,000 records (in
// batches of 500) with ten candidates: records per second from its start
// until its summaries count every record.
func BenchmarkEvaluatorTenCandidates(b *testing.B) {
	var total uint64
	var elapsed, cpu time.Duration
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		s := startServer(b)
		_, js := connectJS(b, s)
		kv := installation(b, js, "rl")
		cands := tenCandidates(b)
		for j, p := range cands {
			doc, _ := p.MarshalJSON()
			doc = []byte(strings.Replace(string(doc), `"shadow":false`, `"shadow":true`, 1))
			cands[j].Revision = putDoc(b, kv, p.Name, string(doc))
		}
		recs := benchRecords(b, 200_000)
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		for j := 0; j < len(recs); j += 500 {
			body := usagetest.AppendBatch(nil, &usage.Batch{Node: "n1", Policy: "live", Records: recs[j : j+500]})
			if _, err := js.Publish(ctx, usage.Subject("rl", "live"), body); err != nil {
				b.Fatal(err)
			}
		}
		want := expected(cands, recs)
		var wantEvaluated uint64
		for _, w := range want {
			wantEvaluated += w.Evaluated
		}
		b.StartTimer()
		began, cpu0 := time.Now(), cpuTime()
		stop := runEvaluator(b, js, Config{Prefix: "rl", NodeID: "n1", FlushInterval: 100 * time.Millisecond, CheckpointInterval: time.Second})
		for {
			var n uint64
			for _, s := range readSummaries(b, js, "rl") {
				n += s.Evaluated
			}
			if n == wantEvaluated {
				break
			}
			if ctx.Err() != nil {
				b.Fatalf("evaluated %d of %d", n, wantEvaluated)
			}
			time.Sleep(5 * time.Millisecond)
		}
		elapsed += time.Since(began)
		cpu += cpuTime() - cpu0
		total += uint64(len(recs))
		b.StopTimer()
		stop()
		cancel()
	}
	b.ReportMetric(float64(total)/elapsed.Seconds(), "records/s")
	b.ReportMetric(float64(total)/cpu.Seconds(), "records/cpu-s")
}

// cpuTime is the CPU time (user and system) this process has used.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
