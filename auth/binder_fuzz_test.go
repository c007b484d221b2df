package auth

import (
	"strings"
	"testing"
)

// FuzzCheckTenantAccount: an account's JWT as a claims lookup returns it
// (from the server; in a test, any bytes) never panics the check; a tenant
// it accepts has a tenant name and its account is the JWT's subject,
// signed by the trusted operator.
func FuzzCheckTenantAccount(f *testing.F) {
	fx := newFixture(f, 8)
	acme := fx.account(fx.op, "acme", nil)
	opPub, _ := fx.op.PublicKey()
	good := fx.jwts[acme]
	f.Add(acme, good)
	f.Add(acme, good[:len(good)/2])
	f.Add(fx.limiter, fx.jwts[fx.limiter])
	f.Add(acme, strings.Replace(good, ".", "..", 1))
	f.Add("A", "e30.e30.e30")
	f.Fuzz(func(t *testing.T, acc, text string) {
		tenant, reason := checkTenantAccount(acc, text, []string{opPub})
		switch {
		case reason == "" && tenant == "":
			t.Fatal("neither a tenant nor a reason")
		case reason != "" && tenant != "":
			t.Fatalf("tenant %q and reason %q", tenant, reason)
		case reason == "" && !ValidTenantName(tenant):
			t.Fatalf("accepted tenant %q is not a tenant name", tenant)
		}
	})
}
