package shadow

import (
	"testing"

	"github.com/limitmesh/limitmesh/policies"
	"github.com/limitmesh/limitmesh/usage"
)

// t0 is the start of the test timelines: a realistic instant in Unix
// microseconds, aligned to a whole minute.
const t0 = int64(1_764_752_400_000_000)

const unit = int64(1_000_000) // micro-units in one unit

// policyT is the policy type (short for the tests).
type policyT = policies.Policy

// mustPolicy parses doc as policy name at revision rev.
func mustPolicy(t testing.TB, name string, rev uint64, doc string) *policies.Policy {
	t.Helper()
	p, err := policies.Parse(name, []byte(doc))
	if err != nil {
		t.Fatalf("parse %s: %v", name, err)
	}
	p.Revision = rev
	return p
}

// desc builds a sorted descriptor from name, value pairs.
func desc(t testing.TB, kv ...string) policies.Descriptor {
	t.Helper()
	dims := make([]policies.Dim, 0, len(kv)/2)
	for i := 0; i+1 < len(kv); i += 2 {
		dims = append(dims, policies.Dim{Name: kv[i], Value: kv[i+1]})
	}
	d, err := policies.NewDescriptor(dims)
	if err != nil {
		t.Fatalf("descriptor %v: %v", kv, err)
	}
	return d
}

// rec builds a record at t0+atUs of cost units with the live result.
func rec(d policies.Descriptor, atUs, cost int64, allowed bool) usage.Record {
	return usage.Record{TimeUs: t0 + atUs, Descriptor: d, Cost: cost * unit, Allowed: allowed}
}
