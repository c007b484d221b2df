package keyrec

import (
	"bytes"
	"encoding/binary"
	"errors"
	"reflect"
	"testing"

	"github.com/limitmesh/limitmesh/kvstate"
)

func sampleRecord() Record {
	r := Record{Policy: "acme-search", Revision: 12, Version: 300}
	_, r.States = kvstate.DecideAll([]kvstate.Limit{{Algorithm: kvstate.TokenBucket, Rate: 10 * kvstate.Unit, Burst: 40 * kvstate.Unit}},
		nil, 5*kvstate.Second, 3*kvstate.Unit, nil)
	r.AddDedupe(IDHash("a"), 5*kvstate.Second, Decision{Allowed: true, Policy: "acme-search", Revision: 12, Remaining: 37 * kvstate.Unit, ResetAfter: 300_000_000})
	r.AddDedupe(IDHash("b"), 6*kvstate.Second, Decision{Allowed: true, Policy: "acme-search", Revision: 12, RetryAfter: kvstate.Never})
	return r
}

// bigRecord has states whose encoding is over 127 bytes (a two-byte
// length prefix).
func bigRecord() Record {
	r := sampleRecord()
	l := kvstate.Limit{Algorithm: kvstate.TokenBucket, Rate: 3 * kvstate.Unit, Burst: 1000 * kvstate.Unit}
	for i := 0; i < 8; i++ {
		_, st := kvstate.DecideAll([]kvstate.Limit{l}, nil, int64(i+1)*kvstate.Second, int64(i+1)*777_777, nil)
		r.States = append(r.States, st...)
	}
	return r
}

func TestRecordRoundTrip(t *testing.T) {
	if n := len(kvstate.AppendStates(nil, bigRecord().States)); n < 128 {
		t.Fatalf("bigRecord states are %d bytes, want >= 128", n)
	}
	for _, r := range []Record{{}, {Policy: "p", Revision: 1}, sampleRecord(), bigRecord()} {
		b := Append(nil, &r)
		got, err := Decode(b)
		if err != nil {
			t.Fatalf("decode(%x): %v", b, err)
		}
		if len(got.States) == 0 {
			got.States = r.States
		}
		if len(got.Dedupe) == 0 {
			got.Dedupe = r.Dedupe
		}
		if !reflect.DeepEqual(got, r) {
			t.Fatalf("round trip:\n got %+v\nwant %+v", got, r)
		}
		name, rev, ok := PeekPolicy(b)
		if !ok || name != r.Policy || rev != r.Revision {
			t.Fatalf("peek = %q %d %v", name, rev, ok)
		}
	}
}

func TestRecordCorrupt(t *testing.T) {
	good := Append(nil, new(sampleRecord()))
	cases := map[string][]byte{
		"empty":      nil,
		"version":    append([]byte{9}, good[1:]...),
		"truncated":  good[:len(good)-3],
		"trailing":   append(append([]byte(nil), good...), 0),
		"huge count": AppendWithCount(MaxDedupeEntries + 1),
	}
	for name, b := range cases {
		if _, err := Decode(b); !errors.Is(err, ErrCorrupt) {
			t.Errorf("%s: err %v, want ErrCorrupt", name, err)
		}
	}
}

func AppendWithCount(n uint64) []byte {
	b := []byte{recordFormat, 1, 'p', 1, 7, 0} // policy "p", revision 1, version 7, rest_at 0
	st := kvstate.AppendStates(nil, nil)
	b = append(b, byte(len(st)))
	b = append(b, st...)
	return appendUvarint(b, n)
}

func appendUvarint(b []byte, v uint64) []byte {
	for v >= 0x80 {
		b = append(b, byte(v)|0x80)
		v >>= 7
	}
	return append(b, byte(v))
}

func TestRecordDedupeCapAndPrune(t *testing.T) {
	var r Record
	for i := 0; i < MaxDedupeEntries+10; i++ {
		r.AddDedupe([16]byte{byte(i), byte(i >> 8)}, int64(i), Decision{})
	}
	if len(r.Dedupe) != MaxDedupeEntries {
		t.Fatalf("dedupe entries = %d, want cap %d", len(r.Dedupe), MaxDedupeEntries)
	}
	if _, ok := r.FindDedupe([16]byte{9}); ok {
		t.Fatal("oldest entry not dropped")
	}
	if _, ok := r.FindDedupe([16]byte{10}); !ok {
		t.Fatal("entry within cap dropped")
	}
	r.PruneDedupe(DedupeWindow + 20)
	if len(r.Dedupe) != MaxDedupeEntries+10-21 {
		t.Fatalf("after prune: %d entries", len(r.Dedupe))
	}
}

// FuzzDecodeRecord: decoding arbitrary bytes never panics, and whatever
// decodes re-encodes to the same bytes.
func FuzzDecodeRecord(f *testing.F) {
	f.Add(Append(nil, new(sampleRecord())))
	f.Add(Append(nil, &Record{}))
	f.Add(Append(nil, new(bigRecord())))
	f.Add(Append(nil, new(grantRecord())))
	f.Add([]byte{1})
	rest := sampleRecord()
	rest.RestAt = -1 << 63
	f.Add(Append(nil, &rest))
	f.Add(legacy(new(sampleRecord()), recordFormat1))
	f.Add(legacy(new(sampleRecord()), recordFormat2))
	f.Add([]byte{1, 200, 200, 200, 200, 200, 200, 200, 200, 200, 1})
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := Decode(b)
		if err != nil {
			return
		}
		again := Append(nil, &r)
		r2, err := Decode(again)
		if err != nil {
			t.Fatalf("re-encoded Record does not decode: %v", err)
		}
		if !bytes.Equal(Append(nil, &r2), again) {
			t.Fatal("encoding not stable")
		}
	})
}

// legacy returns the encoding of r in an older format (1 or 2): format 3
// without its rest_at (format 2), and without its version too (format 1).
func legacy(r *Record, format byte) []byte {
	b := Append(nil, r)
	head := 1 + 1 + len(r.Policy) + 1 // format, length, name, revision (< 128: one byte)
	_, nv := binary.Uvarint(b[head:])
	_, nr := binary.Varint(b[head+nv:])
	out := append([]byte{format}, b[1:head]...)
	if format == recordFormat2 {
		out = append(out, b[head:head+nv]...)
	}
	return append(out, b[head+nv+nr:]...)
}

// TestRecordOlderFormats: records of format 1 (no version field) and 2 (no
// rest_at) decode with version 0 and RestAt 0 (unknown) as they did; their
// version, rest and policy peek as such.
func TestRecordOlderFormats(t *testing.T) {
	r := sampleRecord()
	r.RestAt = 1_700_000_000_000_000_000
	b3 := Append(nil, &r)
	if b3[0] != 3 {
		t.Fatalf("format %d written, want 3", b3[0])
	}
	for _, c := range []struct {
		format  byte
		version uint64
		restAt  int64
	}{{1, 0, 0}, {2, 300, 0}, {3, 300, r.RestAt}} {
		b := b3
		if c.format < recordFormat {
			b = legacy(&r, c.format)
		}
		got, err := Decode(b)
		if err != nil {
			t.Fatalf("format %d: %v", c.format, err)
		}
		if got.Version != c.version || got.RestAt != c.restAt || got.Policy != r.Policy || got.Revision != r.Revision ||
			len(got.Dedupe) != 2 || !reflect.DeepEqual(got.States, r.States) {
			t.Fatalf("format %d decoded as %+v", c.format, got)
		}
		if v, ok := PeekVersion(b); !ok || v != c.version {
			t.Fatalf("PeekVersion(format %d) = %d %v", c.format, v, ok)
		}
		if at, ok := PeekRestAt(b); !ok || at != c.restAt {
			t.Fatalf("PeekRestAt(format %d) = %d %v", c.format, at, ok)
		}
		if name, rev, ok := PeekPolicy(b); !ok || name != r.Policy || rev != r.Revision {
			t.Fatalf("PeekPolicy(format %d) = %q %d %v", c.format, name, rev, ok)
		}
	}
	for _, bad := range [][]byte{{9}, {0}, {4, 0, 0, 0, 0}, nil, b3[:len(r.Policy)+3]} {
		if _, ok := PeekVersion(bad); ok {
			t.Fatalf("PeekVersion(%x) of a non-record", bad)
		}
		if _, ok := PeekRestAt(bad); ok {
			t.Fatalf("PeekRestAt(%x) of a non-record", bad)
		}
	}
}
