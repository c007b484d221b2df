package shadow

import (
	"encoding/json"
	"reflect"
	"testing"
)

// FuzzUnits: a quantity in a summary (rl_shadow, read by `shadow report`
// and the dashboard) never panics its reader; what it reads writes back
// to the same micro-units.
func FuzzUnits(f *testing.F) {
	for _, s := range []string{`1800`, `2.5`, `"0.000001"`, `-3`, `999999999999.999999`, `1e3`, `"-"`, `0.1234567`, `-0`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var u Units
		if err := u.UnmarshalJSON(b); err != nil {
			return
		}
		out, err := u.MarshalJSON()
		if err != nil {
			t.Fatal(err)
		}
		var v Units
		if err := v.UnmarshalJSON(out); err != nil || v != u {
			t.Fatalf("%q reads as %d, written %q, read back %d (%v)", b, u, out, v, err)
		}
	})
}

// FuzzSummaryJSON: a stored summary never panics its reader; one that
// decodes encodes and decodes again to the same summary.
func FuzzSummaryJSON(f *testing.F) {
	f.Add([]byte(`{"policy":"acme-search-v2","revision":31,"since_us":1764752400000000,"evaluated":1000,
 "would_allow":400,"would_deny":600,"would_deny_units":1800.5,"live_denied":500,"both_denied":450,
 "only_candidate_denied":150,"only_live_denied":50,"top_denied":[{"key":"p.acme-search-v2.tenant=acme","would_deny":600}],
 "series":[{"t_us":1,"evaluated":2,"would_deny":1,"live_denied":0}]}`))
	f.Add([]byte(`{"would_deny_units":"2.5","top_denied":null}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		var s Summary
		if json.Unmarshal(b, &s) != nil {
			return
		}
		out, err := json.Marshal(&s)
		if err != nil {
			t.Fatalf("Marshal: %v", err)
		}
		var again Summary
		if err := json.Unmarshal(out, &again); err != nil {
			t.Fatalf("%s does not decode: %v", out, err)
		}
		if !reflect.DeepEqual(s, again) {
			t.Fatalf("round trip: %+v, then %+v", s, again)
		}
	})
}
