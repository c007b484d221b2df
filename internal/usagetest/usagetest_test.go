package usagetest

import (
	"reflect"
	"testing"

	"github.com/limitmesh/limitmesh/policies"
	"github.com/limitmesh/limitmesh/usage"
)

// TestAppendBatchDecodes: what AppendBatch writes, the usage stream's
// decoder reads back as the same batch, escapes and all.
func TestAppendBatchDecodes(t *testing.T) {
	d, err := policies.NewDescriptor([]policies.Dim{{Name: "tenant", Value: "acme <&> \"q\""}})
	if err != nil {
		t.Fatal(err)
	}
	b := usage.Batch{Node: "n1", Policy: "per-tenant", Records: []usage.Record{
		{ID: "n1.7.1", TimeUs: 1764752400123456, Revision: 3, Key: "p.per-tenant.tenant=acme", Descriptor: d, Cost: 2_500_000, Allowed: true, RequestID: "r1"},
		{ID: "n1.7.2", TimeUs: 1764752400123500, Revision: 3, Key: "p.per-tenant.tenant=acme", Descriptor: d, Cost: 1, Allowed: false},
	}}
	back, err := usage.DecodeBatch(AppendBatch(nil, &b))
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back, b) {
		t.Fatalf("decoded %+v\nwant %+v", back, b)
	}
}
