package keyrec

import (
	"bytes"
	"errors"
	"reflect"
	"testing"

	"github.com/limitmesh/limitmesh/kvstate"
)

func grantRecord() Record {
	r := sampleRecord()
	r.GrantSeq = 9
	r.Grants = []Grant{
		{ID: 7, Epoch: 41, Holder: "eu-1", Units: 10 * kvstate.Unit, Spent: 3 * kvstate.Unit, At: 5 * kvstate.Second, Expires: 7 * kvstate.Second},
		{ID: 9, Epoch: 42, Holder: "us-2", Units: 500_000, At: 6 * kvstate.Second, Expires: 8 * kvstate.Second},
	}
	return r
}

// TestRecordGrantsRoundTrip: grants and the grant sequence survive an
// encoding; a record with neither encodes exactly as before (no section),
// and a record with a sequence but no grants keeps the sequence.
func TestRecordGrantsRoundTrip(t *testing.T) {
	seqOnly := sampleRecord()
	seqOnly.GrantSeq = 3
	for _, r := range []Record{grantRecord(), seqOnly} {
		b := Append(nil, &r)
		got, err := Decode(b)
		if err != nil {
			t.Fatalf("decode: %v", err)
		}
		if !reflect.DeepEqual(got, r) {
			t.Fatalf("round trip:\n got %+v\nwant %+v", got, r)
		}
		if v, ok := PeekVersion(b); !ok || v != r.Version {
			t.Fatalf("PeekVersion = %d %v", v, ok)
		}
	}
	plain := sampleRecord()
	withEmpty := sampleRecord()
	withEmpty.Grants = []Grant{}
	if !bytes.Equal(Append(nil, &plain), Append(nil, &withEmpty)) {
		t.Fatal("an empty grant list changed the encoding")
	}
	g := grantRecord()
	if p, ok := g.Grant(9); !ok || p.Holder != "us-2" {
		t.Fatalf("Grant(9) = %+v %v", p, ok)
	}
	if _, ok := g.Grant(8); ok {
		t.Fatal("Grant(8) found")
	}
}

// TestRecordGrantsCorrupt: a grants section that is invalid makes the
// record corrupt (never a record silently without its grants).
func TestRecordGrantsCorrupt(t *testing.T) {
	base := sampleRecord()
	plain := Append(nil, &base)
	section := func(body ...byte) []byte {
		b := append([]byte(nil), plain...)
		b = append(b, sectionGrants, byte(len(body)))
		return append(b, body...)
	}
	good := grantRecord()
	enc := Append(nil, &good)
	mutate := func(f func(*Record)) []byte {
		r := grantRecord()
		f(&r)
		return Append(nil, &r)
	}
	cases := map[string][]byte{
		"unknown tag":      append(append([]byte(nil), plain...), 2, 0),
		"repeated":         append(append([]byte(nil), enc...), enc[len(plain):]...),
		"empty section":    section(0, 0),
		"truncated":        enc[:len(enc)-1],
		"trailing in body": section(1, 0, 0),
		"id above seq":     mutate(func(r *Record) { r.GrantSeq = 8 }),
		"zero id":          mutate(func(r *Record) { r.Grants[0].ID = 0 }),
		"no units":         mutate(func(r *Record) { r.Grants[1].Units = 0 }),
		"overspent":        mutate(func(r *Record) { r.Grants[0].Spent = r.Grants[0].Units + 1 }),
		"negative spent":   mutate(func(r *Record) { r.Grants[0].Spent = -1 }),
		"expires early":    mutate(func(r *Record) { r.Grants[0].Expires = r.Grants[0].At - 1 }),
		"no holder":        mutate(func(r *Record) { r.Grants[0].Holder = "" }),
		"too many":         mutate(func(r *Record) { r.Grants = make([]Grant, MaxGrants+1) }),
	}
	for name, b := range cases {
		if _, err := Decode(b); !errors.Is(err, ErrCorrupt) {
			t.Errorf("%s: err %v, want ErrCorrupt", name, err)
		}
	}
}
