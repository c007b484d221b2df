package keyrec

import (
	"encoding/binary"
	"fmt"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/policies"
)

// Reservations (CONTRACT §10, docs/protocol.md "Reservations"). A key
// keeps, in its record, the reservations its owner admitted that are still
// open, and for a while those that ended (so a settle, release or renew
// sent again is answered with the first outcome), with the sequence their
// ids come from. They are the extension section with tag 2, after the
// grants section if the record has one; a record without reservations
// (and without a reservation sequence) has no such section.

// MaxReservations caps the open reservations of one key: a reserve beyond
// it is denied until one ends.
const MaxReservations = 1024

// Ended reservations are remembered, with their first outcome, for a
// settle, release or renew sent again (a retry after a lost reply): for
// EndedWindow, at most MaxEnded per key (the oldest are forgotten first);
// a settle of a forgotten one is a 404, which changes nothing (the
// reservation ended). One whose reserve had a request_id is remembered
// as request_ids are (DedupeWindow, at most MaxDedupeEntries), so a
// reserve retried with it gets the same reservation, never a second one.
// A key's record is written whole with every change, so what it
// remembers is what each of its writes costs.
const (
	EndedWindow = 10 * kvstate.Second
	MaxEnded    = 64
)

// sectionReservations is the tag of the reservations extension section.
const sectionReservations = 2

// Outcome is how a reservation ended.
type Outcome uint8

// The outcomes; Open is a reservation that has not ended.
const (
	Open     Outcome = 0
	Settled  Outcome = 1
	Released Outcome = 2
	Expired  Outcome = 3
)

// String returns the outcome's name (the label of
// limitmesh_reservations_total and the reply's "outcome").
func (o Outcome) String() string {
	switch o {
	case Settled:
		return "settled"
	case Released:
		return "released"
	case Expired:
		return "expired"
	}
	return "open"
}

// Reservation is one reservation of a key: Units micro-units debited from
// (held in) every limit of the key's policy when it was admitted, until it
// ends. Instants in ns (Unix) of the owner's clock.
type Reservation struct {
	Seq      uint64 // unique per key: the record's ResSeq when it was made
	Nonce    uint64 // random, part of the id: ids cannot be guessed
	Units    int64  // reserved (> 0)
	Revision uint64 // the policy revision that admitted it
	At       int64  // when admitted
	Expires  int64  // when it ends unless renewed (>= At)
	// HasReqID and ReqID: the reserve's request_id (IDHash), so a retry
	// of the reserve gets this reservation again; RequestID is the text,
	// for its usage record.
	HasReqID  bool
	ReqID     [16]byte
	RequestID string
	// Desc is the reserve's descriptor, for its usage record.
	Desc policies.Descriptor
	// Hold marks one layer's hold of a multi-layer decision (CONTRACT
	// §11): committed, it is recorded as an admission; released, not at
	// all; expired, as an admission (a coordinator that never came back).
	Hold bool
	// Room, per limit of the key's policy (bucket limits only; others
	// hold 0): the least headroom (kvstate.Headroom) the bucket had at
	// any instant since the reservation was made, which bounds what a
	// settle may give back: the bucket then holds no more than it would,
	// had the units given back never been taken.
	Room []int64

	// Ending, once Outcome is not Open: the units that stayed spent and
	// the units given back (Settled + Returned == Units), and when. An
	// ended reservation is stored without its RequestID, Desc and Room.
	Outcome  Outcome
	Settled  int64
	Returned int64
	EndedAt  int64
}

// noRoom is a Room entry with no bound yet.
const noRoom = 1<<63 - 1

// HoldID is the holder id the reservation's hold carries in the key's
// concurrency limits (kvstate.Hold.ID).
func (r *Reservation) HoldID() string {
	return "r" + uitoa(r.Seq)
}

func uitoa(v uint64) string {
	var b [20]byte
	i := len(b)
	for {
		i--
		b[i] = byte('0' + v%10)
		v /= 10
		if v == 0 {
			return string(b[i:])
		}
	}
}

const (
	resFlagReqID = 1
	resFlagEnded = 2
	resFlagHold  = 4
)

// appendReservations appends the reservations section of r, if r has one.
func appendReservations(dst []byte, r *Record) []byte {
	if r.ResSeq == 0 && len(r.Reservations) == 0 {
		return dst
	}
	var body []byte
	body = binary.AppendUvarint(body, r.ResSeq)
	body = binary.AppendUvarint(body, uint64(len(r.Reservations)))
	for i := range r.Reservations {
		v := &r.Reservations[i]
		body = binary.AppendUvarint(body, v.Seq)
		body = binary.AppendUvarint(body, v.Nonce)
		body = binary.AppendVarint(body, v.Units)
		body = binary.AppendUvarint(body, v.Revision)
		body = binary.AppendVarint(body, v.At)
		body = binary.AppendUvarint(body, uint64(v.Expires-v.At))
		var f byte
		if v.HasReqID {
			f |= resFlagReqID
		}
		ended := v.Outcome != Open
		if ended {
			f |= resFlagEnded
		}
		if v.Hold {
			f |= resFlagHold
		}
		body = append(body, f)
		if v.HasReqID {
			body = append(body, v.ReqID[:]...)
		}
		if ended {
			// What an ended reservation is remembered for: its first
			// outcome. Its request_id text, rooms and descriptor served
			// its end only.
			body = append(body, byte(v.Outcome))
			body = binary.AppendVarint(body, v.Settled)
			body = binary.AppendVarint(body, v.EndedAt)
			continue
		}
		if v.HasReqID {
			body = binary.AppendUvarint(body, uint64(len(v.RequestID)))
			body = append(body, v.RequestID...)
		}
		body = binary.AppendUvarint(body, uint64(len(v.Room)))
		for _, r := range v.Room {
			// 0: no bound yet (math.MaxInt64), else room+1 (>= 0).
			var e uint64
			if r != noRoom {
				e = uint64(max(r, 0)) + 1
			}
			body = binary.AppendUvarint(body, e)
		}
		body = appendDims(body, v.Desc)
	}
	dst = append(dst, sectionReservations)
	dst = binary.AppendUvarint(dst, uint64(len(body)))
	return append(dst, body...)
}

func decodeReservations(r *reader, rec *Record) {
	rec.ResSeq = r.uvarint("reservation sequence")
	n := r.uvarint("reservation count")
	if r.err != nil {
		return
	}
	if n > MaxReservations+MaxEnded+MaxDedupeEntries {
		r.fail(fmt.Sprintf("%d reservations, at most %d", n, MaxReservations+MaxEnded+MaxDedupeEntries))
		return
	}
	if n > 0 {
		rec.Reservations = make([]Reservation, 0, n)
	}
	var last uint64
	for i := uint64(0); i < n && r.err == nil; i++ {
		var v Reservation
		v.Seq = r.uvarint("reservation id")
		v.Nonce = r.uvarint("reservation nonce")
		v.Units = r.varint("reservation units")
		v.Revision = r.uvarint("reservation revision")
		v.At = r.varint("reservation at")
		if ttl := r.uvarint("reservation ttl"); ttl <= 1<<62 {
			v.Expires = v.At + int64(ttl)
		} else {
			r.fail("reservation ttl")
		}
		f := r.bytes(1, "reservation flags")
		if r.err != nil {
			return
		}
		if f[0]&^(resFlagReqID|resFlagEnded|resFlagHold) != 0 {
			r.fail("unknown reservation flags")
			return
		}
		v.Hold = f[0]&resFlagHold != 0
		if f[0]&resFlagReqID != 0 {
			v.HasReqID = true
			copy(v.ReqID[:], r.bytes(16, "reservation request id"))
		}
		if f[0]&resFlagEnded != 0 {
			o := r.bytes(1, "reservation outcome")
			v.Settled = r.varint("reservation settled")
			v.EndedAt = r.varint("reservation end")
			if r.err != nil {
				return
			}
			v.Outcome = Outcome(o[0])
			v.Returned = v.Units - v.Settled
			if v.Outcome < Settled || v.Outcome > Expired || v.Settled < 0 || v.Returned < 0 {
				r.fail("invalid reservation ending")
				return
			}
		} else {
			if v.HasReqID {
				l := r.uvarint("request_id length")
				if l > 128 {
					r.fail("request_id length")
					return
				}
				v.RequestID = string(r.bytes(l, "request_id"))
			}
			nr := r.uvarint("rooms")
			if r.err == nil && nr > 64 {
				r.fail("reservation rooms")
			}
			for j := uint64(0); j < nr && r.err == nil; j++ {
				e := r.uvarint("room")
				switch {
				case e == 0:
					v.Room = append(v.Room, noRoom)
				case e-1 < noRoom:
					v.Room = append(v.Room, int64(e-1))
				default:
					r.fail("room")
				}
			}
			dims := r.dims()
			if r.err != nil {
				return
			}
			if len(dims) > 0 {
				d, err := policies.NewDescriptor(dims)
				if err != nil {
					r.fail("reservation descriptor: " + err.Error())
					return
				}
				v.Desc = d
			}
		}
		if v.Seq == 0 || v.Seq > rec.ResSeq || v.Seq <= last || v.Units <= 0 || v.Expires < v.At {
			r.fail("invalid reservation")
			return
		}
		last = v.Seq
		rec.Reservations = append(rec.Reservations, v)
	}
}

// Reservation returns the reservation with seq, if r remembers it.
func (r *Record) Reservation(seq uint64) (*Reservation, bool) {
	for i := range r.Reservations {
		if r.Reservations[i].Seq == seq {
			return &r.Reservations[i], true
		}
	}
	return nil, false
}

// ReservationByRequest returns the reservation a reserve with request_id
// hash id made, if r remembers it.
func (r *Record) ReservationByRequest(id [16]byte) (*Reservation, bool) {
	for i := range r.Reservations {
		if v := &r.Reservations[i]; v.HasReqID && v.ReqID == id {
			return v, true
		}
	}
	return nil, false
}

// OpenReservations counts r's open reservations and returns the earliest
// expiry among them (0 when none).
func (r *Record) OpenReservations() (n int, next int64) {
	for i := range r.Reservations {
		if v := &r.Reservations[i]; v.Outcome == Open {
			n++
			if next == 0 || v.Expires < next {
				next = v.Expires
			}
		}
	}
	return n, next
}

// PeekReservations returns what a stored record says of its open
// reservations (OpenReservations: how many, the earliest expiry) and its
// policy and version, decoding the reservations section only (the states
// and the dedupe entries are skipped); false when b is not a record. It
// does not check the parts it skips: Decode may still refuse b.
func PeekReservations(b []byte) (policy string, version uint64, open int, next int64, ok bool) {
	if !knownFormat(b) {
		return "", 0, 0, 0, false
	}
	r := reader{b: b[1:]}
	policy = string(r.bytes(r.uvarint("policy length"), "policy"))
	r.uvarint("revision")
	if b[0] >= recordFormat2 {
		version = r.uvarint("version")
	}
	if b[0] >= recordFormat {
		r.varint("rest_at")
	}
	r.bytes(r.uvarint("states length"), "states")
	n := r.uvarint("dedupe count")
	if r.err == nil && n > MaxDedupeEntries {
		return "", 0, 0, 0, false
	}
	for i := uint64(0); i < n && r.err == nil; i++ {
		r.bytes(16, "id")
		r.varint("at")
		r.bytes(1, "flags")
		r.varint("remaining")
		r.varint("retry_after")
		r.varint("reset_after")
		r.uvarint("entry revision")
	}
	for r.err == nil && len(r.b) > 0 {
		tag := r.bytes(1, "section tag")
		body := r.bytes(r.uvarint("section length"), "section")
		if r.err != nil || tag[0] != sectionReservations {
			continue
		}
		var rec Record
		s := reader{b: body}
		decodeReservations(&s, &rec)
		if s.err != nil {
			return "", 0, 0, 0, false
		}
		open, next = rec.OpenReservations()
	}
	if r.err != nil {
		return "", 0, 0, 0, false
	}
	return policy, version, open, next, true
}
