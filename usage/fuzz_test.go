package usage

import (
	"errors"
	"strconv"
	"testing"
)

// FuzzParseTotals: a stored totals entry (rl_ledger, writable by whoever
// may write the bucket) never panics the parser or the arithmetic the
// ledger then does with it; what parses is returned in the stored form
// that parses back to the same totals, and more units can be added to it.
func FuzzParseTotals(f *testing.F) {
	f.Add([]byte(`{"policy":"p","key":"p.p.tenant=a","period":"2026-12","allowed":3,"allowed_units":"2.5","denied":1,"denied_units":"1","seq":7,"last_us":1764752400123456}`))
	f.Add([]byte(`{"policy":"p","key":"k","period":"2026-12-03","allowed":0,"allowed_units":"0","denied":0,"denied_units":"0","seq":0}`))
	f.Add([]byte(`{"allowed_units":"1E+5","denied_units":"0.000001"}`))
	f.Add([]byte(`{"allowed_units":"-1","denied_units":"0"}`))
	f.Add([]byte(`{"allowed_units":"1E+99999","denied_units":"0"}`))
	f.Add([]byte(`{"allowed_units":"0","denied_units":"1E-99999"}`))
	f.Add([]byte(`null`))
	f.Fuzz(func(t *testing.T, data []byte) {
		tot, err := ParseTotals(data)
		if err != nil {
			if !errors.Is(err, ErrCorruptEntry) {
				t.Fatalf("error %v does not match ErrCorruptEntry", err)
			}
			return
		}
		b, err := tot.MarshalJSON()
		if err != nil {
			t.Fatalf("MarshalJSON of parsed totals: %v", err)
		}
		again, err := ParseTotals(b)
		if err != nil {
			t.Fatalf("stored form %s does not parse: %v", b, err)
		}
		if again.AllowedUnits.Cmp(&tot.AllowedUnits) != 0 || again.DeniedUnits.Cmp(&tot.DeniedUnits) != 0 ||
			again.Allowed != tot.Allowed || again.Denied != tot.Denied || again.Key != tot.Key {
			t.Fatalf("round trip: %+v, then %+v", tot, again)
		}
		addMicro(&tot.AllowedUnits, 1_500_000)
		addMicro(&tot.DeniedUnits, 1)
		_ = FormatUnits(&tot.AllowedUnits)
		_, _ = MicroUnits(&tot.DeniedUnits)
	})
}

// FuzzParseMarks: an origin's watermark entry never panics the parser;
// what parses encodes and parses back to the same positions.
func FuzzParseMarks(f *testing.F) {
	f.Add([]byte(`{"origin":"n1.ab12","seen_us":1764752400123456,"marks":{"p":[42,7],"_":[1,0]},"seq":3}`))
	f.Add([]byte(`{"marks":{"p":[1,4294967296]}}`))
	f.Add([]byte(`{"marks":null}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		m, err := parseMarks(data)
		if err != nil {
			if !errors.Is(err, ErrCorruptEntry) {
				t.Fatalf("error %v does not match ErrCorruptEntry", err)
			}
			return
		}
		b, err := m.encode()
		if err != nil {
			t.Fatalf("encode: %v", err)
		}
		again, err := parseMarks(b)
		if err != nil {
			t.Fatalf("encoded %s does not parse: %v", b, err)
		}
		if len(again.pos) != len(m.pos) {
			t.Fatalf("positions %v, then %v", m.pos, again.pos)
		}
		for p, v := range m.pos {
			if again.pos[p] != v {
				t.Fatalf("position of %q: %v, then %v", p, v, again.pos[p])
			}
		}
	})
}

// FuzzParseJournalID: a record id (from the usage stream) never panics the
// parser, and an id it accepts is the one JournalID writes for what it
// returns: one position has one id, so the ledger's watermarks cannot take
// one record for another.
func FuzzParseJournalID(f *testing.F) {
	f.Add("n1.ab12.j42.7")
	f.Add("n1.ab12.3")
	f.Add("a.j01.2")
	f.Add("a.b.c.j18446744073709551615.4294967295")
	f.Fuzz(func(t *testing.T, id string) {
		origin, pos, ok := ParseJournalID(id)
		if !ok {
			return
		}
		if want := origin + ".j" + strconv.FormatUint(pos.JSeq, 10) + "." + strconv.FormatUint(uint64(pos.Idx), 10); want != id {
			t.Fatalf("ParseJournalID(%q) = %q, %v: that position's id is %q", id, origin, pos, want)
		}
	})
}
