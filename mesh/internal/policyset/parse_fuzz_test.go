package policyset

import (
	"errors"
	"testing"

	"github.com/limitmesh/limitmesh/policies"
)

// FuzzParse: a policy entry (name and value from the policy bucket) never
// panics the node's parser; it is refused with an error matching
// policies.ErrInvalid, or parsed to a policy of a mode this node
// implements, carrying the entry's revision, whose document parses again
// to the same policy.
func FuzzParse(f *testing.F) {
	f.Add("acme-search", []byte(`{"match": {"tenant": "acme", "operation": "search"}, "key": ["tenant", "operation", "plan"],
 "limits": [{"name": "rate", "algorithm": "token_bucket", "rate": "10/s", "burst": 40}], "max_keys": 1000, "description": "x"}`), uint64(3))
	f.Add("p", []byte(`{"match":{},"limits":[{"algorithm":"quota","limit":"20000000","period":"month"}],"mode":"async"}`), uint64(1))
	f.Add("p", []byte(`{"match":{"tenant":"*"},"limits":[{"algorithm":"gcra","rate":"1/s","burst":1}],"mode":"leased"}`), uint64(1))
	f.Add("Bad.Name", []byte(`{}`), uint64(0))
	f.Fuzz(func(t *testing.T, name string, value []byte, rev uint64) {
		p, err := Parse(name, value, rev)
		if err != nil {
			if !errors.Is(err, policies.ErrInvalid) {
				t.Fatalf("error %v does not match policies.ErrInvalid", err)
			}
			return
		}
		switch p.Mode {
		case policies.ModeStrict, policies.ModeAsync, policies.ModeLocal, policies.ModeLeased:
		default:
			t.Fatalf("accepted mode %v", p.Mode)
		}
		if p.Revision != rev || p.Name != name || p.MaxKeys < 1 {
			t.Fatalf("parsed %q@%d: name %q, revision %d, max_keys %d", name, rev, p.Name, p.Revision, p.MaxKeys)
		}
		doc, err := p.MarshalJSON()
		if err != nil {
			t.Fatalf("MarshalJSON: %v", err)
		}
		q, err := Parse(name, doc, rev)
		if err != nil {
			t.Fatalf("its document %s does not parse: %v", doc, err)
		}
		if q.MaxKeys != p.MaxKeys || q.Mode != p.Mode || len(q.Limits) != len(p.Limits) {
			t.Fatalf("document %s parses to another policy", doc)
		}
	})
}
