package usage

import (
	"context"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// cpuTime is the process's user plus system CPU time so far.
func cpuTime(tb testing.TB) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		tb.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkStreamFloor measures what JetStream alone costs per usage
// record, with none of the publisher's or the ledger's work: b.N records,
// encoded once as bench's records are (1,000 a message, about 200 bytes
// each), are published to RL_USAGE with a Nats-Msg-Id a message, one
// message at a time as the publisher does, while a durable consumer with
// the ledger's acknowledgement policy fetches them 64 at a time and
// acknowledges them without decoding. Reported: cpu-µs/record, the
// process's CPU time (user and system, server and clients) per record.
//
// It is the floor of usage's cost on a node that keeps the ledger, as the
// single node of `limitmesh bench` does: every record is stored once and
// read once ("store+read"). "read" reads records stored before the timer
// starts: what a second consumer (the shadow evaluator's) adds at least.
// The full pipeline, encoding and ledger included, is BenchmarkLedgerLive.
// Run it with -benchtime=1000000x.
func BenchmarkStreamFloor(b *testing.B) {
	b.Run("store+read", func(b *testing.B) { streamFloor(b, false) })
	b.Run("read", func(b *testing.B) { streamFloor(b, true) })
}

// streamFloor is BenchmarkStreamFloor; with readOnly, the messages are
// stored before the timer starts and only their reading is measured (what
// a second consumer, the shadow evaluator's, adds).
func streamFloor(b *testing.B, readOnly bool) {
	ts := startServer(b)
	_, js := connect(b, ts)
	ctx := testCtx(b)
	if _, err := EnsureStream(ctx, js, StreamConfig{Prefix: "rl"}); err != nil {
		b.Fatal(err)
	}
	_, cjs := connect(b, ts)
	stream, err := cjs.Stream(ctx, StreamName("rl"))
	if err != nil {
		b.Fatal(err)
	}
	cons, err := stream.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{
		Durable: "floor", AckPolicy: jetstream.AckExplicitPolicy, MaxAckPending: 10_000,
	})
	if err != nil {
		b.Fatal(err)
	}

	const perMsg = 1000
	policy := "bench-strict-1043464d"
	records := make([]Record, perMsg)
	t0 := time.Now().UnixMicro()
	for i := range records {
		k := "k" + strconv.Itoa(i*7)
		records[i] = Record{ID: "n1.b1." + strconv.Itoa(i+1),
			TimeUs: t0 + int64(i), Revision: 1, Key: "p." + policy + ".key=" + k,
			Descriptor: desc(b, "key", k), Cost: 1_000_000, Allowed: i%3 != 0,
		}
	}
	body := appendBatch(nil, &Batch{Node: "n1", Policy: policy, Records: records})
	msgs := (b.N + perMsg - 1) / perMsg

	msg := &nats.Msg{Subject: Subject("rl", policy), Header: nats.Header{}, Data: body}
	publish := func() {
		for i := 0; i < msgs; i++ {
			msg.Header.Set(jetstream.MsgIDHeader, "n1.b1."+policy+"."+strconv.Itoa(i))
			pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			_, err := js.PublishMsg(pctx, msg, jetstream.WithExpectStream(StreamName("rl")))
			cancel()
			if err != nil {
				b.Fatal(err)
			}
		}
	}
	if readOnly {
		publish()
	}

	b.ResetTimer()
	cpu0, start := cpuTime(b), time.Now()
	consumed := make(chan error, 1)
	go func() {
		got := 0
		for got < msgs {
			batch, err := cons.Fetch(64, jetstream.FetchMaxWait(time.Second))
			if err != nil {
				consumed <- err
				return
			}
			for m := range batch.Messages() {
				if err := m.Ack(); err != nil {
					consumed <- err
					return
				}
				got++
			}
		}
		consumed <- nil
	}()

	if !readOnly {
		publish()
	}
	if err := <-consumed; err != nil {
		b.Fatal(err)
	}
	cpu, elapsed := cpuTime(b)-cpu0, time.Since(start)
	b.StopTimer()
	total := float64(msgs * perMsg)
	b.ReportMetric(float64(cpu.Microseconds())/total, "cpu-µs/record")
	b.ReportMetric(total/elapsed.Seconds(), "records/s")
	b.ReportMetric(float64(len(body))/perMsg, "bytes/record")
}
