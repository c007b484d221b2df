package mesh

import (
	"github.com/limitmesh/limitmesh/mesh/internal/policyset"
	"github.com/limitmesh/limitmesh/policies"
)

// ParsePolicy parses and validates a policy document exactly as a node does
// when the entry arrives in the policy bucket: policies.Parse plus this node's
// own rules (the modes it implements). `limitmesh policy validate` uses it so
// that an offline check and a live node never disagree.
func ParsePolicy(name string, doc []byte) (*policies.Policy, error) {
	return policyset.Parse(name, doc, 0)
}
