package policies

import (
	"errors"
	"reflect"
	"testing"
)

func FuzzParse(f *testing.F) {
	f.Add("acme-search", []byte(contractExample))
	f.Add("p", []byte(`{"match":{"tenant":"*","plan":"v7 ü"},"key":[],"limits":[{"algorithm":"gcra","rate":"2.5/h","burst":"0.5"},{"name":"w","algorithm":"sliding_log","limit":10000,"window":"1h"}],"mode":"leased","shadow":true}`))
	f.Add("p", []byte(`{"limits":[{"algorithm":"concurrency","limit":3,"window":"30s"},{"algorithm":"fixed_window","limit":1.5,"window":"1ms"},{"algorithm":"sliding_window","limit":"7","window":"2m"}]}`))
	f.Add("p", []byte(`{"limits":[{"algorithm":"token_bucket","rate":"1e3/s","burst":1}]}`))
	f.Add("p", []byte(`{"limits":[{"algorithm":"token_bucket","rate":"9223372036854.775807/s","burst":9223372036854.775807}]}`))
	f.Add("p", []byte(`{"match":{"a":"x","a":"y"},"limits":[]}`))
	f.Add("p", []byte(`{"limits":[{"algorithm":"gcra","rate":"1/s","burst":1}]}{}`))
	f.Add("Bad", []byte(`{}`))
	f.Add("p", []byte(`{"description":"\u0000\ud800","limits":[{"algorithm":"gcra","rate":"1/m","burst":1}]}`))
	f.Add("acme", []byte(acmeMonthly))
	f.Add("p", []byte(`{"limits":[{"algorithm":"gcra","rate":"1000/d","burst":"2.5"},{"name":"q","algorithm":"quota","limit":"1000000000000","period":"week"}],"max_keys":"1"}`))
	f.Add("p", []byte(`{"limits":[{"algorithm":"quota","limit":1000000000000.000001,"period":"day","window":"1h"}],"max_keys":0}`))
	f.Add("p", []byte(`{"mode":"leased","lease":{"size":"0.5","ttl":"100ms","max_outstanding":40},"limits":[{"algorithm":"token_bucket","rate":"0.000001/d","burst":40}]}`))
	f.Add("p", []byte(`{"mode":"leased","lease":{"size":41},"limits":[{"algorithm":"token_bucket","rate":"10/s","burst":40}]}`))
	f.Add("p", []byte(`{"lease":null,"max_keys":null,"limits":[{"algorithm":"quota","limit":0.000001,"period":"hour"}],"mode":"leased"}`))
	f.Add("p", []byte(`{"mode":"async","lease":{},"limits":[{"algorithm":"quota","limit":1,"period":"month"}],"max_keys":9223372036854775808}`))
	f.Fuzz(func(t *testing.T, name string, doc []byte) {
		p, err := Parse(name, doc)
		if err != nil {
			var pe *Error
			if !errors.As(err, &pe) || !errors.Is(err, ErrInvalid) {
				t.Fatalf("error %v (%T) is not an *Error matching ErrInvalid", err, err)
			}
			return
		}
		if err := p.Validate(); err != nil {
			t.Fatalf("accepted policy does not re-validate: %v\n%s", err, doc)
		}
		// The canonical document parses back to the same policy.
		canon, err := p.MarshalJSON()
		if err != nil {
			t.Fatal(err)
		}
		q, err := Parse(name, canon)
		if err != nil {
			t.Fatalf("canonical form rejected: %v\n%s", err, canon)
		}
		if !reflect.DeepEqual(p, q) {
			t.Fatalf("round trip changed the policy:\n%+v\n%+v\n%s", p, q, canon)
		}
	})
}

func FuzzParseCost(f *testing.F) {
	for _, s := range []string{"1", "3", "0.5", "0.000001", "0.0000001", "1e3", "1000000000", "1000000001", "-1", "0", "007", "", "1.", ".5", "99999999999999999999.5"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		v, err := ParseCost(s)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("ParseCost(%q): %v does not match ErrInvalid", s, err)
			}
			return
		}
		if v <= 0 || v > MaxCost {
			t.Fatalf("ParseCost(%q) = %d, out of (0, %d]", s, v, MaxCost)
		}
		// Formatting the micro-units gives a cost that parses to the same value.
		if w, err := ParseCost(formatMicro(v)); err != nil || w != v {
			t.Fatalf("ParseCost(%q) = %d; formatted %q parses to %d, %v", s, v, formatMicro(v), w, err)
		}
		// The slow path agrees with the fast path.
		if w, reason := parseMicro(s, MaxCost); reason != "" || w != v {
			t.Fatalf("parseMicro(%q) = %d, %q; ParseCost gave %d", s, w, reason, v)
		}
	})
}
