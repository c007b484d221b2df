package service

import (
	"github.com/limitmesh/limitmesh/mesh/internal/fail"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"

	"errors"
	"strings"
	"testing"

	"github.com/limitmesh/limitmesh/kvstate"
)

func TestDecodeRequest(t *testing.T) {
	ok := []struct {
		body   string
		cost   int64
		id     string
		dryRun bool
		dims   int
	}{
		{`{"descriptor":{"tenant":"acme"}}`, kvstate.Unit, "", false, 1},
		{`{"descriptor":{"tenant":"acme","plan":"v 7"},"cost":3}`, 3 * kvstate.Unit, "", false, 2},
		{`{"descriptor":{"tenant":"acme"},"cost":"0.5","request_id":"r1","dry_run":true,"extra":[1]}`, 500_000, "r1", true, 1},
		{`{"descriptor":{"tenant":"acme"},"cost":null}`, kvstate.Unit, "", false, 1},
		{`{"descriptor":{"tenant":"acme"},"cost":1000000000}`, 1_000_000_000 * kvstate.Unit, "", false, 1},
	}
	for _, c := range ok {
		r, err := decodeRequest([]byte(c.body))
		if err != nil {
			t.Errorf("%s: %v", c.body, err)
			continue
		}
		if r.cost != c.cost || r.id != c.id || r.dryRun != c.dryRun || len(r.desc) != c.dims {
			t.Errorf("%s: got %+v", c.body, r)
		}
	}
	bad := []string{
		``, `{`, `[]`, `{}`, `{"descriptor":{}}`, `{"descriptor":null}`,
		`{"descriptor":{"Tenant":"a"}}`, `{"descriptor":{"tenant":""}}`, `{"descriptor":{"tenant":1}}`,
		`{"descriptor":{"tenant":"a\u0001"}}`, `{"descriptor":{"tenant":"` + strings.Repeat("x", 129) + `"}}`,
		`{"descriptor":{"tenant":"a"},"cost":0}`, `{"descriptor":{"tenant":"a"},"cost":-1}`,
		`{"descriptor":{"tenant":"a"},"cost":1e3}`, `{"descriptor":{"tenant":"a"},"cost":"abc"}`,
		`{"descriptor":{"tenant":"a"},"cost":1000000001}`, `{"descriptor":{"tenant":"a"},"cost":0.0000001}`,
		`{"descriptor":{"tenant":"a"},"cost":true}`,
		`{"descriptor":{"tenant":"a"},"request_id":"` + strings.Repeat("x", 129) + `"}`,
		`{"descriptor":{"tenant":"a"},"dry_run":"yes"}`,
	}
	for _, b := range bad {
		if _, err := decodeRequest([]byte(b)); !errors.Is(err, fail.ErrBadRequest) {
			t.Errorf("%s: err %v, want fail.ErrBadRequest", b, err)
		}
	}
	big := `{"descriptor":{"tenant":"a"},"pad":"` + strings.Repeat("x", MaxRequestBytes) + `"}`
	if _, err := decodeRequest([]byte(big)); !errors.Is(err, fail.ErrTooLarge) {
		t.Errorf("oversized: err %v, want fail.ErrTooLarge", err)
	}
}

func TestAppendReply(t *testing.T) {
	cases := []struct {
		d    keyrec.Decision
		want string
	}{
		{keyrec.Decision{Allowed: true}, `{"allowed":true,"policy":"","revision":0,"remaining":0,"retry_after_ms":0,"reset_after_ms":0}`},
		{keyrec.Decision{Policy: "acme", Revision: 12, Remaining: 1_500_000, RetryAfter: 100_000_001, ResetAfter: 4_000_000_000},
			`{"allowed":false,"policy":"acme","revision":12,"remaining":1.5,"retry_after_ms":101,"reset_after_ms":4000}`},
		{keyrec.Decision{Allowed: true, Policy: "s", RetryAfter: kvstate.Never, Remaining: 7},
			`{"allowed":true,"policy":"s","revision":0,"remaining":0.000007,"retry_after_ms":-1,"reset_after_ms":0}`},
	}
	for _, c := range cases {
		if got := string(appendReply(nil, c.d, -1)); got != c.want {
			t.Errorf("appendReply(%+v)\n got %s\nwant %s", c.d, got, c.want)
		}
	}
}

// FuzzDecodeRequest: no input panics; every error is a 400 or 413; an
// accepted request is within the contract's bounds.
func FuzzDecodeRequest(f *testing.F) {
	for _, s := range []string{
		`{"descriptor":{"tenant":"acme","operation":"search","plan":"v7"},"cost":3,"request_id":"7f1c2e","dry_run":false}`,
		`{"descriptor":{"tenant":"acme"},"cost":"2.000001"}`,
		`{"descriptor":{"a":"b"},"cost":1e2}`, `{}`, `null`, `{"descriptor":{"x":"\u00e9"}}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := decodeRequest(b)
		if err != nil {
			if !errors.Is(err, fail.ErrBadRequest) && !errors.Is(err, fail.ErrTooLarge) {
				t.Fatalf("error %v is neither 400 nor 413", err)
			}
			return
		}
		if len(b) > MaxRequestBytes || r.cost <= 0 || r.cost > 1_000_000_000*kvstate.Unit || len(r.id) > MaxRequestIDBytes || len(r.desc) == 0 || len(r.desc) > 16 {
			t.Fatalf("accepted out-of-contract request %q: %+v", b, r)
		}
	})
}

// FuzzDecodeRequestFast checks that the hand decoder, whenever it accepts
// an input, gives exactly what the strict decoder gives (the broader
// differential test is FuzzDecodeRequestDifferential).
func FuzzDecodeRequestFast(f *testing.F) {
	for _, s := range []string{
		`{"descriptor":{"tenant":"acme"}}`,
		`{"descriptor":{"tenant":"acme","plan":"v 7"},"cost":3}`,
		` { "descriptor" : { "b" : "2" , "a" : "1" } , "cost" : "0.5" , "request_id" : "r1" , "dry_run" : true } `,
		`{"descriptor":{"tenant":"acme"},"cost":null,"request_id":null,"dry_run":null}`,
		`{"descriptor":{"tenant":"acme"},"cost":1000000000,"dry_run":false}`,
		`{"descriptor":{"tenant":"acme"},"cost":0.000001}`,
		`{"descriptor":{"tenant":"acme"},"cost":01}`,
		`{"descriptor":{"tenant":"acme"},"cost":1.}`,
		`{"descriptor":{"tenant":"acme"},"cost":1e3}`,
		`{"descriptor":{"tenant":"a","tenant":"b"}}`,
		`{"descriptor":{"tenant":"a"},"descriptor":{"plan":"b"}}`,
		`{"Descriptor":{"tenant":"a"}}`,
		`{"descriptor":{"tenant":"a\u0041"}}`,
		`{"descriptor":{"tenant":"a"}}x`,
		`{"descriptor":{"bench_run":"0badcafe","key":"k42"},"cost":"1"}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		fast, ok := decodeRequestFast(b)
		if !ok {
			return
		}
		strict, err := decodeRequestStrict(b)
		if err != nil {
			t.Fatalf("%q: fast decoder accepted, strict decoder: %v", b, err)
		}
		if !sameRequest(fast, strict) {
			t.Fatalf("%q: fast %+v, strict %+v", b, fast, strict)
		}
	})
}

func TestDecodeRequestFastTakesTheCommonShape(t *testing.T) {
	for _, s := range []string{
		`{"descriptor":{"tenant":"acme"}}`,
		`{"descriptor":{"bench_run":"0badcafe","key":"k42"},"cost":"1"}`,
		`{"descriptor":{"tenant":"acme"},"cost":2.5,"request_id":"r-1","dry_run":true}`,
	} {
		if _, ok := decodeRequestFast([]byte(s)); !ok {
			t.Errorf("%s: not taken by the fast decoder", s)
		}
	}
}

func BenchmarkDecodeRequest(b *testing.B) {
	body := []byte(`{"descriptor":{"bench_run":"0badcafe","key":"k42"},"cost":"1"}`)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := decodeRequest(body); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkDecodeRequestStrict(b *testing.B) {
	body := []byte(`{"descriptor":{"bench_run":"0badcafe","key":"k42"},"cost":"1"}`)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := decodeRequestStrict(body); err != nil {
			b.Fatal(err)
		}
	}
}
