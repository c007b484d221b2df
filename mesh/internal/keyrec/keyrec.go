// Package keyrec is the record a limit key keeps: the states of its
// policy's limits, the policy version they were written under and the
// request_ids it remembers, with their binary codec (docs/protocol.md, "The
// key record"). A record is one value of the state bucket and one item of a
// state journal batch, so every limit of a key and its dedupe entries change
// together in one write.
//
// keyrec imports kvstate only.
package keyrec

import (
	"crypto/sha256"
	"errors"
)

// ErrCorrupt is returned, wrapped with a description, when a stored record
// cannot be decoded.
var ErrCorrupt = errors.New("mesh: corrupt key record")

// Decision is the outcome of one decide request, as a reply carries it and
// a dedupe entry remembers it. Quantities in micro-units, durations in ns.
type Decision struct {
	Allowed    bool
	Policy     string // the policy that decided; "" when none matched
	Revision   uint64 // its KV revision
	Remaining  int64  // micro-units left in the limit with the least left
	RetryAfter int64  // ns; kvstate.Never when the cost can never be admitted
	ResetAfter int64  // ns
}

// IDHash is the stored form of a request_id: the first 16 bytes of its
// SHA-256, so stored records never hold client text and have fixed-size
// entries.
func IDHash(id string) [16]byte {
	s := sha256.Sum256([]byte(id))
	var h [16]byte
	copy(h[:], s[:16])
	return h
}
