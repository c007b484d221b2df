package integration

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/mesh"
	"github.com/limitmesh/limitmesh/mesh/client"
	"github.com/nats-io/nats.go"
)

// TestSecuredTenantBinding: in a secured deployment the node takes the
// caller's tenant from its account (CONTRACT §9): a descriptor naming
// another tenant is refused with 403 forbidden; one without a tenant gets
// the caller's (and spends the caller's key, not a shared one); a tenant's
// reply carries no partition hint (it may not use shard subjects), so the
// Go SDK with its default hints works; the admin (the limiter account) is
// trusted as an operator. Two nodes, so requests are forwarded: the
// owner binds them again from the forwarded header.
func TestSecuredTenantBinding(t *testing.T) {
	s := startSecured(t)
	for i := range 2 {
		node := s.dial(t, s.d.NodeCreds(), nil)
		startNodeOn(t, node, mesh.NodeConfig{NodeID: fmt.Sprintf("n%d", i), LeaseTime: ownershipLease, Binder: binder(t, s, node)})
	}
	admin := s.dial(t, s.d.AdminCreds(), nil)
	doc := `{"match":{"tenant":"*"},"key":["tenant"],"limits":[{"name":"rate","algorithm":"token_bucket","rate":"1/h","burst":3}]}`
	putPolicy(t, admin, "rl_policies", "per-tenant", doc)
	acme := s.dial(t, s.d.TenantCreds("acme"), nil)
	birch := s.dial(t, s.d.TenantCreds("birch"), nil)
	waitFor(t, "the policy on the nodes", func() bool {
		return decide(t, acme, "rl.v1.decide", req(map[string]string{"tenant": "acme"}, `"dry_run":true`)).Policy == "per-tenant"
	})

	// Forgery: acme naming birch.
	for range 5 {
		r := decide(t, acme, "rl.v1.decide", req(map[string]string{"tenant": "birch"}, ""))
		if r.Code != "403" || r.Error != "forbidden" {
			t.Fatalf("acme spending birch's quota: %+v, want 403 forbidden", r)
		}
	}
	// Birch's quota is untouched.
	admitted := 0
	for range 4 {
		r := decide(t, birch, "rl.v1.decide", req(map[string]string{"tenant": "birch"}, ""))
		if r.Code != "" {
			t.Fatalf("birch: %+v", r)
		}
		if r.Allowed {
			admitted++
		}
	}
	if admitted != 3 {
		t.Fatalf("birch admitted %d of its burst 3 after acme's forgeries", admitted)
	}

	// No tenant: the caller's, with no hint in the reply.
	m, err := acme.Request("rl.v1.decide", []byte(`{"descriptor":{"op":"x"}}`), testTimeout)
	if err != nil {
		t.Fatal(err)
	}
	var raw map[string]any
	if err := json.Unmarshal(m.Data, &raw); err != nil {
		t.Fatalf("reply %q: %v", m.Data, err)
	}
	if raw["policy"] != "per-tenant" || raw["allowed"] != true {
		t.Fatalf("acme without a tenant: %s, want decided by per-tenant", m.Data)
	}
	if _, ok := raw["partition"]; ok {
		t.Fatalf("a tenant's reply carries a partition hint: %s", m.Data)
	}
	// That spent acme's key: two left of three.
	for i, want := range []bool{true, true, false} {
		if r := decide(t, acme, "rl.v1.decide", req(map[string]string{"tenant": "acme"}, "")); r.Allowed != want || r.Code != "" {
			t.Fatalf("acme decision %d: %+v, want allowed=%v", i, r, want)
		}
	}

	// The SDK with its default hints: every reply lacks the hint, so it
	// never tries a shard subject (which would time out).
	c, err := client.New(birch, client.Timeout(2*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	for i := range 3 {
		if r, err := c.Decide(ctx, map[string]string{"op": "y"}, 1, client.DryRun()); err != nil || r.Policy != "per-tenant" {
			t.Fatalf("SDK decision %d for birch: %+v, %v", i, r, err)
		}
	}

	// The admin is trusted: it names any tenant (here acme, exhausted).
	if r := decide(t, admin, "rl.v1.decide", req(map[string]string{"tenant": "acme"}, "")); r.Code != "" || r.Allowed {
		t.Fatalf("admin deciding for acme: %+v, want a denial (acme's burst is spent)", r)
	}
	_ = nats.ErrTimeout
}
