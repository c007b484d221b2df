package keyrec

import (
	"encoding/binary"
	"fmt"
	"unicode"
	"unicode/utf8"

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
	Cost      int64  // micro-units, > 0; >= 0 when Reservation is set
	Desc      policies.Descriptor
	RequestID string
	// Reservation is the id of the reservation whose end this usage is
	// (CONTRACT §10: Cost is then the settled units, 0 for a release); ""
	// for an ordinary admission. At most 128 bytes of printable UTF-8.
	Reservation string
}

// maxUsage bounds the usage entries of one encoded block.
const maxUsage = 1 << 20

// maxUsageReservation is the most bytes of a Usage's Reservation (a
// reservation id, CONTRACT §10).
const maxUsageReservation = 128

// usageForm2 is the second byte of a usage block of form 2, after a 0
// byte (a block of form 1 that starts with 0 is that byte alone).
const usageForm2 = 2

// AppendUsage appends the encoding of us to dst: a usage block of form 1
// when no entry has a Reservation (the only form before reservations, so
// a journal that has none stays byte for byte what it was), else of
// form 2:
//
//	form 1: uvarint n, n × entry
//	form 2: 0x00 0x02 uvarint n, n × (entry, uvarint len reservation, reservation)
//	entry:  varint at, uvarint revision, varint cost,
//	        uvarint len request_id, request_id, uvarint dims,
//	        dims × (uvarint len name, name, uvarint len value, value)
//
// A block of form 1 holding no entry is the single byte 0, so the forms
// never read alike; a decoder that knows only form 1 refuses a block of
// form 2 (trailing bytes after an empty block).
func AppendUsage(dst []byte, us []Usage) []byte {
	form2 := false
	for i := range us {
		if us[i].Reservation != "" {
			form2 = true
			break
		}
	}
	if form2 {
		dst = append(dst, 0, usageForm2)
	}
	dst = binary.AppendUvarint(dst, uint64(len(us)))
	for i := range us {
		u := &us[i]
		dst = binary.AppendVarint(dst, u.At)
		dst = binary.AppendUvarint(dst, u.Revision)
		dst = binary.AppendVarint(dst, u.Cost)
		dst = binary.AppendUvarint(dst, uint64(len(u.RequestID)))
		dst = append(dst, u.RequestID...)
		dst = appendDims(dst, u.Desc)
		if form2 {
			dst = binary.AppendUvarint(dst, uint64(len(u.Reservation)))
			dst = append(dst, u.Reservation...)
		}
	}
	return dst
}

// DecodeUsage decodes a block of AppendUsage, of either form.
// Descriptors are validated as a decide request's are, a reservation as
// the usage stream's decoder checks a record's (at most 128 bytes of
// printable UTF-8: a record it refuses would cost its whole batch), and a
// cost is > 0, or >= 0 with a reservation; errors wrap ErrCorrupt. It
// never panics.
func DecodeUsage(b []byte) ([]Usage, error) {
	form2 := false
	if len(b) > 1 && b[0] == 0 {
		if b[1] != usageForm2 {
			return nil, fmt.Errorf("%w: usage block of form %d", ErrCorrupt, b[1])
		}
		form2, b = true, b[2:]
	}
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
		dims := r.dims()
		if r.err != nil {
			break
		}
		if form2 {
			u.Reservation = string(r.bytes(r.uvarint("reservation length"), "reservation"))
			if r.err != nil {
				break
			}
		}
		d, err := policies.NewDescriptor(dims)
		if err != nil {
			return nil, fmt.Errorf("%w: usage descriptor: %v", ErrCorrupt, err)
		}
		if u.Cost < 0 || u.Cost == 0 && u.Reservation == "" {
			return nil, fmt.Errorf("%w: usage cost %d", ErrCorrupt, u.Cost)
		}
		if reason := reservationProblem(u.Reservation); reason != "" {
			return nil, fmt.Errorf("%w: usage reservation %q %s", ErrCorrupt, u.Reservation, reason)
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

// reservationProblem returns why s cannot be a usage record's reservation
// (more than 128 bytes, invalid UTF-8, a control character), or "" ("" is
// none).
func reservationProblem(s string) string {
	if len(s) > maxUsageReservation {
		return fmt.Sprintf("is %d bytes (at most %d)", len(s), maxUsageReservation)
	}
	for i := 0; i < len(s); {
		c, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case c == utf8.RuneError && size == 1:
			return "is not valid UTF-8"
		case unicode.IsControl(c):
			return "has a control character"
		}
		i += size
	}
	return ""
}

// appendDims appends a descriptor's dimensions: uvarint n, n × (uvarint
// len name, name, uvarint len value, value).
func appendDims(dst []byte, d policies.Descriptor) []byte {
	dst = binary.AppendUvarint(dst, uint64(len(d)))
	for _, x := range d {
		dst = binary.AppendUvarint(dst, uint64(len(x.Name)))
		dst = append(dst, x.Name...)
		dst = binary.AppendUvarint(dst, uint64(len(x.Value)))
		dst = append(dst, x.Value...)
	}
	return dst
}

// dims reads what appendDims wrote (at most policies.MaxDims; the caller
// makes a Descriptor of them, which validates them).
func (r *reader) dims() []policies.Dim {
	n := r.uvarint("dimensions")
	if r.err == nil && n > policies.MaxDims {
		r.fail("too many dimensions")
	}
	if r.err != nil {
		return nil // n is unchecked: allocate nothing by it
	}
	dims := make([]policies.Dim, 0, n)
	for j := uint64(0); j < n && r.err == nil; j++ {
		name := string(r.bytes(r.uvarint("dimension name length"), "dimension name"))
		value := string(r.bytes(r.uvarint("dimension value length"), "dimension value"))
		dims = append(dims, policies.Dim{Name: name, Value: value})
	}
	return dims
}
