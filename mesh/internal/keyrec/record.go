package keyrec

import (
	"encoding/binary"
	"fmt"

	"github.com/limitmesh/limitmesh/kvstate"
)

// DedupeWindow is how long a request_id is remembered for a limit key, ns
// (CONTRACT.md §2: 60 s).
const DedupeWindow = 60 * kvstate.Second

// MaxDedupeEntries caps the request_id entries one key Record keeps. When a
// key sees more distinct request_ids than this within DedupeWindow, the
// oldest entries are dropped first, and a retry of one of those is decided
// (and spends) again. 256 entries keep a Record under ~12 KiB.
const MaxDedupeEntries = 256

// The first byte of an encoded Record: its format. Format 3 adds the
// instant the record comes to rest (Record.RestAt); format 2 records decode
// with RestAt 0 (unknown). Format 2 adds the record's version
// (Record.Version); format 1 records decode with version 0.
const (
	recordFormat1 = 1
	recordFormat2 = 2
	recordFormat  = 3
)

// knownFormat reports whether b starts with a record format this package
// decodes.
func knownFormat(b []byte) bool {
	return len(b) > 0 && b[0] >= recordFormat1 && b[0] <= recordFormat
}

// Record is the value stored in the state bucket for one limit key: the
// policy version the states were last written under, the kvstate states of
// that policy's limits (in its limit order), and the recent request_ids
// with the decision each got, so dedupe is atomic with the spend.
//
// Encoding (docs/protocol.md):
//
//	byte    format (3; 2 has no rest_at field, 1 neither a version)
//	uvarint len(policy), policy bytes
//	uvarint policy revision
//	uvarint version (formats 2 and 3)
//	varint  rest_at (format 3)
//	uvarint len(states), states (kvstate.AppendStates)
//	uvarint n dedupe entries, oldest first, each:
//	  [16]byte id hash, varint at (ns), byte flags (1 allowed, 2 shadow_denied),
//	  varint remaining, varint retry_after, varint reset_after, uvarint revision
//	extension sections, each byte tag, uvarint length, body, in tag
//	  order, present only when the record has any: tag 1 grants (leased
//	  mode, grants.go), tag 2 reservations (reservations.go)
type Record struct {
	Policy   string // the policy the states were last written under
	Revision uint64 // that policy's KV revision
	// Version counts the writes of the key's record: each write carries
	// one more than the record it was decided from, so of two records of
	// a key the one with the higher version is the later (adoption keeps
	// it, whatever journal it came from: invariant J10).
	Version uint64
	// RestAt is the instant (Unix ns, the writer's clock) at and after
	// which the record is at rest: every limit's state is
	// (kvstate.RestAt) and every remembered request_id is out of the
	// dedupe window, so dropping the record changes no decision. The
	// writer sets it with every write; the state bucket and the journal
	// keep the record at least until then (Retention). 0: unknown (a
	// record of format 1 or 2).
	RestAt int64
	States []kvstate.State // one per limit, in the policy's limit order
	Dedupe []DedupeEntry   // recent request_ids, oldest first
	// Grants are the outstanding grants of a leased key, oldest first,
	// and GrantSeq the id of the last grant made (ids only grow).
	Grants   []Grant
	GrantSeq uint64
	// Reservations are the key's open reservations and those that ended
	// within DedupeWindow, by Seq, and ResSeq the id of the last one made
	// (ids only grow; reservations.go).
	Reservations []Reservation
	ResSeq       uint64
}

// DedupeEntry is one remembered request_id.
type DedupeEntry struct {
	ID [16]byte // IDHash of the request_id
	At int64    // ns (Unix) when first decided
	D  Decision // the decision it got
}

const (
	flagAllowed = 1
	// flagShadowDenied marked a v1 inline shadow denial (the request was
	// admitted). Nodes since CONTRACT v1.1 never write it; a record that
	// has it decodes as an admission.
	flagShadowDenied = 2
)

// SizeHint is a capacity that usually holds r's encoding, so
// encoding allocates once.
func SizeHint(r *Record) int {
	return 42 + len(r.Policy) + 40*len(r.States) + 48*len(r.Dedupe) + 64*len(r.Grants) + 96*len(r.Reservations)
}

// Append appends the encoding of r to dst.
func Append(dst []byte, r *Record) []byte {
	dst = append(dst, recordFormat)
	dst = binary.AppendUvarint(dst, uint64(len(r.Policy)))
	dst = append(dst, r.Policy...)
	dst = binary.AppendUvarint(dst, r.Revision)
	dst = binary.AppendUvarint(dst, r.Version)
	dst = binary.AppendVarint(dst, r.RestAt)
	// The states' length prefix is a uvarint: encode the states after a
	// one-byte gap and widen the gap only when they are 128 bytes or more.
	at := len(dst)
	dst = append(dst, 0)
	dst = kvstate.AppendStates(dst, r.States)
	n := len(dst) - at - 1
	if n < 0x80 {
		dst[at] = byte(n)
	} else {
		var pre [binary.MaxVarintLen64]byte
		w := binary.PutUvarint(pre[:], uint64(n))
		dst = append(dst, pre[:w-1]...)
		copy(dst[at+w:], dst[at+1:at+1+n])
		copy(dst[at:], pre[:w])
	}
	dst = binary.AppendUvarint(dst, uint64(len(r.Dedupe)))
	for i := range r.Dedupe {
		e := &r.Dedupe[i]
		dst = append(dst, e.ID[:]...)
		dst = binary.AppendVarint(dst, e.At)
		var f byte
		if e.D.Allowed {
			f |= flagAllowed
		}
		dst = append(dst, f)
		dst = binary.AppendVarint(dst, e.D.Remaining)
		dst = binary.AppendVarint(dst, e.D.RetryAfter)
		dst = binary.AppendVarint(dst, e.D.ResetAfter)
		dst = binary.AppendUvarint(dst, e.D.Revision)
	}
	dst = appendGrants(dst, r)
	return appendReservations(dst, r)
}

// reader decodes with bounds checks; the first error sticks.
type reader struct {
	b   []byte
	err error
}

func (r *reader) fail(what string) {
	if r.err == nil {
		r.err = fmt.Errorf("%w: %s", ErrCorrupt, what)
	}
}

func (r *reader) uvarint(what string) uint64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Uvarint(r.b)
	if n <= 0 {
		r.fail(what)
		return 0
	}
	r.b = r.b[n:]
	return v
}

func (r *reader) varint(what string) int64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Varint(r.b)
	if n <= 0 {
		r.fail(what)
		return 0
	}
	r.b = r.b[n:]
	return v
}

func (r *reader) bytes(n uint64, what string) []byte {
	if r.err != nil {
		return nil
	}
	if n > uint64(len(r.b)) {
		r.fail(what + " truncated")
		return nil
	}
	v := r.b[:n]
	r.b = r.b[n:]
	return v
}

// Decode decodes a stored Record. Errors wrap ErrCorrupt (or
// kvstate.ErrCorrupt for the states part); it never panics.
func Decode(b []byte) (Record, error) {
	var rec Record
	if !knownFormat(b) {
		return rec, fmt.Errorf("%w: unknown format", ErrCorrupt)
	}
	r := reader{b: b[1:]}
	rec.Policy = string(r.bytes(r.uvarint("policy length"), "policy"))
	rec.Revision = r.uvarint("revision")
	if b[0] >= recordFormat2 {
		rec.Version = r.uvarint("version")
	}
	if b[0] >= recordFormat {
		rec.RestAt = r.varint("rest_at")
	}
	st := r.bytes(r.uvarint("states length"), "states")
	n := r.uvarint("dedupe count")
	if r.err != nil {
		return Record{}, r.err
	}
	if n > MaxDedupeEntries {
		return Record{}, fmt.Errorf("%w: %d dedupe entries, at most %d", ErrCorrupt, n, MaxDedupeEntries)
	}
	states, err := kvstate.DecodeStates(st, nil)
	if err != nil {
		return Record{}, fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	rec.States = states
	if n > 0 {
		rec.Dedupe = make([]DedupeEntry, 0, n)
	}
	for i := uint64(0); i < n && r.err == nil; i++ {
		var e DedupeEntry
		copy(e.ID[:], r.bytes(16, "id"))
		e.At = r.varint("at")
		f := r.bytes(1, "flags")
		if r.err == nil {
			if f[0]&^(flagAllowed|flagShadowDenied) != 0 {
				r.fail("unknown flags")
			}
			e.D.Allowed = f[0]&flagAllowed != 0
		}
		e.D.Remaining = r.varint("remaining")
		e.D.RetryAfter = r.varint("retry_after")
		e.D.ResetAfter = r.varint("reset_after")
		e.D.Revision = r.uvarint("entry revision")
		rec.Dedupe = append(rec.Dedupe, e)
	}
	decodeSections(&r, &rec)
	if r.err != nil {
		return Record{}, r.err
	}
	rec.fixPolicy()
	return rec, nil
}

// fixPolicy fills the policy name of the remembered decisions: it is
// the Record's (a key belongs to one policy), so it is not stored per entry.
func (r *Record) fixPolicy() {
	for i := range r.Dedupe {
		r.Dedupe[i].D.Policy = r.Policy
	}
}

// PeekPolicy returns the policy name and revision a stored Record was
// written under, without decoding the rest.
func PeekPolicy(b []byte) (string, uint64, bool) {
	if !knownFormat(b) {
		return "", 0, false
	}
	r := reader{b: b[1:]}
	name := string(r.bytes(r.uvarint("policy length"), "policy"))
	rev := r.uvarint("revision")
	return name, rev, r.err == nil
}

// PeekVersion returns a stored record's version (0 for format 1) without
// decoding the rest; false when b is not a record.
func PeekVersion(b []byte) (uint64, bool) {
	v, _, ok := peek(b)
	return v, ok
}

// PeekRestAt returns a stored record's RestAt (0, unknown, for formats 1
// and 2) without decoding the rest; false when b is not a record.
func PeekRestAt(b []byte) (int64, bool) {
	_, at, ok := peek(b)
	return at, ok
}

// peek reads a stored record's version and rest_at.
func peek(b []byte) (version uint64, restAt int64, ok bool) {
	if !knownFormat(b) {
		return 0, 0, false
	}
	r := reader{b: b[1:]}
	r.bytes(r.uvarint("policy length"), "policy")
	r.uvarint("revision")
	if b[0] >= recordFormat2 {
		version = r.uvarint("version")
	}
	if b[0] >= recordFormat {
		restAt = r.varint("rest_at")
	}
	if r.err != nil {
		return 0, 0, false
	}
	return version, restAt, true
}

// FindDedupe returns the remembered decision for id, if any.
func (r *Record) FindDedupe(id [16]byte) (Decision, bool) {
	for i := len(r.Dedupe) - 1; i >= 0; i-- {
		if r.Dedupe[i].ID == id {
			return r.Dedupe[i].D, true
		}
	}
	return Decision{}, false
}

// PruneDedupe drops entries older than DedupeWindow at now.
func (r *Record) PruneDedupe(now int64) {
	i := 0
	for i < len(r.Dedupe) && now-r.Dedupe[i].At >= DedupeWindow {
		i++
	}
	if i > 0 {
		r.Dedupe = append(r.Dedupe[:0:0], r.Dedupe[i:]...)
	}
}

// AddDedupe remembers id's decision, dropping the oldest entry beyond
// MaxDedupeEntries. The slice is copied, never modified in place, so a
// Record shared with a pending write stays intact.
func (r *Record) AddDedupe(id [16]byte, now int64, d Decision) {
	start := 0
	if len(r.Dedupe) >= MaxDedupeEntries {
		start = len(r.Dedupe) - MaxDedupeEntries + 1
	}
	n := make([]DedupeEntry, 0, len(r.Dedupe)-start+1)
	n = append(n, r.Dedupe[start:]...)
	r.Dedupe = append(n, DedupeEntry{ID: id, At: now, D: d})
}
