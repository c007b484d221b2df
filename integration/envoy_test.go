package integration

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/encoding"
	grpcproto "google.golang.org/grpc/encoding/proto"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/mem"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/limitmesh/limitmesh/mesh"
	"github.com/limitmesh/limitmesh/mesh/envoy"
)

// The Envoy tests' policies: in domain "edge", 3 units a client address
// (refilling 1 a day, so nothing refills during a test), and per user,
// keyed by the user and the plan (a descriptor without a plan is a 400).
const (
	envoyIPPolicy   = `{"match":{"domain":"edge","remote_address":"*"},"key":["domain","remote_address"],"limits":[{"algorithm":"token_bucket","rate":"1/d","burst":3}]}`
	envoyUserPolicy = `{"match":{"domain":"edge","x_user_id":"*"},"key":["x_user_id","plan"],"limits":[{"algorithm":"fixed_window","limit":100,"window":"1h"}]}`
)

// bridge is an Envoy rate limit service in front of a node, and a gRPC
// client of it.
type bridge struct {
	srv  *envoy.Server
	addr string
	conn *grpc.ClientConn
	rls  rlsv3.RateLimitServiceClient
}

// startBridge serves the bridge for tn on a connection of its own to e
// (ready: its health, nil for the node's readiness), registering its
// metrics in reg; stopped at cleanup.
func startBridge(t *testing.T, e *mesh.Embedded, tn *testNode, reg prometheus.Registerer, ready func() bool) *bridge {
	t.Helper()
	if ready == nil {
		ready = tn.node.Ready
	}
	srv, err := envoy.New(envoy.Config{Conn: connect(t, e), Policy: tn.node.Policy, Ready: ready, Registry: reg})
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()
	conn, err := grpc.NewClient(l.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn.Close()
		ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
		defer cancel()
		if err := srv.Shutdown(ctx); err != nil {
			t.Errorf("Shutdown: %v", err)
		}
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return &bridge{srv: srv, addr: l.Addr().String(), conn: conn, rls: rlsv3.NewRateLimitServiceClient(conn)}
}

// envoyNode starts a server, a node whose metrics registry the bridge
// shares, the Envoy policies, and the bridge.
func envoyNode(t *testing.T) (*mesh.Embedded, *testNode, *bridge) {
	t.Helper()
	e := server(t, t.TempDir())
	reg := prometheus.NewRegistry()
	tn := startNode(t, e, mesh.NodeConfig{Registry: reg})
	r1 := putPolicy(t, tn.nc, "rl_policies", "edge-ip", envoyIPPolicy)
	r2 := putPolicy(t, tn.nc, "rl_policies", "edge-user", envoyUserPolicy)
	waitApplied(t, "edge-ip", r1, tn)
	waitApplied(t, "edge-user", r2, tn)
	return e, tn, startBridge(t, e, tn, reg, nil)
}

// rlDesc is an Envoy descriptor of key, value pairs.
func rlDesc(kv ...string) *ratelimitv3.RateLimitDescriptor {
	d := &ratelimitv3.RateLimitDescriptor{}
	for i := 0; i+1 < len(kv); i += 2 {
		d.Entries = append(d.Entries, &ratelimitv3.RateLimitDescriptor_Entry{Key: kv[i], Value: kv[i+1]})
	}
	return d
}

func shouldRateLimit(t *testing.T, b *bridge, req *rlsv3.RateLimitRequest) *rlsv3.RateLimitResponse {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	resp, err := b.rls.ShouldRateLimit(ctx, req)
	if err != nil {
		t.Fatalf("ShouldRateLimit(%v): %v", req, err)
	}
	return resp
}

// statusString renders a status as CODE[ n/UNIT][ remaining R][ reset]:
// "OK 3/DAY remaining 1 reset", "OVER_LIMIT", "OK".
func statusString(s *rlsv3.RateLimitResponse_DescriptorStatus) string {
	out := s.Code.String()
	if l := s.CurrentLimit; l != nil {
		out += fmt.Sprintf(" %d/%v", l.RequestsPerUnit, l.Unit)
		if m := l.GetUnitMultiplier(); m != nil {
			out += fmt.Sprintf("x%d", m.GetValue())
		}
		out += fmt.Sprintf(" remaining %d", s.LimitRemaining)
	}
	if s.DurationUntilReset != nil && s.DurationUntilReset.AsDuration() > 0 {
		out += " reset"
	}
	return out
}

func headerMap(r *rlsv3.RateLimitResponse) map[string]string {
	h := map[string]string{}
	for _, hv := range r.ResponseHeadersToAdd {
		h[hv.Key] = hv.Value
	}
	return h
}

// TestEnvoyStatuses: Envoy-shaped requests through the official gRPC
// client get the statuses docs/protocol.md ("The Envoy rate limit
// service") documents: several descriptors decided each by its policy,
// hits_addend as the cost (request and descriptor level), unknown
// descriptors OK with no limit, the empty domain, odd keys mapped, values
// too long or with control characters refused (OVER_LIMIT, no limit), a
// descriptor its policy's key cannot be built from refused (the node's
// 400), and OVER_LIMIT with the RateLimit headers.
func TestEnvoyStatuses(t *testing.T) {
	_, _, b := envoyNode(t)
	for _, step := range []struct {
		name    string
		req     *rlsv3.RateLimitRequest
		overall rlsv3.RateLimitResponse_Code
		want    []string // statusString of each descriptor
		headers map[string]string
	}{
		{"first hits of an address", &rlsv3.RateLimitRequest{Domain: "edge", HitsAddend: 2,
			Descriptors: []*ratelimitv3.RateLimitDescriptor{rlDesc("remote_address", "10.0.0.1")}},
			rlsv3.RateLimitResponse_OK, []string{"OK 1/DAY remaining 1 reset"},
			map[string]string{"ratelimit": `"edge-ip";r=1;t=172800`, "ratelimit-policy": `"edge-ip";q=1;w=86400`}},
		{"over: 2 more with 1 left", &rlsv3.RateLimitRequest{Domain: "edge", HitsAddend: 2,
			Descriptors: []*ratelimitv3.RateLimitDescriptor{rlDesc("remote_address", "10.0.0.1")}},
			rlsv3.RateLimitResponse_OVER_LIMIT, []string{"OVER_LIMIT 1/DAY remaining 1 reset"},
			map[string]string{"ratelimit": `"edge-ip";r=1;t=172800`, "ratelimit-policy": `"edge-ip";q=1;w=86400`, "retry-after": "86400"}},
		{"the last unit", &rlsv3.RateLimitRequest{Domain: "edge",
			Descriptors: []*ratelimitv3.RateLimitDescriptor{rlDesc("remote_address", "10.0.0.1")}},
			rlsv3.RateLimitResponse_OK, []string{"OK 1/DAY remaining 0 reset"}, nil},
		{"several descriptors, an odd key, an unknown one", &rlsv3.RateLimitRequest{Domain: "edge",
			Descriptors: []*ratelimitv3.RateLimitDescriptor{
				rlDesc("remote_address", "10.0.0.2"),
				rlDesc("X-User-Id", "u1", "plan", "gold"),
				rlDesc("unknown_key", "zzz"),
			}},
			rlsv3.RateLimitResponse_OK, []string{"OK 1/DAY remaining 2 reset", "OK 100/HOUR remaining 99 reset", "OK"},
			nil},
		{"a descriptor's own hits_addend", &rlsv3.RateLimitRequest{Domain: "edge", HitsAddend: 1,
			Descriptors: []*ratelimitv3.RateLimitDescriptor{withHits(rlDesc("remote_address", "10.0.0.3"), 3)}},
			rlsv3.RateLimitResponse_OK, []string{"OK 1/DAY remaining 0 reset"}, nil},
		{"a descriptor hits_addend of 0 spends nothing", &rlsv3.RateLimitRequest{Domain: "edge", HitsAddend: 5,
			Descriptors: []*ratelimitv3.RateLimitDescriptor{withHits(rlDesc("remote_address", "10.0.0.4"), 0)}},
			rlsv3.RateLimitResponse_OK, []string{"OK 1/DAY remaining 2 reset"}, nil},
		{"... so a real hit after it has as much left", &rlsv3.RateLimitRequest{Domain: "edge",
			Descriptors: []*ratelimitv3.RateLimitDescriptor{rlDesc("remote_address", "10.0.0.4")}},
			rlsv3.RateLimitResponse_OK, []string{"OK 1/DAY remaining 2 reset"}, nil},
		{"an empty domain matches no edge policy", &rlsv3.RateLimitRequest{
			Descriptors: []*ratelimitv3.RateLimitDescriptor{rlDesc("remote_address", "10.0.0.1")}},
			rlsv3.RateLimitResponse_OK, []string{"OK"}, map[string]string{}},
		{"an oversized value is refused, the others decided", &rlsv3.RateLimitRequest{Domain: "edge",
			Descriptors: []*ratelimitv3.RateLimitDescriptor{
				rlDesc("remote_address", strings.Repeat("9", 129)),
				rlDesc("remote_address", "10.0.0.5"),
			}},
			rlsv3.RateLimitResponse_OVER_LIMIT, []string{"OVER_LIMIT", "OK 1/DAY remaining 2 reset"},
			map[string]string{"ratelimit": `"edge-ip";r=2;t=86400`, "ratelimit-policy": `"edge-ip";q=1;w=86400`}},
		{"a control character is refused", &rlsv3.RateLimitRequest{Domain: "edge",
			Descriptors: []*ratelimitv3.RateLimitDescriptor{rlDesc("remote_address", "10.0.0.6\n")}},
			rlsv3.RateLimitResponse_OVER_LIMIT, []string{"OVER_LIMIT"}, map[string]string{}},
		{"the node's 400 (no plan for the key) is refused", &rlsv3.RateLimitRequest{Domain: "edge",
			Descriptors: []*ratelimitv3.RateLimitDescriptor{rlDesc("x-user-id", "u2")}},
			rlsv3.RateLimitResponse_OVER_LIMIT, []string{"OVER_LIMIT"}, map[string]string{}},
		{"a refund is not decided", &rlsv3.RateLimitRequest{Domain: "edge",
			Descriptors: []*ratelimitv3.RateLimitDescriptor{{IsNegativeHits: true, Entries: rlDesc("remote_address", "10.0.0.1").Entries}}},
			rlsv3.RateLimitResponse_OK, []string{"OK"}, map[string]string{}},
	} {
		resp := shouldRateLimit(t, b, step.req)
		var got []string
		for _, s := range resp.Statuses {
			got = append(got, statusString(s))
		}
		if resp.OverallCode != step.overall || strings.Join(got, "; ") != strings.Join(step.want, "; ") {
			t.Errorf("%s: %v [%s], want %v [%s]", step.name, resp.OverallCode, strings.Join(got, "; "), step.overall, strings.Join(step.want, "; "))
		}
		if step.headers != nil {
			if h := headerMap(resp); fmt.Sprint(h) != fmt.Sprint(step.headers) {
				t.Errorf("%s: headers %v, want %v", step.name, h, step.headers)
			}
		}
	}

	// No descriptors: INVALID_ARGUMENT.
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	if _, err := b.rls.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "edge"}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("no descriptors: %v, want InvalidArgument", err)
	}
}

// rawCodec sends a request's bytes as they are (so that they may hold
// what proto.Marshal refuses, as a C++ sender's may) and decodes replies
// with the proto codec.
type rawCodec struct{}

func (rawCodec) Name() string { return "proto" }
func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	return mem.BufferSlice{mem.SliceBuffer(*v.(*[]byte))}, nil
}
func (rawCodec) Unmarshal(data mem.BufferSlice, v any) error {
	return encoding.GetCodecV2(grpcproto.Name).Unmarshal(data, v)
}

// TestEnvoyInvalidUTF8: a request whose strings hold invalid UTF-8 (which
// Go's protobuf refuses, and Envoy may send) is answered per descriptor:
// the descriptor with the invalid value is refused (OVER_LIMIT, no
// limit), the others decided; an invalid domain refuses every descriptor.
func TestEnvoyInvalidUTF8(t *testing.T) {
	_, _, b := envoyNode(t)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	call := func(raw []byte) *rlsv3.RateLimitResponse {
		t.Helper()
		var resp rlsv3.RateLimitResponse
		if err := b.conn.Invoke(ctx, "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit", &raw, &resp,
			grpc.ForceCodecV2(rawCodec{})); err != nil {
			t.Fatalf("ShouldRateLimit: %v", err)
		}
		return &resp
	}
	entry := func(k, v string) []byte {
		var e []byte
		e = protowire.AppendTag(e, 1, protowire.BytesType)
		e = protowire.AppendString(e, k)
		e = protowire.AppendTag(e, 2, protowire.BytesType)
		e = protowire.AppendString(e, v)
		var d []byte
		d = protowire.AppendTag(d, 1, protowire.BytesType)
		return protowire.AppendBytes(d, e)
	}
	request := func(domain string, descs ...[]byte) []byte {
		var r []byte
		r = protowire.AppendTag(r, 1, protowire.BytesType)
		r = protowire.AppendString(r, domain)
		for _, d := range descs {
			r = protowire.AppendTag(r, 2, protowire.BytesType)
			r = protowire.AppendBytes(r, d)
		}
		return r
	}
	resp := call(request("edge", entry("remote_address", "10.3.0.1\xff"), entry("remote_address", "10.3.0.2"), entry("X-\xffId", "u1")))
	var got []string
	for _, s := range resp.Statuses {
		got = append(got, statusString(s))
	}
	if want := "OVER_LIMIT; OK 1/DAY remaining 2 reset; OK"; resp.OverallCode != rlsv3.RateLimitResponse_OVER_LIMIT || strings.Join(got, "; ") != want {
		t.Errorf("invalid value: %v [%s], want OVER_LIMIT [%s]", resp.OverallCode, strings.Join(got, "; "), want)
	}
	resp = call(request("edge\xfe", entry("remote_address", "10.3.0.3")))
	if resp.OverallCode != rlsv3.RateLimitResponse_OVER_LIMIT || resp.Statuses[0].CurrentLimit != nil {
		t.Errorf("invalid domain: %v", resp)
	}
}

func withHits(d *ratelimitv3.RateLimitDescriptor, h uint64) *ratelimitv3.RateLimitDescriptor {
	d.HitsAddend = wrapperspb.UInt64(h)
	return d
}

// TestEnvoyUnavailable: when no decision can be made the call fails with
// UNAVAILABLE (Envoy's failure_mode_deny then applies): the state store
// gone (the node's 503), and no node at all (no responders).
func TestEnvoyUnavailable(t *testing.T) {
	e, tn, b := envoyNode(t)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	req := &rlsv3.RateLimitRequest{Domain: "edge", Descriptors: []*ratelimitv3.RateLimitDescriptor{
		rlDesc("unknown_key", "a"), rlDesc("remote_address", "10.1.0.1")}}
	shouldRateLimit(t, b, req)

	js, _ := jetstream.New(tn.nc)
	if err := js.DeleteStream(ctx, "KV_rl_state"); err != nil {
		t.Fatal(err)
	}
	req.Descriptors[1] = rlDesc("remote_address", "10.1.0.2") // a key not in memory
	if _, err := b.rls.ShouldRateLimit(ctx, req); status.Code(err) != codes.Unavailable {
		t.Fatalf("state store gone: %v, want Unavailable", err)
	}

	// A bridge whose prefix no node serves: no responders.
	srv, err := envoy.New(envoy.Config{Conn: connect(t, e), Prefix: "nobody"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := srv.ShouldRateLimit(ctx, req); status.Code(err) != codes.Unavailable {
		t.Fatalf("no node: %v, want Unavailable", err)
	}
	if v := metricValue(t, tn, `limitmesh_envoy_requests_total{code="unavailable"}`); v != 1 {
		t.Errorf(`limitmesh_envoy_requests_total{code="unavailable"} = %v, want 1`, v)
	}
}

// TestEnvoyRecorded: the bridge's decisions are decisions like any other:
// in the usage stream (with the mapped descriptor, domain included), in
// the ledger, and in the decisions metrics; the bridge's own metrics count
// its calls and descriptors.
func TestEnvoyRecorded(t *testing.T) {
	_, tn, b := envoyNode(t)
	for range 4 { // 3 admitted, 1 denied
		shouldRateLimit(t, b, &rlsv3.RateLimitRequest{Domain: "edge",
			Descriptors: []*ratelimitv3.RateLimitDescriptor{rlDesc("remote_address", "10.2.0.1"), rlDesc("X-User-Id", "u9", "plan", "free")}})
	}
	const key = "p.edge-ip.domain=edge.remote_address=10_2e2_2e0_2e1" // '.' escaped in keys
	waitFor(t, "the usage records", func() bool {
		recs := usageRecords(t, tn.nc)
		// The fourth request is over edge-ip's limit: all or nothing, it
		// spends nothing of edge-user's (no record there).
		return len(recs["rl.usage.edge-ip"]) == 4 && len(recs["rl.usage.edge-user"]) == 3
	})
	month := time.Now().UTC().Format("2006-01")
	waitFor(t, "the ledger's totals", func() bool {
		tot, ok := ledgerTotals(t, tn.nc, "edge-ip", month, key)
		return ok && tot.Allowed == 3 && tot.Denied == 1
	})
	recs := usageRecords(t, tn.nc)["rl.usage.edge-ip"]
	allowed, denied := 0, 0
	for _, r := range recs {
		if r.Key != key {
			t.Errorf("record of key %q, want %q", r.Key, key)
		}
		if v, _ := r.Descriptor.Get("domain"); v != "edge" {
			t.Errorf("record descriptor %v: no domain edge", r.Descriptor)
		}
		if r.Allowed {
			allowed++
		} else {
			denied++
		}
	}
	if allowed != 3 || denied != 1 {
		t.Errorf("usage records: %d allowed, %d denied; want 3 and 1", allowed, denied)
	}
	for series, want := range map[string]float64{
		`limitmesh_decisions_total{policy="edge-ip",result="allowed"}`:   3,
		`limitmesh_decisions_total{policy="edge-ip",result="denied"}`:    1,
		`limitmesh_decisions_total{policy="edge-user",result="allowed"}`: 3,
		`limitmesh_decisions_total{policy="edge-user",result="denied"}`:  1,
		`limitmesh_envoy_requests_total{code="ok"}`:                      3,
		`limitmesh_envoy_requests_total{code="over_limit"}`:              1,
		`limitmesh_envoy_descriptors_total{result="allowed"}`:            7,
		`limitmesh_envoy_descriptors_total{result="denied"}`:             1,
		`limitmesh_envoy_request_duration_seconds_count`:                 4,
	} {
		if v := metricValue(t, tn, series); v != want {
			t.Errorf("%s = %v, want %v", series, v, want)
		}
	}
}

// TestEnvoyHealthAndReflection: grpc.health.v1 follows the node's
// readiness (SERVING, then NOT_SERVING when it is not ready), and server
// reflection lists the rate limit service.
func TestEnvoyHealthAndReflection(t *testing.T) {
	e := server(t, t.TempDir())
	tn := startNode(t, e, mesh.NodeConfig{})
	var ready atomic.Bool
	ready.Store(true)
	b := startBridge(t, e, tn, nil, ready.Load)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	health := healthpb.NewHealthClient(b.conn)
	check := func(service string) healthpb.HealthCheckResponse_ServingStatus {
		r, err := health.Check(ctx, &healthpb.HealthCheckRequest{Service: service})
		if err != nil {
			t.Fatalf("health check %q: %v", service, err)
		}
		return r.Status
	}
	for _, svc := range []string{"", envoy.ServiceName} {
		if st := check(svc); st != healthpb.HealthCheckResponse_SERVING {
			t.Fatalf("health of %q: %v, want SERVING", svc, st)
		}
	}
	ready.Store(false)
	waitFor(t, "NOT_SERVING", func() bool { return check(envoy.ServiceName) == healthpb.HealthCheckResponse_NOT_SERVING })

	stream, err := reflectionpb.NewServerReflectionClient(b.conn).ServerReflectionInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&reflectionpb.ServerReflectionRequest{
		MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{}}); err != nil {
		t.Fatal(err)
	}
	r, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, s := range r.GetListServicesResponse().GetService() {
		names = append(names, s.Name)
	}
	if !strings.Contains(strings.Join(names, " "), envoy.ServiceName) {
		t.Fatalf("reflection lists %v, not %s", names, envoy.ServiceName)
	}
}

// TestEnvoySecured: in a secured deployment a bridge on the node's
// credentials (the limiter account, as `serve --auth` runs it) is trusted
// with the descriptor's tenant entry; a bridge on a tenant's credentials
// has its calls bound to that tenant: an entry naming another tenant is
// refused (the service's 403), and a call without one spends the tenant's
// own key.
func TestEnvoySecured(t *testing.T) {
	s := startSecured(t)
	nodeConn := s.dial(t, s.d.NodeCreds(), nil)
	n := startNodeOn(t, nodeConn, mesh.NodeConfig{Binder: binder(t, s, nodeConn)})
	admin := s.dial(t, s.d.AdminCreds(), nil)
	rev := putPolicy(t, admin, "rl_policies", "per-tenant",
		`{"match":{"tenant":"*"},"key":["tenant"],"limits":[{"algorithm":"token_bucket","rate":"1/d","burst":2}]}`)
	waitFor(t, "the policy on the node", func() bool { r, ok := policyRevision(n, "per-tenant"); return ok && r >= rev })

	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	bridgeOn := func(creds string) *envoy.Server {
		srv, err := envoy.New(envoy.Config{Conn: s.dial(t, creds, nil), Policy: n.Policy})
		if err != nil {
			t.Fatal(err)
		}
		return srv
	}
	call := func(srv *envoy.Server, kv ...string) string {
		t.Helper()
		resp, err := srv.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "edge", Descriptors: []*ratelimitv3.RateLimitDescriptor{rlDesc(kv...)}})
		if err != nil {
			t.Fatalf("ShouldRateLimit %v: %v", kv, err)
		}
		return statusString(resp.Statuses[0])
	}
	trusted, acme := bridgeOn(s.d.NodeCreds()), bridgeOn(s.d.TenantCreds("acme"))
	for _, step := range []struct {
		srv  *envoy.Server
		kv   []string
		want string
	}{
		{trusted, []string{"tenant", "acme"}, "OK 1/DAY remaining 1 reset"},
		{acme, []string{"tenant", "birch"}, "OVER_LIMIT"},
		{acme, []string{"generic_key", "a"}, "OK 1/DAY remaining 0 reset"},
		{trusted, []string{"tenant", "birch"}, "OK 1/DAY remaining 1 reset"},
	} {
		if got := call(step.srv, step.kv...); got != step.want {
			t.Errorf("%v: %s, want %s", step.kv, got, step.want)
		}
	}
}
