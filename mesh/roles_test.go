package mesh

import (
	"errors"
	"testing"

	"github.com/nats-io/nats.go"
)

// TestParseRoles: a comma-separated list of decide, ledger and shadow, in
// any order, spaces and repeats allowed, prints back in the canonical
// order; an unknown name or a list naming no role is an ErrConfig.
func TestParseRoles(t *testing.T) {
	cases := []struct {
		in   string
		want Roles
		str  string
	}{
		{"decide,ledger,shadow", AllRoles, "decide,ledger,shadow"},
		{"shadow,decide,ledger", AllRoles, "decide,ledger,shadow"},
		{"decide", RoleDecide, "decide"},
		{"ledger,shadow", RoleLedger | RoleShadow, "ledger,shadow"},
		{" shadow , ledger ", RoleLedger | RoleShadow, "ledger,shadow"},
		{"decide,decide", RoleDecide, "decide"},
		{"ledger,", RoleLedger, "ledger"},
	}
	for _, tc := range cases {
		got, err := ParseRoles(tc.in)
		if err != nil || got != tc.want || got.String() != tc.str {
			t.Errorf("ParseRoles(%q) = %v (%q), %v; want %v (%q)", tc.in, got, got.String(), err, tc.want, tc.str)
		}
	}
	for _, bad := range []string{"", ",", " , ", "decide,ledgr", "Decide", "all", "decide;shadow"} {
		if r, err := ParseRoles(bad); !errors.Is(err, ErrConfig) {
			t.Errorf("ParseRoles(%q) = %v, %v; want an ErrConfig", bad, r, err)
		}
	}
	if AllRoles.String() != "decide,ledger,shadow" || Roles(0).String() != "" {
		t.Errorf("AllRoles %q, none %q", AllRoles.String(), Roles(0).String())
	}
	if !AllRoles.Has(RoleLedger|RoleShadow) || RoleLedger.Has(RoleLedger|RoleShadow) {
		t.Error("Has: want every role of its argument")
	}
}

// TestNewNodeRoles: NodeConfig.Roles defaults to every role; a bit beyond
// AllRoles, or a node that neither decides nor has the usage stream to
// read, is an ErrConfig.
func TestNewNodeRoles(t *testing.T) {
	nc := &nats.Conn{} // NewNode only keeps it
	n, err := NewNode(nc, NodeConfig{})
	if err != nil || n.cfg.Roles != AllRoles {
		t.Fatalf("zero Roles: %v, %v; want every role", n, err)
	}
	n, err = NewNode(nc, NodeConfig{Roles: RoleDecide, NoUsage: true})
	if err != nil || n.cfg.Roles != RoleDecide {
		t.Fatalf("decide without usage: %v, %v", n, err)
	}
	for _, cfg := range []NodeConfig{
		{Roles: AllRoles + 1},
		{Roles: RoleLedger | RoleShadow, NoUsage: true},
		{Roles: RoleShadow, NoUsage: true},
	} {
		if _, err := NewNode(nc, cfg); !errors.Is(err, ErrConfig) {
			t.Errorf("roles %q (%#x), NoUsage %v: %v, want an ErrConfig", cfg.Roles, uint8(cfg.Roles), cfg.NoUsage, err)
		}
	}
}
