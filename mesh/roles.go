package mesh

import (
	"fmt"
	"strings"
)

// Roles is the set of roles a node plays (CONTRACT.md §13), a bit set of
// RoleDecide, RoleLedger and RoleShadow. The zero value, in NodeConfig,
// means every role.
//
//   - RoleDecide: the node serves decisions (the micro service's decide and
//     lease endpoints, the partition subjects) and owns partitions (it
//     campaigns for leases in the shards bucket).
//   - RoleLedger: the node may run the usage ledger's reconciler (one node
//     of those with the role runs it at a time).
//   - RoleShadow: the node may run the shadow evaluator (likewise).
//
// A node without RoleDecide owns no partition and takes no request; its
// usage publisher, the buckets and the usage stream are set up as on any
// other node.
type Roles uint8

// The roles; AllRoles is every one of them, a node's default.
const (
	RoleDecide Roles = 1 << iota
	RoleLedger
	RoleShadow

	AllRoles = RoleDecide | RoleLedger | RoleShadow
)

// roleNames are the roles' names, in the order String lists them.
var roleNames = []struct {
	role Roles
	name string
}{{RoleDecide, "decide"}, {RoleLedger, "ledger"}, {RoleShadow, "shadow"}}

// ParseRoles parses a comma-separated list of role names ("decide",
// "ledger", "shadow"; spaces around a name and repeated names are
// allowed). An unknown name, or a list that names no role, is an error
// wrapping [ErrConfig].
func ParseRoles(s string) (Roles, error) {
	var r Roles
	for _, name := range strings.Split(s, ",") {
		name = strings.TrimSpace(name)
		if name == "" {
			continue
		}
		role := roleNamed(name)
		if role == 0 {
			return 0, fmt.Errorf("%w: unknown role %q (the roles are decide, ledger and shadow)", ErrConfig, name)
		}
		r |= role
	}
	if r == 0 {
		return 0, fmt.Errorf("%w: no role named (the roles are decide, ledger and shadow)", ErrConfig)
	}
	return r, nil
}

func roleNamed(name string) Roles {
	for _, rn := range roleNames {
		if rn.name == name {
			return rn.role
		}
	}
	return 0
}

// Has reports whether r includes every role of o.
func (r Roles) Has(o Roles) bool { return r&o == o }

// String lists the roles of r, comma-separated, in the order decide,
// ledger, shadow ("" for none): the form ParseRoles reads, and the value
// of the roles label of limitmesh_node_info and of the micro service's
// metadata.
func (r Roles) String() string {
	var names []string
	for _, rn := range roleNames {
		if r.Has(rn.role) {
			names = append(names, rn.name)
		}
	}
	return strings.Join(names, ",")
}
