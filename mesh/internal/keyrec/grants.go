package keyrec

import (
	"encoding/binary"
	"fmt"
)

// Grants of leased mode (CONTRACT §8, docs/protocol.md "Leased mode"). A
// key of a leased policy keeps, in its record, the grants its owner handed
// out and that are still outstanding, and the sequence their ids come
// from, so a new owner after a failover knows every grant the old one
// made. They are written as an extension section after the dedupe
// entries; a record without grants (and without a grant sequence) has no
// such section and encodes exactly as before.

// MaxGrants caps the grants one Record keeps (the owner never has more
// outstanding: one holder per node, each with a few grants).
const MaxGrants = 256

// MaxHolderBytes bounds a grant's holder id.
const MaxHolderBytes = 128

// sectionGrants is the tag of the grants extension section.
const sectionGrants = 1

// Grant is one grant of a leased key: units debited from the key's
// limiter states when granted, spendable by Holder until Expires.
// Quantities in micro-units, instants in ns (Unix) of the owner's clock.
type Grant struct {
	ID      uint64 // unique per key: the key's GrantSeq when it was granted
	Epoch   uint64 // the owner's ownership epoch of the key's partition then
	Holder  string // who holds it (a node id), 1..MaxHolderBytes bytes
	Units   int64  // granted (> 0)
	Spent   int64  // cumulative spend its holder reported (0..Units)
	At      int64  // when granted
	Expires int64  // At + the policy's lease ttl
}

// appendGrants appends the grants section of r, if r has one.
func appendGrants(dst []byte, r *Record) []byte {
	if r.GrantSeq == 0 && len(r.Grants) == 0 {
		return dst
	}
	var body []byte
	body = binary.AppendUvarint(body, r.GrantSeq)
	body = binary.AppendUvarint(body, uint64(len(r.Grants)))
	for i := range r.Grants {
		g := &r.Grants[i]
		body = binary.AppendUvarint(body, g.ID)
		body = binary.AppendUvarint(body, g.Epoch)
		body = binary.AppendUvarint(body, uint64(len(g.Holder)))
		body = append(body, g.Holder...)
		body = binary.AppendVarint(body, g.Units)
		body = binary.AppendVarint(body, g.Spent)
		body = binary.AppendVarint(body, g.At)
		body = binary.AppendVarint(body, g.Expires)
	}
	dst = append(dst, sectionGrants)
	dst = binary.AppendUvarint(dst, uint64(len(body)))
	return append(dst, body...)
}

// decodeSections decodes the extension sections that follow the dedupe
// entries (what is left in r) into rec. An unknown tag, a section given
// twice or out of order, or an invalid grant or reservation is corrupt:
// dropping grants would let a new owner hand out units that are still
// outstanding, and dropping reservations would forget what it acknowledged.
func decodeSections(r *reader, rec *Record) {
	var last byte
	for r.err == nil && len(r.b) > 0 {
		tag := r.bytes(1, "section tag")
		if r.err != nil {
			return
		}
		if tag[0] <= last || tag[0] > sectionReservations {
			r.fail(fmt.Sprintf("unknown, repeated or misplaced section %d", tag[0]))
			return
		}
		last = tag[0]
		body := r.bytes(r.uvarint("section length"), "section")
		if r.err != nil {
			return
		}
		s := reader{b: body}
		empty := false
		switch tag[0] {
		case sectionGrants:
			decodeGrants(&s, rec)
			empty = rec.GrantSeq == 0 && len(rec.Grants) == 0
		case sectionReservations:
			decodeReservations(&s, rec)
			empty = rec.ResSeq == 0 && len(rec.Reservations) == 0
		}
		if s.err == nil && len(s.b) != 0 {
			s.fail(fmt.Sprintf("trailing bytes in section %d", tag[0]))
		}
		if s.err != nil {
			r.err = s.err
			return
		}
		if empty {
			r.fail(fmt.Sprintf("empty section %d", tag[0])) // never written: one encoding per record
		}
	}
}

func decodeGrants(r *reader, rec *Record) {
	rec.GrantSeq = r.uvarint("grant sequence")
	n := r.uvarint("grant count")
	if r.err != nil {
		return
	}
	if n > MaxGrants {
		r.fail(fmt.Sprintf("%d grants, at most %d", n, MaxGrants))
		return
	}
	if n > 0 {
		rec.Grants = make([]Grant, 0, n)
	}
	for i := uint64(0); i < n && r.err == nil; i++ {
		var g Grant
		g.ID = r.uvarint("grant id")
		g.Epoch = r.uvarint("grant epoch")
		hl := r.uvarint("holder length")
		if hl == 0 || hl > MaxHolderBytes {
			r.fail("holder length")
			return
		}
		g.Holder = string(r.bytes(hl, "holder"))
		g.Units = r.varint("grant units")
		g.Spent = r.varint("grant spent")
		g.At = r.varint("grant at")
		g.Expires = r.varint("grant expiry")
		if r.err != nil {
			return
		}
		if g.ID == 0 || g.ID > rec.GrantSeq || g.Units <= 0 || g.Spent < 0 || g.Spent > g.Units || g.Expires < g.At {
			r.fail("invalid grant")
			return
		}
		rec.Grants = append(rec.Grants, g)
	}
}

// Grant returns the grant with id, if r holds it.
func (r *Record) Grant(id uint64) (*Grant, bool) {
	for i := range r.Grants {
		if r.Grants[i].ID == id {
			return &r.Grants[i], true
		}
	}
	return nil, false
}
