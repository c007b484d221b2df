package keyrec

import (
	"errors"
	"reflect"
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

func TestUsageRoundTrip(t *testing.T) {
	for _, us := range [][]Usage{nil, sampleUsage(t)} {
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

func TestUsageCorrupt(t *testing.T) {
	good := AppendUsage(nil, sampleUsage(t))
	for name, b := range map[string][]byte{
		"empty":     nil,
		"truncated": good[:len(good)-2],
		"trailing":  append(append([]byte(nil), good...), 0),
		"huge n":    {0xff, 0xff, 0xff, 0x0f},
		"zero cost": AppendUsage(nil, []Usage{{Cost: 0, Desc: sampleUsage(t)[0].Desc}}),
		"bad dim":   AppendUsage(nil, []Usage{{Cost: 1, Desc: policies.Descriptor{{Name: "Bad", Value: "x"}}}}),
	} {
		if _, err := DecodeUsage(b); !errors.Is(err, ErrCorrupt) {
			t.Errorf("%s: err %v, want ErrCorrupt", name, err)
		}
	}
}

// FuzzDecodeUsage: no input panics; what decodes encodes back to itself.
func FuzzDecodeUsage(f *testing.F) {
	f.Add(AppendUsage(nil, sampleUsage(f)))
	f.Add([]byte{0})
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
