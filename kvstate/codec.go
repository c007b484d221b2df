package kvstate

import (
	"encoding/binary"
	"fmt"
)

// The key-state codec: all the limits of one key in one value, so that one
// compare-and-swap writes them atomically. The bytes are stored in
// JetStream KV and read back by later releases: the layout below is stable,
// pinned by a golden test, and only ever extended under a new version byte.
//
// Layout, version 1 (all integers little-endian, fixed width; iN is a
// two's-complement signed integer, uN unsigned):
//
//	u8  version (1)
//	u8  n, the number of states (at most MaxStates)
//	n times, one state:
//	  u8 tag: the algorithm (0 = never seen, then no more bytes for this
//	  state), or tagWide|algorithm for a wide variant
//	  token_bucket (1):   i64 Tokens, u32 Frac, i64 Last                  20 bytes
//	  gcra (2):           i64 TAT, i64 TATFrac, i64 Last                  24 bytes
//	  fixed_window (3):   i64 WindowStart, i64 Count                      16 bytes
//	  sliding_window (4): i64 WindowStart, i64 Count, i64 Prev            24 bytes
//	  sliding_log (5):    u16 k, then k x (i64 At, i64 Cost)              2+16k bytes
//	  concurrency (6):    u16 k, then k x (i64 Cost, i64 Expires, u8 len, len bytes ID)
//	  quota (7):          i64 WindowStart (period start), i64 Count       16 bytes
//	  token_bucket wide (0x81): i64 Tokens, i64 Frac, i64 Last            24 bytes
//
// Only the fields of the state's algorithm are encoded. A key with one
// token_bucket limit encodes to 23 bytes. A token_bucket Frac of at least
// 1e9 (possible only when the limit's RatePer is above a second) uses the
// wide tag; a smaller Frac always uses tag 1, so every state has exactly
// one encoding. Tags 1..127 are algorithm numbers; tags with the high bit
// set are wide variants, never algorithms.
//
// Decoding rejects, with an error wrapping ErrCorrupt: an unknown version or
// tag, truncated or trailing bytes, Frac outside [0, 1e9) (tag 1) or below
// 1e9 or negative (tag 0x81), negative Tokens, TATFrac, Count or Prev, log
// entries or holds with a cost <= 0, out of order (At or Expires
// decreasing), or more than MaxLogEntries/MaxHolds of them.

// codecVersion is the first byte of every encoded key state.
const codecVersion = 1

// tagWide marks a wide variant of an algorithm's encoding.
const tagWide = 0x80

// MaxStates is the most states (limits of one key) one value encodes.
const MaxStates = 255

// Encoded sizes of the fixed-width states, after the algorithm byte.
const (
	tbSize     = 8 + 4 + 8
	tbWideSize = 8 + 8 + 8
	gcraSize   = 8 + 8 + 8
	quotaSize  = 8 + 8
	fwSize     = 8 + 8
	swSize     = 8 + 8 + 8
	logEntSize = 8 + 8
	holdMin    = 8 + 8 + 1
)

// AppendStates appends the encoding of states to dst and returns the
// extended slice. It encodes the states as given; states this package
// produces always decode. It panics if there are more than MaxStates
// states, more than 65535 log entries or holds in one state, or a hold ID
// longer than MaxHoldID bytes: these are programming errors (Decide never
// produces them).
func AppendStates(dst []byte, states []State) []byte {
	if len(states) > MaxStates {
		panic(fmt.Sprintf("kvstate: %d states exceed MaxStates", len(states)))
	}
	dst = append(dst, codecVersion, byte(len(states)))
	le := binary.LittleEndian
	for i := range states {
		s := &states[i]
		if s.Algorithm == TokenBucket && (s.Frac < 0 || s.Frac >= nano) {
			dst = append(dst, tagWide|byte(TokenBucket))
			dst = le.AppendUint64(dst, uint64(s.Tokens))
			dst = le.AppendUint64(dst, uint64(s.Frac))
			dst = le.AppendUint64(dst, uint64(s.Last))
			continue
		}
		dst = append(dst, byte(s.Algorithm))
		switch s.Algorithm {
		case TokenBucket:
			dst = le.AppendUint64(dst, uint64(s.Tokens))
			dst = le.AppendUint32(dst, uint32(s.Frac))
			dst = le.AppendUint64(dst, uint64(s.Last))
		case GCRA:
			dst = le.AppendUint64(dst, uint64(s.TAT))
			dst = le.AppendUint64(dst, uint64(s.TATFrac))
			dst = le.AppendUint64(dst, uint64(s.Last))
		case FixedWindow, Quota:
			dst = le.AppendUint64(dst, uint64(s.WindowStart))
			dst = le.AppendUint64(dst, uint64(s.Count))
		case SlidingWindow:
			dst = le.AppendUint64(dst, uint64(s.WindowStart))
			dst = le.AppendUint64(dst, uint64(s.Count))
			dst = le.AppendUint64(dst, uint64(s.Prev))
		case SlidingLog:
			dst = le.AppendUint16(dst, count16(len(s.Log)))
			for _, e := range s.Log {
				dst = le.AppendUint64(dst, uint64(e.At))
				dst = le.AppendUint64(dst, uint64(e.Cost))
			}
		case Concurrency:
			dst = le.AppendUint16(dst, count16(len(s.Holds)))
			for _, h := range s.Holds {
				if len(h.ID) > MaxHoldID {
					panic("kvstate: hold ID longer than MaxHoldID")
				}
				dst = le.AppendUint64(dst, uint64(h.Cost))
				dst = le.AppendUint64(dst, uint64(h.Expires))
				dst = append(dst, byte(len(h.ID)))
				dst = append(dst, h.ID...)
			}
		}
	}
	return dst
}

func count16(n int) uint16 {
	if n > 0xFFFF {
		panic(fmt.Sprintf("kvstate: %d entries do not fit the codec", n))
	}
	return uint16(n)
}

// decoder reads fixed-width little-endian fields, remembering the first
// failure.
type decoder struct {
	b   []byte
	err error
}

func (d *decoder) fail(format string, args ...any) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: "+format, append([]any{ErrCorrupt}, args...)...)
	}
}

func (d *decoder) take(n int, what string) []byte {
	if d.err != nil {
		return nil
	}
	if len(d.b) < n {
		d.fail("truncated %s: %d bytes left, need %d", what, len(d.b), n)
		return nil
	}
	p := d.b[:n]
	d.b = d.b[n:]
	return p
}

func (d *decoder) u8(what string) uint8 {
	if p := d.take(1, what); p != nil {
		return p[0]
	}
	return 0
}

func (d *decoder) u16(what string) int {
	if p := d.take(2, what); p != nil {
		return int(binary.LittleEndian.Uint16(p))
	}
	return 0
}

func (d *decoder) u32(what string) int64 {
	if p := d.take(4, what); p != nil {
		return int64(binary.LittleEndian.Uint32(p))
	}
	return 0
}

func (d *decoder) i64(what string) int64 {
	if p := d.take(8, what); p != nil {
		return int64(binary.LittleEndian.Uint64(p))
	}
	return 0
}

// nonNeg reads an i64 that must not be negative.
func (d *decoder) nonNeg(what string) int64 {
	v := d.i64(what)
	if v < 0 {
		d.fail("negative %s %d", what, v)
	}
	return v
}

// DecodeStates decodes a key state written by [AppendStates], appending the
// states to dst[:0] (pass a reused slice to avoid allocating it; log and
// hold slices are always freshly allocated, never shared with dst's old
// contents). Corrupt input returns an error wrapping [ErrCorrupt]; it never
// panics and never allocates more than a small multiple of len(b).
func DecodeStates(b []byte, dst []State) ([]State, error) {
	dst = dst[:0]
	d := decoder{b: b}
	if v := d.u8("version"); d.err == nil && v != codecVersion {
		d.fail("unknown version %d", v)
	}
	n := int(d.u8("state count"))
	for i := 0; i < n && d.err == nil; i++ {
		dst = append(dst, d.state(i))
	}
	if d.err == nil && len(d.b) != 0 {
		d.fail("%d trailing bytes", len(d.b))
	}
	if d.err != nil {
		return dst[:0], d.err
	}
	return dst, nil
}

func (d *decoder) state(i int) State {
	tag := d.u8("algorithm")
	if tag == tagWide|byte(TokenBucket) {
		s := State{Algorithm: TokenBucket}
		s.Tokens = d.nonNeg("tokens")
		s.Frac = d.nonNeg("frac")
		if d.err == nil && s.Frac < nano {
			d.fail("state %d: wide frac %d below 1e9", i, s.Frac)
		}
		s.Last = d.i64("last")
		return s
	}
	s := State{Algorithm: Algorithm(tag)}
	switch s.Algorithm {
	case 0:
	case TokenBucket:
		s.Tokens = d.nonNeg("tokens")
		s.Frac = d.u32("frac")
		if s.Frac >= nano {
			d.fail("state %d: frac %d out of range", i, s.Frac)
		}
		s.Last = d.i64("last")
	case GCRA:
		s.TAT = d.i64("tat")
		s.TATFrac = d.nonNeg("tat frac")
		s.Last = d.i64("last")
	case FixedWindow:
		s.WindowStart = d.i64("window start")
		s.Count = d.nonNeg("count")
	case Quota:
		s.WindowStart = d.i64("period start")
		s.Count = d.nonNeg("spent")
	case SlidingWindow:
		s.WindowStart = d.i64("window start")
		s.Count = d.nonNeg("count")
		s.Prev = d.nonNeg("prev")
	case SlidingLog:
		k := d.u16("log length")
		if k > MaxLogEntries {
			d.fail("state %d: %d log entries exceed %d", i, k, MaxLogEntries)
		}
		if d.err != nil || len(d.b) < k*logEntSize {
			d.fail("state %d: truncated log of %d entries", i, k)
			return s
		}
		if k > 0 {
			s.Log = make([]LogEntry, k)
		}
		for j := range s.Log {
			e := LogEntry{At: d.i64("entry at"), Cost: d.i64("entry cost")}
			if e.Cost <= 0 {
				d.fail("state %d: log entry %d cost %d not positive", i, j, e.Cost)
			}
			if j > 0 && e.At < s.Log[j-1].At {
				d.fail("state %d: log entry %d out of order", i, j)
			}
			s.Log[j] = e
		}
	case Concurrency:
		k := d.u16("hold count")
		if k > MaxHolds {
			d.fail("state %d: %d holds exceed %d", i, k, MaxHolds)
		}
		if d.err != nil || len(d.b) < k*holdMin {
			d.fail("state %d: truncated holds (%d)", i, k)
			return s
		}
		if k > 0 {
			s.Holds = make([]Hold, k)
		}
		for j := range s.Holds {
			h := Hold{Cost: d.i64("hold cost"), Expires: d.i64("hold expiry")}
			h.ID = string(d.take(int(d.u8("hold id length")), "hold id"))
			if h.Cost <= 0 {
				d.fail("state %d: hold %d cost %d not positive", i, j, h.Cost)
			}
			if j > 0 && h.Expires < s.Holds[j-1].Expires {
				d.fail("state %d: hold %d out of order", i, j)
			}
			s.Holds[j] = h
		}
	default:
		d.fail("state %d: unknown algorithm %d", i, s.Algorithm)
	}
	return s
}
