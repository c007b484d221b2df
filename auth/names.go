package auth

import "fmt"

// TenantNamePattern is the form of a tenant name: the name of its account
// JWT, its creds file (tenants/<name>.creds) and the value the node binds to
// the descriptor's `tenant` dimension.
const TenantNamePattern = `[a-z0-9][a-z0-9_-]{0,63}`

// Account names of a deployment's own accounts (the names in their JWTs).
// Tenant names are lower case, so neither can be a tenant's.
const (
	// LimiterAccountName is the account of the nodes, their buckets and
	// streams, the operators' admin user, and the decide service's export.
	LimiterAccountName = "LIMITER"
	// SystemAccountName is the NATS system account (resolver, account
	// updates).
	SystemAccountName = "SYS"
)

// ValidTenantName reports whether name matches [TenantNamePattern].
func ValidTenantName(name string) bool {
	if len(name) < 1 || len(name) > 64 {
		return false
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		switch {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9':
		case (c == '_' || c == '-') && i > 0:
		default:
			return false
		}
	}
	return true
}

func checkTenantName(name string) error {
	if !ValidTenantName(name) {
		return fmt.Errorf("%w: %q does not match %s", ErrInvalidName, name, TenantNamePattern)
	}
	return nil
}

// validPrefix reports whether p is a subject prefix the command accepts
// ([a-z][a-z0-9_-]{0,31}, as `limitmesh serve --prefix`).
func validPrefix(p string) bool {
	if len(p) < 1 || len(p) > 32 || p[0] < 'a' || p[0] > 'z' {
		return false
	}
	for i := 1; i < len(p); i++ {
		c := p[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}

// DecideSubject is the decide service's subject for a subject prefix:
// "rl" -> "rl.v1.decide" (CONTRACT.md §1).
func DecideSubject(prefix string) string { return prefix + ".v1.decide" }

// ServiceEndpoints are the endpoints of the limitmesh micro service a
// tenant calls: decide (CONTRACT.md §2) and the reservation endpoints
// (§10). Each is exported by the limiter account and imported by every
// tenant account.
var ServiceEndpoints = []string{"decide", "reserve", "settle", "release", "renew"}

// ServiceSubject is endpoint's subject for a subject prefix: "rl",
// "reserve" -> "rl.v1.reserve".
func ServiceSubject(prefix, endpoint string) string { return prefix + ".v1." + endpoint }
