package keyrec

import (
	"bytes"
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
	b := []byte{recordFormat, 1, 'p', 1, 7} // policy "p", revision 1, version 7
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

// TestRecordFormat1: a record of format 1 (no version field) decodes with
// version 0, as it did; its version and policy peek as such.
func TestRecordFormat1(t *testing.T) {
	r := sampleRecord()
	b2 := Append(nil, &r)
	// Format 1 is format 2 without the version's varint (300: two bytes).
	name := 1 + 1 + len(r.Policy) + 1 // format, length, name, revision (12: one byte)
	b1 := append([]byte{recordFormat1}, b2[1:name]...)
	b1 = append(b1, b2[name+2:]...)
	got, err := Decode(b1)
	if err != nil {
		t.Fatalf("format 1: %v", err)
	}
	if got.Version != 0 || got.Policy != r.Policy || got.Revision != r.Revision || len(got.Dedupe) != 2 {
		t.Fatalf("format 1 decoded as %+v", got)
	}
	if v, ok := PeekVersion(b1); !ok || v != 0 {
		t.Fatalf("PeekVersion(format 1) = %d %v", v, ok)
	}
	if v, ok := PeekVersion(b2); !ok || v != 300 {
		t.Fatalf("PeekVersion(format 2) = %d %v", v, ok)
	}
	if _, ok := PeekVersion([]byte{9}); ok {
		t.Fatal("PeekVersion of a non-record")
	}
}
