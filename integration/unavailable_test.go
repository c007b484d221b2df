package integration

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/limitmesh/limitmesh/mesh"
	"github.com/nats-io/nats.go/jetstream"
)

// TestStoreUnavailable: when the state store cannot be used the node
// answers 503 "unavailable" with a structured body instead of hanging or
// crashing, and counts the errors.
func TestStoreUnavailable(t *testing.T) {
	_, tn, _ := single(t)
	js, _ := jetstream.New(tn.nc)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	if err := js.DeleteStream(ctx, "KV_rl_state"); err != nil {
		t.Fatal(err)
	}
	r := decide(t, tn.nc, "rl.v1.decide", req(map[string]string{"tenant": "gone"}, ""))
	if r.Code != "503" || r.Error != "unavailable" || r.Msg == "" {
		t.Fatalf("with the state stream gone: %+v, want 503 unavailable", r)
	}
	if v := metricValue(t, tn, `limitmesh_decisions_total{policy="slow",result="error"}`); v != 1 {
		t.Fatalf("error metric = %v", v)
	}
}

// TestMetricsNoDescriptorValues: labels carry policy names and fixed words,
// never descriptor values.
func TestMetricsNoDescriptorValues(t *testing.T) {
	_, tn, _ := single(t)
	decide(t, tn.nc, "rl.v1.decide", req(map[string]string{"tenant": "zq-secret-tenant"}, ""))
	decide(t, tn.nc, "rl.v1.decide", `{"descriptor":{"nomatch":"zq-other-value"}}`)
	for _, l := range metric(t, tn, "limitmesh_") {
		if strings.Contains(l, "zq-") {
			t.Fatalf("descriptor value in metrics: %s", l)
		}
	}
	for _, name := range []string{"limitmesh_decision_duration_seconds_count", "limitmesh_cas_conflicts_total", "limitmesh_cas_retries_total"} {
		if len(metric(t, tn, name)) == 0 {
			t.Errorf("metric %s missing", name)
		}
	}
	info := fmt.Sprintf(`limitmesh_node_info{node=%q,roles="decide,ledger,shadow",version=%q}`, tn.id, mesh.Version)
	if v := metricValue(t, tn, info); v != 1 {
		t.Errorf("%s = %v, want 1", info, v)
	}
}
