package usage

import (
	"context"
	"math/rand/v2"
	"testing"
	"time"
)

// BenchmarkLedgerIngest measures the reconciler's ingestion rate: b.N
// records (1000 per message, over 10,000 limit keys drawn Zipf (s=1.1)
// from one policy, decimal costs, one node) are published first, then the
// time for a fresh reconciler to put them all in the ledger is measured
// and reported as records/s. Run it with a fixed count of at least a
// million records, -benchtime=1000000x: the reconciler writes a group when
// it holds MaxGroupRecords (500,000) records or GroupInterval (5 s) after
// it started, so with fewer records the time is mostly the last group's
// wait (200,000 records: about 37,000 records/s, against 140,000 with a
// million and 220,000 with GroupInterval at 250 ms).
func BenchmarkLedgerIngest(b *testing.B) {
	ts := startServer(b)
	_, js := connect(b, ts)
	if _, err := EnsureStream(testCtx(b), js, StreamConfig{Prefix: "rl"}); err != nil {
		b.Fatal(err)
	}
	p, err := NewPublisher(js, PublisherConfig{Node: "n1", Interval: 50 * time.Millisecond})
	if err != nil {
		b.Fatal(err)
	}
	z := rand.NewZipf(rand.New(rand.NewPCG(1, 2)), 1.1, 1, 9_999)
	descs := make([]Record, 10_000)
	for k := range descs {
		descs[k] = ledgerRecord(b, "acme", k, 0, 0, true)
	}
	t0 := time.Now().UnixMicro()
	for i := 0; i < b.N; i++ {
		r := descs[z.Uint64()]
		r.TimeUs = t0 + int64(i)
		r.Cost = int64(i%7+1) * 250_000
		r.Allowed = i%10 != 0
		for !p.Add("acme", r) {
			time.Sleep(time.Millisecond)
		}
	}
	if err := p.Close(testCtx(b)); err != nil {
		b.Fatal(err)
	}
	last := lastSeq(b, js)
	r, err := NewReconciler(testCtx(b), js, ReconcilerConfig{Node: "n1"})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	b.ResetTimer()
	start := time.Now()
	go func() { r.Run(ctx); close(done) }()
	waitCursor(b, r.KV(), last, 10*time.Minute)
	elapsed := time.Since(start)
	b.StopTimer()
	cancel()
	<-done
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "records/s")
}

// BenchmarkLedgerLive measures the whole pipeline with the reconciler
// running while records are added: b.N records (same shape as
// BenchmarkLedgerIngest) are added as fast as the publisher accepts them,
// and the time until the ledger holds them all is reported as records/s,
// with the process's CPU time per record (cpu-µs/record; the floor that
// JetStream alone sets is BenchmarkStreamFloor's).
// Publisher, server and reconciler share the machine.
func BenchmarkLedgerLive(b *testing.B) {
	ts := startServer(b)
	_, js := connect(b, ts)
	if _, err := EnsureStream(testCtx(b), js, StreamConfig{Prefix: "rl"}); err != nil {
		b.Fatal(err)
	}
	_, js2 := connect(b, ts)
	r, err := NewReconciler(testCtx(b), js2, ReconcilerConfig{Node: "n1"})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { r.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	p, err := NewPublisher(js, PublisherConfig{Node: "n1", MaxBuffered: 200_000})
	if err != nil {
		b.Fatal(err)
	}
	z := rand.NewZipf(rand.New(rand.NewPCG(1, 2)), 1.1, 1, 9_999)
	descs := make([]Record, 10_000)
	for k := range descs {
		descs[k] = ledgerRecord(b, "acme", k, 0, 0, true)
	}
	b.ResetTimer()
	cpu0, start := cpuTime(b), time.Now()
	t0 := start.UnixMicro()
	for i := 0; i < b.N; i++ {
		rec := descs[z.Uint64()]
		rec.TimeUs = t0 + int64(i)
		rec.Cost = int64(i%7+1) * 250_000
		rec.Allowed = i%10 != 0
		for !p.Add("acme", rec) {
			time.Sleep(100 * time.Microsecond)
		}
	}
	if err := p.Close(testCtx(b)); err != nil {
		b.Fatal(err)
	}
	last := lastSeq(b, js)
	waitCursor(b, r.KV(), last, 10*time.Minute)
	cpu, elapsed := cpuTime(b)-cpu0, time.Since(start)
	b.StopTimer()
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "records/s")
	b.ReportMetric(float64(cpu.Microseconds())/float64(b.N), "cpu-µs/record")
}
