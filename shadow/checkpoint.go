package shadow

import (
	"encoding/binary"
	"fmt"
	"math"

	"github.com/limitmesh/limitmesh/kvstate"
)

// The checkpoint: a Replay's whole state (every candidate's counts, series,
// top keys and limiter states) and the stream sequence it covers, so that
// the next evaluator resumes after that sequence with the same state. It
// is written by this package and read back by the next release's
// evaluator, so the layout is versioned:
//
//	"LMSC" u8 version (1)
//	uvarint seq                      last stream sequence applied
//	uvarint n                        candidates
//	n times:
//	  str name, uvarint revision
//	  varint since_us, last_us, sweep_at
//	  uvarint evaluated, would_allow, would_deny, live_denied, both_denied,
//	          only_candidate_denied, only_live_denied, skipped, overflow
//	  varint would_deny_units
//	  uvarint p, then p points: varint t_us, uvarint evaluated, would_deny, live_denied
//	  uvarint t, then t top keys: str key, uvarint would_deny
//	  keystate overflow
//	  uvarint k, then k keystates (str key first)
//	keystate: uvarint denied, str states (kvstate.AppendStates)
//
// str is a uvarint length and that many bytes. Every key is written, so
// that a restored Replay counts exactly as the one that wrote it would
// have.
const (
	checkpointMagic   = "LMSC"
	checkpointVersion = 1
)

// appendCheckpoint appends one checkpoint, covering the stream up to and
// including sequence seq, holding the candidates of every Replay of rs
// (whose candidates are disjoint).
func appendCheckpoint(dst []byte, seq uint64, rs ...*Replay) []byte {
	dst = append(dst, checkpointMagic...)
	dst = append(dst, checkpointVersion)
	dst = binary.AppendUvarint(dst, seq)
	n := 0
	for _, r := range rs {
		n += len(r.cands)
	}
	dst = binary.AppendUvarint(dst, uint64(n))
	var scratch []byte
	for _, r := range rs {
		for _, c := range r.cands {
			dst, scratch = appendCandidate(dst, scratch, c)
		}
	}
	return dst
}

// appendCandidate appends one candidate's part of a checkpoint.
func appendCandidate(dst, scratch []byte, c *candidate) ([]byte, []byte) {
	s := &c.sum
	dst = appendStr(dst, c.p.Name)
	dst = binary.AppendUvarint(dst, c.p.Revision)
	dst = binary.AppendVarint(dst, s.SinceUs)
	dst = binary.AppendVarint(dst, s.LastUs)
	dst = binary.AppendVarint(dst, c.sweepAt)
	for _, v := range [...]uint64{s.Evaluated, s.WouldAllow, s.WouldDeny, s.LiveDenied, s.BothDenied,
		s.OnlyCandidateDenied, s.OnlyLiveDenied, s.Skipped, s.Overflow} {
		dst = binary.AppendUvarint(dst, v)
	}
	dst = binary.AppendVarint(dst, int64(s.WouldDenyUnits))
	dst = binary.AppendUvarint(dst, uint64(len(c.series.points)))
	for _, p := range c.series.points {
		dst = binary.AppendVarint(dst, p.TimeUs)
		dst = binary.AppendUvarint(dst, p.Evaluated)
		dst = binary.AppendUvarint(dst, p.WouldDeny)
		dst = binary.AppendUvarint(dst, p.LiveDenied)
	}
	top := c.top.entries()
	dst = binary.AppendUvarint(dst, uint64(len(top)))
	for _, t := range top {
		dst = appendStr(dst, t.Key)
		dst = binary.AppendUvarint(dst, t.WouldDeny)
	}
	dst, scratch = appendKeyState(dst, scratch, &c.over)
	dst = binary.AppendUvarint(dst, uint64(len(c.keys)))
	for _, ks := range c.keys {
		dst = appendStr(dst, ks.key)
		dst, scratch = appendKeyState(dst, scratch, ks)
	}
	return dst, scratch
}

func appendStr(dst []byte, s string) []byte {
	dst = binary.AppendUvarint(dst, uint64(len(s)))
	return append(dst, s...)
}

func appendKeyState(dst, scratch []byte, ks *keyState) ([]byte, []byte) {
	dst = binary.AppendUvarint(dst, ks.denied)
	scratch = kvstate.AppendStates(scratch[:0], ks.states)
	dst = binary.AppendUvarint(dst, uint64(len(scratch)))
	return append(dst, scratch...), scratch
}

// CheckpointInfo describes a decoded checkpoint.
type CheckpointInfo struct {
	Seq        uint64 // last stream sequence the checkpoint covers
	Candidates int    // candidates in the checkpoint
	Restored   int    // of them, the ones restored (same name and revision as a current candidate)
}

// Restore loads the state of a checkpoint (as the evaluator writes to its
// checkpoint bucket) into r's current candidates: a candidate in the checkpoint with the name
// and revision of a current candidate replaces that candidate's counts and
// state; the others are ignored, and current candidates absent from the
// checkpoint keep theirs. Call it after SetCandidates. On an error
// (matching [ErrCorrupt]) r is unchanged.
func (r *Replay) Restore(b []byte) (CheckpointInfo, error) {
	d := &ckptDecoder{b: b}
	cands, seq := d.checkpoint(r.opt)
	if d.err != nil {
		return CheckpointInfo{}, d.err
	}
	info := CheckpointInfo{Seq: seq, Candidates: len(cands)}
	for _, rc := range cands {
		c := findCandidate(r.cands, rc.sum.Policy)
		if c == nil || c.p.Revision != rc.sum.Revision {
			continue
		}
		c.sum, c.sweepAt, c.series, c.top, c.over, c.keys = rc.sum, rc.sweepAt, rc.series, rc.top, rc.over, rc.keys
		c.over.key = OverflowKey(c.p.Name)
		info.Restored++
	}
	r.reindex()
	return info, nil
}

// ckptDecoder reads a checkpoint; the first error sticks and every later
// read returns zero values.
type ckptDecoder struct {
	b   []byte
	err error
}

func (d *ckptDecoder) fail(format string, args ...any) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: %s", ErrCorrupt, fmt.Sprintf(format, args...))
	}
	d.b = nil
}

func (d *ckptDecoder) uvarint(what string) uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.b)
	if n <= 0 {
		d.fail("%s: bad varint", what)
		return 0
	}
	d.b = d.b[n:]
	return v
}

func (d *ckptDecoder) varint(what string) int64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Varint(d.b)
	if n <= 0 {
		d.fail("%s: bad varint", what)
		return 0
	}
	d.b = d.b[n:]
	return v
}

// count reads a count of items that take at least min bytes each.
func (d *ckptDecoder) count(what string, min int) int {
	v := d.uvarint(what)
	if d.err == nil && v > uint64(len(d.b)/min) {
		d.fail("%s: %d items in %d bytes", what, v, len(d.b))
		return 0
	}
	return int(v)
}

func (d *ckptDecoder) bytes(what string, max int) []byte {
	n := d.uvarint(what)
	if d.err != nil {
		return nil
	}
	if n > uint64(max) || n > uint64(len(d.b)) {
		d.fail("%s: length %d", what, n)
		return nil
	}
	v := d.b[:n]
	d.b = d.b[n:]
	return v
}

// Bounds of decoded strings.
const (
	maxCkptKey    = 512 // limit keys are at most 256 bytes; overflow keys under 100
	maxCkptStates = 1 << 20
)

func (d *ckptDecoder) checkpoint(opt Options) ([]*candidate, uint64) {
	if len(d.b) < len(checkpointMagic)+1 || string(d.b[:len(checkpointMagic)]) != checkpointMagic {
		d.fail("not a checkpoint (no magic)")
		return nil, 0
	}
	if v := d.b[len(checkpointMagic)]; v != checkpointVersion {
		d.fail("unknown version %d", v)
		return nil, 0
	}
	d.b = d.b[len(checkpointMagic)+1:]
	seq := d.uvarint("seq")
	n := d.count("candidates", 8)
	var out []*candidate
	seen := map[string]bool{}
	for i := 0; i < n && d.err == nil; i++ {
		c := d.candidate(opt)
		if d.err != nil {
			break
		}
		if seen[c.sum.Policy] {
			d.fail("candidate %q twice", c.sum.Policy)
			break
		}
		seen[c.sum.Policy] = true
		out = append(out, c)
	}
	if d.err == nil && len(d.b) != 0 {
		d.fail("%d trailing bytes", len(d.b))
	}
	return out, seq
}

func (d *ckptDecoder) candidate(opt Options) *candidate {
	c := &candidate{keys: map[string]*keyState{}, top: newTopSet(opt.TopTracked)}
	s := &c.sum
	s.Policy = string(d.bytes("name", 64))
	s.Revision = d.uvarint("revision")
	s.SinceUs = d.varint("since_us")
	s.LastUs = d.varint("last_us")
	c.sweepAt = d.varint("sweep_at")
	for _, p := range [...]*uint64{&s.Evaluated, &s.WouldAllow, &s.WouldDeny, &s.LiveDenied, &s.BothDenied,
		&s.OnlyCandidateDenied, &s.OnlyLiveDenied, &s.Skipped, &s.Overflow} {
		*p = d.uvarint("count")
	}
	s.WouldDenyUnits = Units(d.varint("would_deny_units"))
	if d.err == nil && (s.WouldAllow+s.WouldDeny != s.Evaluated || s.BothDenied+s.OnlyCandidateDenied != s.WouldDeny ||
		s.BothDenied+s.OnlyLiveDenied != s.LiveDenied || s.WouldAllow > s.Evaluated) {
		d.fail("candidate %q: inconsistent counts", s.Policy)
	}
	np := d.count("series", 4)
	if np > SeriesLen {
		d.fail("series of %d points", np)
	}
	for i := 0; i < np && d.err == nil; i++ {
		p := Point{TimeUs: d.varint("t_us"), Evaluated: d.uvarint("evaluated"),
			WouldDeny: d.uvarint("would_deny"), LiveDenied: d.uvarint("live_denied")}
		if i > 0 && (c.series.points[i-1].TimeUs > math.MaxInt64-SeriesStepUs || p.TimeUs != c.series.points[i-1].TimeUs+SeriesStepUs) {
			d.fail("series point %d out of step", i)
		}
		c.series.points = append(c.series.points, p)
	}
	nt := d.count("top", 2)
	for i := 0; i < nt && d.err == nil; i++ {
		k := string(d.bytes("top key", maxCkptKey))
		c.top.set(k, d.uvarint("top count"))
	}
	d.keyState(&c.over)
	nk := d.count("keys", 3)
	for i := 0; i < nk && d.err == nil; i++ {
		ks := &keyState{key: string(d.bytes("key", maxCkptKey))}
		d.keyState(ks)
		idx := keyIndex(c.sum.Policy, ks.key)
		if d.err == nil && c.keys[idx] != nil {
			d.fail("key %q twice", ks.key)
		}
		c.keys[idx] = ks
	}
	return c
}

func (d *ckptDecoder) keyState(ks *keyState) {
	ks.denied = d.uvarint("denied")
	b := d.bytes("states", maxCkptStates)
	if d.err != nil {
		return
	}
	st, err := kvstate.DecodeStates(b, nil)
	if err != nil {
		d.fail("states: %v", err)
		return
	}
	if len(st) > 0 {
		ks.states = st
	}
}
