package mesh

import (
	"encoding/binary"
	"fmt"

	"github.com/limitmesh/limitmesh/kvstate"
)

// DedupeWindow is how long a request_id is remembered for a limit key, ns
// (CONTRACT.md §2: 60 s).
const DedupeWindow = 60 * kvstate.Second

// MaxDedupeEntries caps the request_id entries one key record keeps. When a
// key sees more distinct request_ids than this within DedupeWindow, the
// oldest entries are dropped first, and a retry of one of those is decided
// (and spends) again. 256 entries keep a record under ~12 KiB.
const MaxDedupeEntries = 256

// recordVersion is the first byte of an encoded record.
const recordVersion = 1

// record is the value stored in the state bucket for one limit key: the
// policy version the states were last written under, the kvstate states of
// that policy's limits (in its limit order), and the recent request_ids
// with the decision each got, so dedupe is atomic with the spend.
//
// Encoding (docs/protocol.md):
//
//	byte    version (1)
//	uvarint len(policy), policy bytes
//	uvarint policy revision
//	uvarint len(states), states (kvstate.AppendStates)
//	uvarint n dedupe entries, oldest first, each:
//	  [16]byte id hash, varint at (ns), byte flags (1 allowed, 2 shadow_denied),
//	  varint remaining, varint retry_after, varint reset_after, uvarint revision
type record struct {
	policy   string
	revision uint64
	states   []kvstate.State
	dedupe   []dedupeEntry
}

// dedupeEntry is one remembered request_id.
type dedupeEntry struct {
	id [16]byte
	at int64 // ns when first decided
	d  decision
}

const (
	flagAllowed      = 1
	flagShadowDenied = 2
)

// recordSizeHint is a capacity that usually holds r's encoding, so
// encoding allocates once.
func recordSizeHint(r *record) int {
	return 32 + len(r.policy) + 40*len(r.states) + 48*len(r.dedupe)
}

// appendRecord appends the encoding of r to dst.
func appendRecord(dst []byte, r *record) []byte {
	dst = append(dst, recordVersion)
	dst = binary.AppendUvarint(dst, uint64(len(r.policy)))
	dst = append(dst, r.policy...)
	dst = binary.AppendUvarint(dst, r.revision)
	// The states' length prefix is a uvarint: encode the states after a
	// one-byte gap and widen the gap only when they are 128 bytes or more.
	at := len(dst)
	dst = append(dst, 0)
	dst = kvstate.AppendStates(dst, r.states)
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
	dst = binary.AppendUvarint(dst, uint64(len(r.dedupe)))
	for i := range r.dedupe {
		e := &r.dedupe[i]
		dst = append(dst, e.id[:]...)
		dst = binary.AppendVarint(dst, e.at)
		var f byte
		if e.d.Allowed {
			f |= flagAllowed
		}
		if e.d.ShadowDenied {
			f |= flagShadowDenied
		}
		dst = append(dst, f)
		dst = binary.AppendVarint(dst, e.d.Remaining)
		dst = binary.AppendVarint(dst, e.d.RetryAfter)
		dst = binary.AppendVarint(dst, e.d.ResetAfter)
		dst = binary.AppendUvarint(dst, e.d.Revision)
	}
	return dst
}

// recordReader decodes with bounds checks; the first error sticks.
type recordReader struct {
	b   []byte
	err error
}

func (r *recordReader) fail(what string) {
	if r.err == nil {
		r.err = fmt.Errorf("%w: %s", ErrCorruptRecord, what)
	}
}

func (r *recordReader) uvarint(what string) uint64 {
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

func (r *recordReader) varint(what string) int64 {
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

func (r *recordReader) bytes(n uint64, what string) []byte {
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

// decodeRecord decodes a stored record. Errors wrap ErrCorruptRecord (or
// kvstate.ErrCorrupt for the states part); it never panics.
func decodeRecord(b []byte) (record, error) {
	var rec record
	if len(b) == 0 || b[0] != recordVersion {
		return rec, fmt.Errorf("%w: unknown version", ErrCorruptRecord)
	}
	r := recordReader{b: b[1:]}
	rec.policy = string(r.bytes(r.uvarint("policy length"), "policy"))
	rec.revision = r.uvarint("revision")
	st := r.bytes(r.uvarint("states length"), "states")
	n := r.uvarint("dedupe count")
	if r.err != nil {
		return record{}, r.err
	}
	if n > MaxDedupeEntries {
		return record{}, fmt.Errorf("%w: %d dedupe entries, at most %d", ErrCorruptRecord, n, MaxDedupeEntries)
	}
	states, err := kvstate.DecodeStates(st, nil)
	if err != nil {
		return record{}, fmt.Errorf("%w: %w", ErrCorruptRecord, err)
	}
	rec.states = states
	if n > 0 {
		rec.dedupe = make([]dedupeEntry, 0, n)
	}
	for i := uint64(0); i < n && r.err == nil; i++ {
		var e dedupeEntry
		copy(e.id[:], r.bytes(16, "id"))
		e.at = r.varint("at")
		f := r.bytes(1, "flags")
		if r.err == nil {
			if f[0]&^(flagAllowed|flagShadowDenied) != 0 {
				r.fail("unknown flags")
			}
			e.d.Allowed = f[0]&flagAllowed != 0
			e.d.ShadowDenied = f[0]&flagShadowDenied != 0
		}
		e.d.Remaining = r.varint("remaining")
		e.d.RetryAfter = r.varint("retry_after")
		e.d.ResetAfter = r.varint("reset_after")
		e.d.Revision = r.uvarint("entry revision")
		rec.dedupe = append(rec.dedupe, e)
	}
	if r.err == nil && len(r.b) != 0 {
		r.fail("trailing bytes")
	}
	if r.err != nil {
		return record{}, r.err
	}
	rec.dedupeFixPolicy()
	return rec, nil
}

// dedupeFixPolicy fills the policy name of the remembered decisions: it is
// the record's (a key belongs to one policy), so it is not stored per entry.
func (r *record) dedupeFixPolicy() {
	for i := range r.dedupe {
		r.dedupe[i].d.Policy = r.policy
	}
}

// peekRecordPolicy returns the policy name and revision a stored record was
// written under, without decoding the rest.
func peekRecordPolicy(b []byte) (string, uint64, bool) {
	if len(b) == 0 || b[0] != recordVersion {
		return "", 0, false
	}
	r := recordReader{b: b[1:]}
	name := string(r.bytes(r.uvarint("policy length"), "policy"))
	rev := r.uvarint("revision")
	return name, rev, r.err == nil
}

// findDedupe returns the remembered decision for id, if any.
func (r *record) findDedupe(id [16]byte) (decision, bool) {
	for i := len(r.dedupe) - 1; i >= 0; i-- {
		if r.dedupe[i].id == id {
			return r.dedupe[i].d, true
		}
	}
	return decision{}, false
}

// pruneDedupe drops entries older than DedupeWindow at now.
func (r *record) pruneDedupe(now int64) {
	i := 0
	for i < len(r.dedupe) && now-r.dedupe[i].at >= DedupeWindow {
		i++
	}
	if i > 0 {
		r.dedupe = append(r.dedupe[:0:0], r.dedupe[i:]...)
	}
}

// addDedupe remembers id's decision, dropping the oldest entry beyond
// MaxDedupeEntries. The slice is copied, never modified in place, so a
// record shared with a pending write stays intact.
func (r *record) addDedupe(id [16]byte, now int64, d decision) {
	start := 0
	if len(r.dedupe) >= MaxDedupeEntries {
		start = len(r.dedupe) - MaxDedupeEntries + 1
	}
	n := make([]dedupeEntry, 0, len(r.dedupe)-start+1)
	n = append(n, r.dedupe[start:]...)
	r.dedupe = append(n, dedupeEntry{id: id, at: now, d: d})
}
