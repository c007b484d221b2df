package mesh

import (
	"strings"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/policies"
)

func mustParse(t *testing.T, doc string) *policies.Policy {
	t.Helper()
	p, err := policies.Parse("p", []byte(doc))
	if err != nil {
		t.Fatalf("parse %s: %v", doc, err)
	}
	return p
}

func TestOvershootBound(t *testing.T) {
	const acme = `"limits":[{"name":"rate","algorithm":"token_bucket","rate":"10/s","burst":40}]`
	const win = `"limits":[{"name":"w","algorithm":"fixed_window","limit":100,"window":"1m"}]`
	const two = `"limits":[{"name":"rate","algorithm":"gcra","rate":"0.5/s","burst":2.5},{"name":"day","algorithm":"sliding_log","limit":7,"window":"24h"}]`
	for _, tc := range []struct {
		doc        string
		bp         BoundParams
		units      []int64 // micro-units per limit
		arithmetic []string
		per        []string
	}{
		{`{"match":{},` + acme + `}`, BoundParams{Nodes: 3}, []int64{0}, []string{"0"}, []string{""}},
		{`{"match":{},` + win + `,"mode":"strict"}`, BoundParams{Nodes: 9}, []int64{0}, []string{"0"}, []string{""}},
		{`{"match":{},` + acme + `,"mode":"local"}`, BoundParams{Nodes: 3}, []int64{80e6}, []string{"(3 − 1) × 40 = 80"}, []string{""}},
		{`{"match":{},` + acme + `,"mode":"local"}`, BoundParams{Nodes: 6}, []int64{200e6}, []string{"(6 − 1) × 40 = 200"}, []string{""}},
		{`{"match":{},` + acme + `,"mode":"local"}`, BoundParams{}, []int64{0}, []string{"(1 − 1) × 40 = 0"}, []string{""}},
		{`{"match":{},` + win + `,"mode":"local"}`, BoundParams{Nodes: 2}, []int64{100e6}, []string{"(2 − 1) × 100 = 100"}, []string{"window"}},
		// async, buckets: burst + rate × (interval + write timeout).
		{`{"match":{},` + acme + `,"mode":"async"}`, BoundParams{}, []int64{46_000_000},
			[]string{"40 + 10/s × (100ms + 500ms) = 46"}, []string{""}},
		{`{"match":{},` + acme + `,"mode":"async"}`, BoundParams{Nodes: 5, AsyncInterval: time.Second, WriteTimeout: time.Second}, []int64{60e6},
			[]string{"40 + 10/s × (1s + 1s) = 60"}, []string{""}},
		// 0.5/s × 0.52 s = 0.26 units; a fraction of a micro-unit rounds up.
		{`{"match":{},` + two + `,"mode":"async"}`, BoundParams{AsyncInterval: time.Nanosecond, WriteTimeout: time.Nanosecond}, []int64{2_500_001, 7e6},
			[]string{"2.5 + 0.5/s × (1ns + 1ns) = 2.500001", "limit 7 = 7"}, []string{"", "window"}},
	} {
		p := mustParse(t, tc.doc)
		b, err := OvershootBound(p, tc.bp)
		if err != nil {
			t.Fatalf("%s: %v", tc.doc, err)
		}
		if b.Mode != p.Mode || len(b.Limits) != len(tc.units) {
			t.Fatalf("%s: %+v", tc.doc, b)
		}
		for i, l := range b.Limits {
			if l.Units != tc.units[i] || l.Arithmetic != tc.arithmetic[i] || l.Per != tc.per[i] || l.Name != p.Limits[i].Name {
				t.Errorf("%s %+v limit %d: got %+v, want %d micro-units, %q per %q", tc.doc, tc.bp, i, l, tc.units[i], tc.arithmetic[i], tc.per[i])
			}
		}
	}
}

// TestOvershootBoundLeased: a leased key's bound is its max_outstanding
// (default: the smallest limit's capacity), whatever the node count; per
// window for window algorithms.
func TestOvershootBoundLeased(t *testing.T) {
	p := mustParse(t, `{"match":{},"limits":[{"name":"rate","algorithm":"token_bucket","rate":"10/s","burst":40},{"name":"w","algorithm":"fixed_window","limit":100,"window":"1m"}],"mode":"leased","lease":{"size":10,"max_outstanding":"25.5"}}`)
	b, err := OvershootBound(p, BoundParams{Nodes: 6})
	if err != nil {
		t.Fatal(err)
	}
	want := "leased: rate: max_outstanding 25.5 = 25.5 units\nleased: w: max_outstanding 25.5 = 25.5 units per window"
	if got := b.String(); got != want || b.Limits[0].Units != 25_500_000 {
		t.Fatalf("leased bound %q (%+v), want %q", got, b, want)
	}
	p = mustParse(t, `{"match":{},"limits":[{"algorithm":"token_bucket","rate":"10/s","burst":40}],"mode":"leased"}`)
	if b, _ := OvershootBound(p, BoundParams{Nodes: 2}); b.Limits[0].Units != 40*kvstate.Unit {
		t.Fatalf("default leased bound %+v, want the burst", b)
	}
}

func TestOvershootBoundSaturates(t *testing.T) {
	p := mustParse(t, `{"match":{},"limits":[{"algorithm":"token_bucket","rate":"1000000000/s","burst":1000000000}],"mode":"async"}`)
	b, err := OvershootBound(p, BoundParams{AsyncInterval: 1000 * time.Hour, WriteTimeout: time.Hour})
	if err != nil || b.Limits[0].Units != 1<<63-1 {
		t.Fatalf("huge async bound: %+v %v, want saturation", b, err)
	}
	p = mustParse(t, `{"match":{},"limits":[{"algorithm":"token_bucket","rate":"1/s","burst":1000000000}],"mode":"local"}`)
	if b, _ := OvershootBound(p, BoundParams{Nodes: 1 << 40}); b.Limits[0].Units != 1<<63-1 {
		t.Fatalf("huge local bound: %+v, want saturation", b)
	}
}

func TestBoundString(t *testing.T) {
	p := mustParse(t, `{"match":{},"limits":[{"name":"rate","algorithm":"token_bucket","rate":"10/s","burst":40},{"name":"w","algorithm":"fixed_window","limit":5,"window":"1s"}],"mode":"local"}`)
	b, _ := OvershootBound(p, BoundParams{Nodes: 3})
	want := "local: rate: (3 − 1) × 40 = 80 units\nlocal: w: (3 − 1) × 5 = 10 units per window"
	if got := b.String(); got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}
	if got := FormatLimit(p.Limits[1].Limit); !strings.Contains(got, "fixed_window, limit 5 per 1s") {
		t.Errorf("FormatLimit = %q", got)
	}
}

func TestParsePolicyModes(t *testing.T) {
	if _, err := ParsePolicy("m", []byte(`{"match":{},"limits":[{"algorithm":"concurrency","limit":5,"window":"1m"}],"mode":"leased"}`)); err == nil ||
		!strings.Contains(err.Error(), `limits[0].algorithm: "concurrency" cannot be leased`) {
		t.Errorf("a leased concurrency limit: %v", err)
	}
	for mode, ok := range map[string]bool{"strict": true, "async": true, "local": true, "leased": true} {
		_, err := ParsePolicy("m", []byte(`{"match":{},"limits":[{"algorithm":"token_bucket","rate":"1/s","burst":1}],"mode":"`+mode+`"}`))
		if (err == nil) != ok {
			t.Errorf("mode %s: err %v, want accepted=%v", mode, err, ok)
		}
	}
}
