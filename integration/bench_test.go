package integration

import (
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/limitmesh/limitmesh/mesh"
	"github.com/nats-io/nats.go"
)

// The decision benchmarks run against an embedded server over TCP
// loopback, with the node on its own connection; BenchmarkEcho is the
// baseline: a raw NATS request-reply echo with the same connection setup,
// measured in the same run. Report both and the ratio decide/echo.
//
// Sub-benchmarks: seq (one request at a time), par64 (64 in flight on one
// connection; hot = one key, so group commit applies; keys = 64 keys).

// benchPolicy admits everything the benchmark sends (burst 1e9 units), so
// every decision writes state.
const benchPolicy = `{"match":{"tenant":"*"},"key":["tenant","user"],"limits":[{"algorithm":"token_bucket","rate":"1000000000/s","burst":1000000000}]}`

func benchSetup(b *testing.B) (*nats.Conn, *testNode) {
	e := server(b, b.TempDir())
	tn := startNode(b, e, mesh.NodeConfig{})
	rev := putPolicy(b, tn.nc, "rl_policies", "bench", benchPolicy)
	waitFor(b, "bench policy", func() bool {
		return decide(b, tn.nc, "rl.v1.decide", `{"descriptor":{"tenant":"t","user":"u"},"dry_run":true}`).Revision == rev
	})
	return connect(b, e), tn
}

func runRequests(b *testing.B, nc *nats.Conn, subject string, body func(i int64) []byte, inflight int) {
	b.ReportAllocs()
	b.ResetTimer()
	if inflight <= 1 {
		for i := 0; i < b.N; i++ {
			m, err := nc.Request(subject, body(int64(i)), testTimeout)
			if err != nil || m.Header.Get("Nats-Service-Error-Code") != "" {
				b.Fatalf("request: %v %v", err, m)
			}
		}
		return
	}
	var n atomic.Int64
	b.SetParallelism((inflight + 1) / 2) // 2 cores: GOMAXPROCS x this goroutines
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			i := n.Add(1)
			m, err := nc.Request(subject, body(i), testTimeout)
			if err != nil || m.Header.Get("Nats-Service-Error-Code") != "" {
				b.Errorf("request: %v", err)
				return
			}
		}
	})
}

func BenchmarkDecideNATS(b *testing.B) {
	nc, _ := benchSetup(b)
	hot := []byte(`{"descriptor":{"tenant":"acme","user":"hot"}}`)
	keys := make([][]byte, 64)
	for i := range keys {
		keys[i] = fmt.Appendf(nil, `{"descriptor":{"tenant":"acme","user":"u%d"}}`, i)
	}
	b.Run("seq", func(b *testing.B) {
		runRequests(b, nc, "rl.v1.decide", func(int64) []byte { return hot }, 1)
	})
	b.Run("par64-hot", func(b *testing.B) {
		runRequests(b, nc, "rl.v1.decide", func(int64) []byte { return hot }, 64)
	})
	b.Run("par64-keys", func(b *testing.B) {
		runRequests(b, nc, "rl.v1.decide", func(i int64) []byte { return keys[i%64] }, 64)
	})
}

func BenchmarkEcho(b *testing.B) {
	e := server(b, b.TempDir())
	resp := connect(b, e)
	reply := []byte(`{"allowed":true,"policy":"bench","revision":1,"remaining":999999999,"retry_after_ms":0,"reset_after_ms":1}`)
	if _, err := resp.QueueSubscribe("echo", "echo", func(m *nats.Msg) { _ = m.Respond(reply) }); err != nil {
		b.Fatal(err)
	}
	if err := resp.Flush(); err != nil {
		b.Fatal(err)
	}
	nc := connect(b, e)
	body := []byte(`{"descriptor":{"tenant":"acme","user":"hot"}}`)
	b.Run("seq", func(b *testing.B) {
		runRequests(b, nc, "echo", func(int64) []byte { return body }, 1)
	})
	b.Run("par64", func(b *testing.B) {
		runRequests(b, nc, "echo", func(int64) []byte { return body }, 64)
	})
}
