package shadow

import "github.com/limitmesh/limitmesh/policies"

// usageRecord mirrors usage.Record until the usage package is merged.
type usageRecord struct {
	ID         string
	TimeUs     int64
	Revision   uint64
	Key        string
	Descriptor policies.Descriptor
	Cost       int64
	Allowed    bool
	RequestID  string
}
