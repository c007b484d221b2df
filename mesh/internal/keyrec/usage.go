package keyrec

import (
	"encoding/binary"
	"fmt"

	"github.com/limitmesh/limitmesh/policies"
)

// Usage is one admission a key record write carries: what its usage record
// (CONTRACT §6) needs beyond the key and its policy, which the record
// names. The state journal stores the usage of every admission with the
// record that spends it, so a node that adopts the journal can publish
// what its writer could not (docs/protocol.md, "Usage from the journal").
type Usage struct {
	At        int64  // ns (Unix) of the decision, at its serialization point
	Revision  uint64 // policy revision that decided it
	Cost      int64  // micro-units
	Desc      policies.Descriptor
	RequestID string
}

// maxUsage bounds the usage entries of one encoded block.
const maxUsage = 1 << 20

// AppendUsage appends the encoding of us to dst:
//
//	uvarint n, n × (varint at, uvarint revision, varint cost,
//	  uvarint len request_id, request_id, uvarint dims,
//	  dims × (uvarint len name, name, uvarint len value, value))
func AppendUsage(dst []byte, us []Usage) []byte {
	dst = binary.AppendUvarint(dst, uint64(len(us)))
	for i := range us {
		u := &us[i]
		dst = binary.AppendVarint(dst, u.At)
		dst = binary.AppendUvarint(dst, u.Revision)
		dst = binary.AppendVarint(dst, u.Cost)
		dst = binary.AppendUvarint(dst, uint64(len(u.RequestID)))
		dst = append(dst, u.RequestID...)
		dst = binary.AppendUvarint(dst, uint64(len(u.Desc)))
		for _, d := range u.Desc {
			dst = binary.AppendUvarint(dst, uint64(len(d.Name)))
			dst = append(dst, d.Name...)
			dst = binary.AppendUvarint(dst, uint64(len(d.Value)))
			dst = append(dst, d.Value...)
		}
	}
	return dst
}

// DecodeUsage decodes a block of AppendUsage. Descriptors are validated as
// a decide request's are; errors wrap ErrCorrupt. It never panics.
func DecodeUsage(b []byte) ([]Usage, error) {
	r := reader{b: b}
	n := r.uvarint("usage count")
	// Every entry takes at least five bytes: bound n before allocating.
	if r.err == nil && (n > maxUsage || n > uint64(len(r.b))/5) {
		return nil, fmt.Errorf("%w: %d usage entries in %d bytes", ErrCorrupt, n, len(r.b))
	}
	var us []Usage
	if n > 0 {
		us = make([]Usage, 0, n)
	}
	for i := uint64(0); i < n && r.err == nil; i++ {
		var u Usage
		u.At = r.varint("usage at")
		u.Revision = r.uvarint("usage revision")
		u.Cost = r.varint("usage cost")
		u.RequestID = string(r.bytes(r.uvarint("request_id length"), "request_id"))
		nd := r.uvarint("dimensions")
		if r.err == nil && nd > policies.MaxDims {
			r.fail("too many dimensions")
		}
		if r.err != nil {
			break // nd is unchecked: allocate nothing by it
		}
		dims := make([]policies.Dim, 0, nd)
		for j := uint64(0); j < nd && r.err == nil; j++ {
			name := string(r.bytes(r.uvarint("dimension name length"), "dimension name"))
			value := string(r.bytes(r.uvarint("dimension value length"), "dimension value"))
			dims = append(dims, policies.Dim{Name: name, Value: value})
		}
		if r.err != nil {
			break
		}
		d, err := policies.NewDescriptor(dims)
		if err != nil {
			return nil, fmt.Errorf("%w: usage descriptor: %v", ErrCorrupt, err)
		}
		if u.Cost <= 0 {
			return nil, fmt.Errorf("%w: usage cost %d", ErrCorrupt, u.Cost)
		}
		u.Desc = d
		us = append(us, u)
	}
	if r.err == nil && len(r.b) != 0 {
		r.fail("trailing bytes after the usage")
	}
	if r.err != nil {
		return nil, r.err
	}
	return us, nil
}
