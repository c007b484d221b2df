package integration

import (
	"context"
	"fmt"
	"strings"
	"testing"

	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// TestProcessEnvoy runs two `limitmesh serve --envoy-listen` processes
// joined to a 3-server NATS cluster with --nats-url: Envoy-shaped calls to
// either bridge are decided by the mesh, so one limit holds across both
// (40 of 60 admitted, as over NATS), and both processes answer health
// checks and stop cleanly on SIGTERM.
func TestProcessEnvoy(t *testing.T) {
	servers := embeddedCluster(t, 3)
	var urls []string
	for _, s := range servers {
		urls = append(urls, s.ClientURL())
	}
	ports := freePorts(t, 2)
	addrs := []string{fmt.Sprintf("127.0.0.1:%d", ports[0]), fmt.Sprintf("127.0.0.1:%d", ports[1])}
	procs := startProcs(t, procSpec{n: 2, natsURL: strings.Join(urls, ","),
		each: [][]string{{"--envoy-listen", addrs[0]}, {"--envoy-listen", addrs[1]}}})
	client := connectURLs(t, urls[0])
	rev := putPolicy(t, client, "rl_policies", "slow", slowPolicy)
	waitProcsApplied(t, "slow", rev, procs...)

	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	req := &rlsv3.RateLimitRequest{Domain: "edge", Descriptors: []*ratelimitv3.RateLimitDescriptor{
		{Entries: []*ratelimitv3.RateLimitDescriptor_Entry{{Key: "tenant", Value: "envoyproc"}}}}}
	admitted := 0
	for i, addr := range addrs {
		conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		h, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
		if err != nil || h.Status != healthpb.HealthCheckResponse_SERVING {
			t.Fatalf("health of %s: %v, %v", procs[i].name, h, err)
		}
		rls := rlsv3.NewRateLimitServiceClient(conn)
		for range 30 {
			resp, err := rls.ShouldRateLimit(ctx, req)
			if err != nil {
				t.Fatalf("ShouldRateLimit through %s: %v", procs[i].name, err)
			}
			if resp.Statuses[0].CurrentLimit.GetName() != "slow" {
				t.Fatalf("through %s: %v, not decided by policy slow", procs[i].name, resp)
			}
			if resp.OverallCode == rlsv3.RateLimitResponse_OK {
				admitted++
			}
		}
	}
	if admitted != 40 {
		t.Fatalf("admitted %d of 60 through the two bridges, want 40 (burst 40, one limit for the mesh)", admitted)
	}
	for _, p := range procs {
		p.stop()
	}
}
