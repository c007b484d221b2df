// Package envoy_test checks deploy/envoy: envoy.yaml is a valid Envoy v3
// bootstrap (strict protojson into the go-control-plane types, with the
// typed configs it names registered, then their validation rules), and its
// rate limit filters and actions send the descriptors the envoyproxy/
// ratelimit configurations in ratelimit/ (and so the policies in
// policies/) are about. The policies themselves are checked by cli's
// TestImportEnvoyDeployExample.
package envoy_test

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	ratelimitfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ratelimit/v3"
	routerv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	httpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"sigs.k8s.io/yaml"
)

// The typed configs envoy.yaml names; importing their packages registers
// them for protojson's Any resolution.
var (
	_ = &routerv3.Router{}
	_ = &httpv3.HttpProtocolOptions{}
)

// LimitmeshPort is the port of the limitmesh cluster: the nodes'
// --envoy-listen (deploy/kubernetes checks its manifests against it).
const limitmeshPort = 8081

func loadBootstrap(t *testing.T) *bootstrapv3.Bootstrap {
	t.Helper()
	y, err := os.ReadFile("envoy.yaml")
	if err != nil {
		t.Fatal(err)
	}
	j, err := yaml.YAMLToJSON(y)
	if err != nil {
		t.Fatal(err)
	}
	var b bootstrapv3.Bootstrap
	if err := (protojson.UnmarshalOptions{}).Unmarshal(j, &b); err != nil {
		t.Fatalf("envoy.yaml is not a v3 bootstrap: %v", err)
	}
	if err := b.ValidateAll(); err != nil {
		t.Fatalf("envoy.yaml breaks a validation rule: %v", err)
	}
	return &b
}

// ratelimitConfig is the part of an envoyproxy/ratelimit file this test
// needs: the key sequences of its descriptor paths.
type ratelimitConfig struct {
	Domain      string       `json:"domain"`
	Descriptors []descriptor `json:"descriptors"`
}

type descriptor struct {
	Key         string       `json:"key"`
	Descriptors []descriptor `json:"descriptors"`
}

func keyPaths(ds []descriptor, prefix string, out map[string]bool) {
	for _, d := range ds {
		p := prefix + d.Key
		out[p] = true
		keyPaths(d.Descriptors, p+",", out)
	}
}

func TestEnvoyConfig(t *testing.T) {
	b := loadBootstrap(t)
	if got := b.GetNode().GetCluster(); got != "proxy" {
		t.Errorf("node.cluster %q: the source_cluster action must send proxy (ratelimit/rl.yaml)", got)
	}

	// The ratelimit configurations: domain -> key sequences.
	files, _ := filepath.Glob("ratelimit/*.yaml")
	paths := map[string]map[string]bool{}
	for _, f := range files {
		y, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var c ratelimitConfig
		if err := yaml.Unmarshal(y, &c); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		paths[c.Domain] = map[string]bool{}
		keyPaths(c.Descriptors, "", paths[c.Domain])
	}

	// The limitmesh cluster: HTTP/2, gRPC health checked, at the nodes'
	// --envoy-listen port.
	var lm *clusterv3.Cluster
	for _, c := range b.GetStaticResources().GetClusters() {
		if c.GetName() == "limitmesh" {
			lm = c
		}
	}
	if lm == nil {
		t.Fatal("no cluster limitmesh")
	}
	var hpo httpv3.HttpProtocolOptions
	if err := lm.GetTypedExtensionProtocolOptions()["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"].UnmarshalTo(&hpo); err != nil {
		t.Fatalf("limitmesh cluster protocol options: %v", err)
	}
	if hpo.GetExplicitHttpConfig().GetHttp2ProtocolOptions() == nil {
		t.Error("the limitmesh cluster must speak HTTP/2 (gRPC)")
	}
	if hc := lm.GetHealthChecks(); len(hc) != 1 || hc[0].GetGrpcHealthCheck().GetServiceName() != "envoy.service.ratelimit.v3.RateLimitService" {
		t.Errorf("limitmesh cluster health checks %v: want the gRPC health of the rate limit service", hc)
	}
	ep := lm.GetLoadAssignment().GetEndpoints()[0].GetLbEndpoints()[0].GetEndpoint().GetAddress().GetSocketAddress()
	if ep.GetAddress() != "limitmesh" || ep.GetPortValue() != limitmeshPort {
		t.Errorf("limitmesh cluster address %s:%d, want limitmesh:%d", ep.GetAddress(), ep.GetPortValue(), limitmeshPort)
	}

	// The ingress listener's filters: one rate limit filter per domain,
	// each on its own stage, all asking the limitmesh cluster over v3,
	// with a timeout; the router last.
	var hcm hcmv3.HttpConnectionManager
	var found bool
	for _, l := range b.GetStaticResources().GetListeners() {
		if l.GetName() == "ingress" {
			if err := l.GetFilterChains()[0].GetFilters()[0].GetTypedConfig().UnmarshalTo(&hcm); err != nil {
				t.Fatal(err)
			}
			found = true
		}
	}
	if !found {
		t.Fatal("no listener ingress")
	}
	stages := map[uint32]string{}
	filters := hcm.GetHttpFilters()
	for i, f := range filters {
		if i == len(filters)-1 {
			if f.GetName() != "envoy.filters.http.router" {
				t.Errorf("last http filter %s, want the router", f.GetName())
			}
			continue
		}
		var rl ratelimitfilterv3.RateLimit
		if err := f.GetTypedConfig().UnmarshalTo(&rl); err != nil {
			t.Fatalf("http filter %d (%s): %v", i, f.GetName(), err)
		}
		svc := rl.GetRateLimitService()
		switch {
		case svc.GetGrpcService().GetEnvoyGrpc().GetClusterName() != "limitmesh":
			t.Errorf("%s: rate limit service cluster %q", rl.GetDomain(), svc.GetGrpcService().GetEnvoyGrpc().GetClusterName())
		case svc.GetTransportApiVersion().String() != "V3":
			t.Errorf("%s: transport_api_version %v", rl.GetDomain(), svc.GetTransportApiVersion())
		case rl.GetTimeout() == nil:
			t.Errorf("%s: no timeout (Envoy's default is 20ms)", rl.GetDomain())
		}
		if d, dup := stages[rl.GetStage()]; dup {
			t.Errorf("domains %s and %s share stage %d", d, rl.GetDomain(), rl.GetStage())
		}
		stages[rl.GetStage()] = rl.GetDomain()
		if paths[rl.GetDomain()] == nil {
			t.Errorf("filter domain %s has no ratelimit/*.yaml", rl.GetDomain())
		}
	}
	for d := range paths {
		if !slices.Contains(mapValues(stages), d) {
			t.Errorf("ratelimit config domain %s has no filter", d)
		}
	}

	// Every rate_limits entry goes to a filter's stage and sends a key
	// sequence its domain's configuration has.
	vh := hcm.GetRouteConfig().GetVirtualHosts()[0]
	check := func(where string, rls []*routev3.RateLimit) {
		for _, r := range rls {
			domain, ok := stages[r.GetStage().GetValue()]
			if !ok {
				t.Errorf("%s: stage %d has no rate limit filter", where, r.GetStage().GetValue())
				continue
			}
			var keys []string
			for _, a := range r.GetActions() {
				keys = append(keys, actionKey(t, a))
			}
			if seq := strings.Join(keys, ","); !paths[domain][seq] {
				t.Errorf("%s: actions send (%s); domain %s configures no such descriptor", where, seq, domain)
			}
		}
	}
	check("virtual host", vh.GetRateLimits())
	for _, r := range vh.GetRoutes() {
		check("route "+r.GetMatch().GetPrefix(), r.GetRoute().GetRateLimits())
	}
}

// actionKey is the descriptor key an Envoy rate limit action sends.
func actionKey(t *testing.T, a *routev3.RateLimit_Action) string {
	switch {
	case a.GetSourceCluster() != nil:
		return "source_cluster"
	case a.GetDestinationCluster() != nil:
		return "destination_cluster"
	case a.GetRemoteAddress() != nil:
		return "remote_address"
	case a.GetRequestHeaders() != nil:
		return a.GetRequestHeaders().GetDescriptorKey()
	case a.GetGenericKey() != nil:
		if k := a.GetGenericKey().GetDescriptorKey(); k != "" {
			return k
		}
		return "generic_key"
	}
	t.Errorf("action %v: not known to this test", a)
	return ""
}

func mapValues(m map[uint32]string) []string {
	var out []string
	for _, v := range m {
		out = append(out, v)
	}
	return out
}
