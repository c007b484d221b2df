// Package usagetest writes usage stream messages for tests that feed a
// stream by hand (shadow evaluations, usage reports) instead of running
// nodes that decide.
//
// Only _test.go files import it.
package usagetest

import (
	"encoding/json"

	"github.com/limitmesh/limitmesh/usage"
)

// AppendBatch appends b's records as one v1.1 usage message (CONTRACT.md
// §6: {"node", "policy", "records": [...]}, each record as
// [usage.AppendRecord] writes it) to dst. b.Groups are not written. A
// batch of valid records decodes back equal with [usage.DecodeBatch].
func AppendBatch(dst []byte, b *usage.Batch) []byte {
	dst = append(dst, `{"node":`...)
	dst = appendJSON(dst, b.Node)
	dst = append(dst, `,"policy":`...)
	dst = appendJSON(dst, b.Policy)
	dst = append(dst, `,"records":[`...)
	for i := range b.Records {
		if i > 0 {
			dst = append(dst, ',')
		}
		dst = usage.AppendRecord(dst, &b.Records[i])
	}
	return append(dst, "]}"...)
}

// appendJSON appends s as a JSON string (invalid UTF-8 as U+FFFD).
func appendJSON(dst []byte, s string) []byte {
	b, _ := json.Marshal(s) // a string always encodes
	return append(dst, b...)
}
