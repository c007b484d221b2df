package client

import (
	"context"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/jstest"
	"github.com/nats-io/nats.go"
)

// benchReply is the test responder's fixed decide reply.
var benchReply = []byte(`{"allowed":true,"policy":"acme-search","revision":12,"remaining":39,"retry_after_ms":0,"reset_after_ms":100}`)

// BenchmarkDecideVsEcho measures Decide round trips against a responder
// that answers a fixed reply, and raw nc.Request round trips of the same
// request bytes against an echo responder on the same server, in the same
// run. The decide sub-benchmark reports the ratio to the echo one
// (x-echo); run both (the default) to get it.
func BenchmarkDecideVsEcho(b *testing.B) {
	s := startServer(b)
	nc := jstest.Connect(b, s)
	srv := jstest.Connect(b, s)
	if _, err := srv.Subscribe("rl.v1.decide", func(m *nats.Msg) { _ = m.Respond(benchReply) }); err != nil {
		b.Fatal(err)
	}
	if _, err := srv.Subscribe("echo", func(m *nats.Msg) { _ = m.Respond(m.Data) }); err != nil {
		b.Fatal(err)
	}
	if err := srv.Flush(); err != nil {
		b.Fatal(err)
	}
	c := newClient(b, nc, Timeout(5*time.Second))
	d := map[string]string{"tenant": "acme", "operation": "search", "plan": "v7"}
	req := appendRequest(nil, d, 1, &decideOptions{})
	ctx := context.Background()

	var echoNs float64
	b.Run("echo", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := nc.Request("echo", req, 5*time.Second); err != nil {
				b.Fatal(err)
			}
		}
		echoNs = float64(b.Elapsed().Nanoseconds()) / float64(b.N)
	})
	b.Run("decide", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			r, err := c.Decide(ctx, d, 1)
			if err != nil || !r.Allowed {
				b.Fatal(r, err)
			}
		}
		if echoNs > 0 {
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/echoNs, "x-echo")
		}
	})
}

// BenchmarkEncodeRequest measures the hand-written request encoder.
func BenchmarkEncodeRequest(b *testing.B) {
	d := map[string]string{"tenant": "acme", "operation": "search", "plan": "v7"}
	o := &decideOptions{requestID: "7f1c2e"}
	buf := make([]byte, 0, 512)
	b.ReportAllocs()
	for b.Loop() {
		buf = appendRequest(buf[:0], d, 3, o)
	}
}

// BenchmarkDecodeReply measures the reply decoder.
func BenchmarkDecodeReply(b *testing.B) {
	b.ReportAllocs()
	for b.Loop() {
		if _, err := decodeReply(nil, benchReply); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkEmergencyBucket measures a failure-path decision from the
// emergency bucket of one key (no network).
func BenchmarkEmergencyBucket(b *testing.B) {
	k := newKeyCache(DefaultMaxEmergencyBuckets)
	f := FailOpenBucket(1_000_000, 1_000_000)
	key := descriptorKey(map[string]string{"tenant": "acme"})
	now := int64(0)
	b.ReportAllocs()
	for b.Loop() {
		now += 1000
		k.take(key, f, now, 1_000_000)
	}
}
