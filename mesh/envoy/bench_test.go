package envoy_test

import (
	"context"
	"net"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/limitmesh/limitmesh/mesh"
	"github.com/limitmesh/limitmesh/mesh/client"
	"github.com/limitmesh/limitmesh/mesh/envoy"
)

// BenchmarkShouldRateLimit measures one decision along the bridge's path
// against a real embedded node, 64 in flight (32 per CPU on 2 cores), on
// 1000 keys already in the node's memory, with this process's CPU time per
// decision (cpu-us/op):
//
//	sdk        the SDK's decide over NATS: the bridge's path without gRPC
//	bridge     Server.ShouldRateLimit called in process (mapping, SDK, answer)
//	grpc       ShouldRateLimit through Go's gRPC client and the bridge's server
//	grpc-noop  the same gRPC client and server around a handler that decides nothing
//
// grpc against sdk is the cost of the gRPC hop (docs/protocol.md, "The Envoy
// rate limit service", Load); `limitmesh bench --rls` measures the same
// against the decide phase over NATS in one run.
func BenchmarkShouldRateLimit(b *testing.B) {
	emb, err := mesh.StartEmbedded(mesh.EmbeddedConfig{Listen: "127.0.0.1:-1", DataDir: b.TempDir()})
	if err != nil {
		b.Fatal(err)
	}
	defer emb.Shutdown()
	nc, err := emb.Connect()
	if err != nil {
		b.Fatal(err)
	}
	defer nc.Close()
	node, err := mesh.NewNode(nc, mesh.NodeConfig{})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := node.Start(ctx); err != nil {
		b.Fatal(err)
	}
	defer node.Stop(ctx)
	js, _ := jetstream.New(nc)
	kv, err := js.KeyValue(ctx, "rl_policies")
	if err != nil {
		b.Fatal(err)
	}
	rev, err := kv.Put(ctx, "bench", []byte(`{"match":{"bench":"x"},"key":["bench","key"],"limits":[{"algorithm":"token_bucket","rate":"1000000/s","burst":1000000}]}`))
	if err != nil {
		b.Fatal(err)
	}
	for p := node.Policy("bench"); p == nil || p.Revision < rev; p = node.Policy("bench") {
		time.Sleep(10 * time.Millisecond)
	}

	bnc, err := emb.Connect(nats.Name("limitmesh-envoy"))
	if err != nil {
		b.Fatal(err)
	}
	defer bnc.Close()
	srv, err := envoy.New(envoy.Config{Conn: bnc, Policy: node.Policy, Ready: node.Ready})
	if err != nil {
		b.Fatal(err)
	}
	rls := serve(b, srv.Serve, func() { _ = srv.Shutdown(context.Background()) })
	noop := grpc.NewServer()
	rlsv3.RegisterRateLimitServiceServer(noop, noopServer{})
	noopClients := serve(b, noop.Serve, noop.Stop)
	sdk, err := client.New(bnc)
	if err != nil {
		b.Fatal(err)
	}

	request := func(k int) *rlsv3.RateLimitRequest {
		return &rlsv3.RateLimitRequest{Domain: "bench", Descriptors: []*ratelimitv3.RateLimitDescriptor{{
			Entries: []*ratelimitv3.RateLimitDescriptor_Entry{{Key: "bench", Value: "x"}, {Key: "key", Value: "k" + strconv.Itoa(k%1000)}}}}}
	}
	for _, bc := range []struct {
		name string
		op   func(i, k int) error
	}{
		{"sdk", func(_, k int) error {
			_, err := sdk.Decide(ctx, map[string]string{"domain": "bench", "bench": "x", "key": "k" + strconv.Itoa(k%1000)}, 1)
			return err
		}},
		{"bridge", func(_, k int) error { _, err := srv.ShouldRateLimit(ctx, request(k)); return err }},
		{"grpc", func(i, k int) error { _, err := rls[i%len(rls)].ShouldRateLimit(ctx, request(k)); return err }},
		{"grpc-noop", func(i, k int) error {
			_, err := noopClients[i%len(noopClients)].ShouldRateLimit(ctx, request(k))
			return err
		}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			var worker, seq atomic.Int64
			b.SetParallelism(32)
			cpu0 := processCPU()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				i := int(worker.Add(1))
				for pb.Next() {
					if err := bc.op(i, int(seq.Add(1))); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.StopTimer()
			b.ReportMetric(float64((processCPU()-cpu0).Microseconds())/float64(b.N), "cpu-us/op")
		})
	}
}

// serve runs a gRPC server on a loopback port (stopped at the end) and
// returns 4 clients of it, each on a connection of its own.
func serve(b *testing.B, run func(net.Listener) error, stop func()) []rlsv3.RateLimitServiceClient {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	go func() { _ = run(l) }()
	b.Cleanup(stop)
	var out []rlsv3.RateLimitServiceClient
	for range 4 {
		cc, err := grpc.NewClient(l.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { cc.Close() })
		out = append(out, rlsv3.NewRateLimitServiceClient(cc))
	}
	return out
}

type noopServer struct {
	rlsv3.UnimplementedRateLimitServiceServer
}

func (noopServer) ShouldRateLimit(context.Context, *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
	return &rlsv3.RateLimitResponse{OverallCode: rlsv3.RateLimitResponse_OK,
		Statuses: []*rlsv3.RateLimitResponse_DescriptorStatus{{Code: rlsv3.RateLimitResponse_OK}}}, nil
}

// processCPU is this process's CPU time so far (user and system).
func processCPU() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
