package mesh

import (
	"bytes"
	"errors"
	"reflect"
	"testing"

	"github.com/limitmesh/limitmesh/kvstate"
)

func sampleRecord() record {
	r := record{policy: "acme-search", revision: 12}
	_, r.states = kvstate.DecideAll([]kvstate.Limit{{Algorithm: kvstate.TokenBucket, Rate: 10 * kvstate.Unit, Burst: 40 * kvstate.Unit}},
		nil, 5*kvstate.Second, 3*kvstate.Unit, nil)
	r.addDedupe(idHash("a"), 5*kvstate.Second, decision{Allowed: true, Policy: "acme-search", Revision: 12, Remaining: 37 * kvstate.Unit, ResetAfter: 300_000_000})
	r.addDedupe(idHash("b"), 6*kvstate.Second, decision{ShadowDenied: true, Allowed: true, Policy: "acme-search", Revision: 12, RetryAfter: kvstate.Never})
	return r
}

// bigRecord has states whose encoding is over 127 bytes (a two-byte
// length prefix).
func bigRecord() record {
	r := sampleRecord()
	l := kvstate.Limit{Algorithm: kvstate.TokenBucket, Rate: 3 * kvstate.Unit, Burst: 1000 * kvstate.Unit}
	for i := 0; i < 8; i++ {
		_, st := kvstate.DecideAll([]kvstate.Limit{l}, nil, int64(i+1)*kvstate.Second, int64(i+1)*777_777, nil)
		r.states = append(r.states, st...)
	}
	return r
}

func TestRecordRoundTrip(t *testing.T) {
	if n := len(kvstate.AppendStates(nil, bigRecord().states)); n < 128 {
		t.Fatalf("bigRecord states are %d bytes, want >= 128", n)
	}
	for _, r := range []record{{}, {policy: "p", revision: 1}, sampleRecord(), bigRecord()} {
		b := appendRecord(nil, &r)
		got, err := decodeRecord(b)
		if err != nil {
			t.Fatalf("decode(%x): %v", b, err)
		}
		if len(got.states) == 0 {
			got.states = r.states
		}
		if len(got.dedupe) == 0 {
			got.dedupe = r.dedupe
		}
		if !reflect.DeepEqual(got, r) {
			t.Fatalf("round trip:\n got %+v\nwant %+v", got, r)
		}
		name, rev, ok := peekRecordPolicy(b)
		if !ok || name != r.policy || rev != r.revision {
			t.Fatalf("peek = %q %d %v", name, rev, ok)
		}
	}
}

func TestRecordCorrupt(t *testing.T) {
	good := appendRecord(nil, new(sampleRecord()))
	cases := map[string][]byte{
		"empty":      nil,
		"version":    append([]byte{9}, good[1:]...),
		"truncated":  good[:len(good)-3],
		"trailing":   append(append([]byte(nil), good...), 0),
		"huge count": appendRecordWithCount(MaxDedupeEntries + 1),
	}
	for name, b := range cases {
		if _, err := decodeRecord(b); !errors.Is(err, ErrCorruptRecord) {
			t.Errorf("%s: err %v, want ErrCorruptRecord", name, err)
		}
	}
}

func appendRecordWithCount(n uint64) []byte {
	b := []byte{recordVersion, 1, 'p', 1}
	b = append(b, 0) // no states bytes... replaced below
	st := kvstate.AppendStates(nil, nil)
	b = append(b[:4], byte(len(st)))
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
	var r record
	for i := 0; i < MaxDedupeEntries+10; i++ {
		r.addDedupe([16]byte{byte(i), byte(i >> 8)}, int64(i), decision{})
	}
	if len(r.dedupe) != MaxDedupeEntries {
		t.Fatalf("dedupe entries = %d, want cap %d", len(r.dedupe), MaxDedupeEntries)
	}
	if _, ok := r.findDedupe([16]byte{9}); ok {
		t.Fatal("oldest entry not dropped")
	}
	if _, ok := r.findDedupe([16]byte{10}); !ok {
		t.Fatal("entry within cap dropped")
	}
	r.pruneDedupe(DedupeWindow + 20)
	if len(r.dedupe) != MaxDedupeEntries+10-21 {
		t.Fatalf("after prune: %d entries", len(r.dedupe))
	}
}

// FuzzDecodeRecord: decoding arbitrary bytes never panics, and whatever
// decodes re-encodes to the same bytes.
func FuzzDecodeRecord(f *testing.F) {
	f.Add(appendRecord(nil, new(sampleRecord())))
	f.Add(appendRecord(nil, &record{}))
	f.Add(appendRecord(nil, new(bigRecord())))
	f.Add([]byte{1})
	f.Add([]byte{1, 200, 200, 200, 200, 200, 200, 200, 200, 200, 1})
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := decodeRecord(b)
		if err != nil {
			return
		}
		again := appendRecord(nil, &r)
		r2, err := decodeRecord(again)
		if err != nil {
			t.Fatalf("re-encoded record does not decode: %v", err)
		}
		if !bytes.Equal(appendRecord(nil, &r2), again) {
			t.Fatal("encoding not stable")
		}
	})
}
