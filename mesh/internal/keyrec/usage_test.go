package keyrec

import (
	"bytes"
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/limitmesh/limitmesh/policies"
)

func sampleUsage(t testing.TB) []Usage {
	d, err := policies.NewDescriptor([]policies.Dim{{Name: "tenant", Value: "acme"}, {Name: "plan", Value: "v 7"}})
	if err != nil {
		t.Fatal(err)
	}
	return []Usage{
		{At: 1764752400123456789, Revision: 12, Cost: 3_000_000, Desc: d, RequestID: "7f1c2e"},
		{At: 1764752400123456999, Revision: 12, Cost: 2_500_000, Desc: d},
	}
}

// sampleReserved is usage with reservations' ends (CONTRACT §10): a
// release (cost 0), a settle, and an ordinary admission beside them.
func sampleReserved(t testing.TB) []Usage {
	us := sampleUsage(t)
	return []Usage{
		{At: 1764752400123457000, Revision: 12, Cost: 0, Desc: us[0].Desc, Reservation: "r7.00000000002a.p.acme.tenant=acme"},
		us[0],
		{At: 1764752400123457001, Revision: 13, Cost: 1_500_000, Desc: us[0].Desc, RequestID: "q", Reservation: "r8.é" + strings.Repeat("x", 123)}, // 128 bytes,
	}
}

func TestUsageRoundTrip(t *testing.T) {
	for _, us := range [][]Usage{nil, sampleUsage(t), sampleReserved(t)} {
		b := AppendUsage(nil, us)
		got, err := DecodeUsage(b)
		if err != nil {
			t.Fatalf("decode %x: %v", b, err)
		}
		if len(us) == 0 && len(got) == 0 {
			continue
		}
		if !reflect.DeepEqual(got, us) {
			t.Fatalf("round trip:\n got %+v\nwant %+v", got, us)
		}
	}
}

// The golden blocks are written out from the format comment of
// AppendUsage, not taken from the encoder: journals hold them. Usage
// without reservations is of form 1, byte for byte what it was before
// reservations; with one, of form 2.
func TestUsageGolden(t *testing.T) {
	d, err := policies.NewDescriptor([]policies.Dim{{Name: "t", Value: "a"}})
	if err != nil {
		t.Fatal(err)
	}
	plain := []Usage{{At: 5, Revision: 3, Cost: 2, Desc: d, RequestID: "q"}}
	form1 := []byte{
		0x01,             // one entry
		0x0a, 0x03, 0x04, // at 5, revision 3, cost 2 (at and cost zig-zag)
		0x01, 'q', // request_id "q"
		0x01, 0x01, 't', 0x01, 'a', // one dimension t=a
	}
	reserved := []Usage{plain[0], {At: 6, Revision: 3, Cost: 0, Desc: d, Reservation: "r1"}}
	form2 := []byte{
		0x00, 0x02, // form 2
		0x02,                                                    // two entries
		0x0a, 0x03, 0x04, 0x01, 'q', 0x01, 0x01, 't', 0x01, 'a', // as in form 1
		0x00,                                               // no reservation
		0x0c, 0x03, 0x00, 0x00, 0x01, 0x01, 't', 0x01, 'a', // at 6, cost 0, no request_id
		0x02, 'r', '1', // reservation "r1"
	}
	for _, c := range []struct {
		us   []Usage
		want []byte
	}{{plain, form1}, {reserved, form2}, {nil, []byte{0}}} {
		if got := AppendUsage(nil, c.us); !bytes.Equal(got, c.want) {
			t.Errorf("%+v:\n got %x\nwant %x", c.us, got, c.want)
		}
		got, err := DecodeUsage(c.want)
		if err != nil || len(c.us) > 0 && !reflect.DeepEqual(got, c.us) || len(got) != len(c.us) {
			t.Errorf("%x decoded as %+v, %v", c.want, got, err)
		}
	}
	// Form 2 without reservations (no writer's) decodes too.
	if got, err := DecodeUsage(append(append([]byte{0, 2}, form1...), 0)); err != nil || !reflect.DeepEqual(got, plain) {
		t.Errorf("form 2 of no reservation: %+v, %v", got, err)
	}
}

func TestUsageCorrupt(t *testing.T) {
	good := AppendUsage(nil, sampleUsage(t))
	reserved := AppendUsage(nil, sampleReserved(t))
	desc := sampleUsage(t)[0].Desc
	// noReservation is a block of form 2 of u, which has no reservation
	// (the encoder writes form 1 for it).
	noReservation := func(u Usage) []byte {
		return append(append([]byte{0, 2}, AppendUsage(nil, []Usage{u})...), 0)
	}
	short := AppendUsage(nil, []Usage{{Cost: 1, Desc: desc, Reservation: "r"}})
	short[len(short)-2] = 5 // the reservation's length: 5 bytes, of which 1 is there
	for name, b := range map[string][]byte{
		"empty":                        nil,
		"truncated":                    good[:len(good)-2],
		"trailing":                     append(append([]byte(nil), good...), 0),
		"huge n":                       {0xff, 0xff, 0xff, 0x0f},
		"zero cost":                    AppendUsage(nil, []Usage{{Cost: 0, Desc: desc}}),
		"bad dim":                      AppendUsage(nil, []Usage{{Cost: 1, Desc: policies.Descriptor{{Name: "Bad", Value: "x"}}}}),
		"form 3":                       append([]byte{0, 3}, reserved[2:]...),
		"form 0":                       append([]byte{0, 0}, reserved[2:]...),
		"form 2 truncated":             reserved[:len(reserved)-1],
		"form 2 trailing":              append(append([]byte(nil), reserved...), 0),
		"form 2 marker only":           {0, 2},
		"zero cost, no reservation":    noReservation(Usage{Cost: 0, Desc: desc}),
		"negative cost, reservation":   AppendUsage(nil, []Usage{{Cost: -1, Desc: desc, Reservation: "r"}}),
		"reservation of 129 bytes":     AppendUsage(nil, []Usage{{Desc: desc, Reservation: strings.Repeat("r", 129)}}),
		"reservation with a newline":   AppendUsage(nil, []Usage{{Desc: desc, Reservation: "r\n"}}),
		"reservation with a C1":        AppendUsage(nil, []Usage{{Desc: desc, Reservation: "r\u0085"}}),
		"reservation not UTF-8":        AppendUsage(nil, []Usage{{Desc: desc, Reservation: "r\xc3"}}),
		"reservation beyond the block": short,
	} {
		if _, err := DecodeUsage(b); !errors.Is(err, ErrCorrupt) {
			t.Errorf("%s: err %v, want ErrCorrupt", name, err)
		}
	}
	// The bounds just inside: cost 0 with a reservation, 128 bytes of it.
	for _, u := range []Usage{{Desc: desc, Reservation: "r"}, {Cost: 1, Desc: desc, Reservation: strings.Repeat("é", 64)}} {
		if got, err := DecodeUsage(AppendUsage(nil, []Usage{u})); err != nil || got[0].Reservation != u.Reservation {
			t.Errorf("%+v: %+v, %v", u, got, err)
		}
	}
}

// FuzzDecodeUsage: no input panics; what decodes encodes back to itself.
func FuzzDecodeUsage(f *testing.F) {
	f.Add(AppendUsage(nil, sampleUsage(f)))
	f.Add(AppendUsage(nil, sampleReserved(f)))
	f.Add([]byte{0})
	f.Add([]byte{0, 2, 0})
	f.Add([]byte{1, 2, 3})
	f.Fuzz(func(t *testing.T, b []byte) {
		us, err := DecodeUsage(b)
		if err != nil {
			return
		}
		again, err := DecodeUsage(AppendUsage(nil, us))
		if err != nil || !reflect.DeepEqual(again, us) && len(us) != 0 {
			t.Fatalf("re-encoding %+v: %+v %v", us, again, err)
		}
	})
}
