package mesh

import (
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
		if _, err := decodeRequest([]byte(b)); !errors.Is(err, ErrBadRequest) {
			t.Errorf("%s: err %v, want ErrBadRequest", b, err)
		}
	}
	big := `{"descriptor":{"tenant":"a"},"pad":"` + strings.Repeat("x", MaxRequestBytes) + `"}`
	if _, err := decodeRequest([]byte(big)); !errors.Is(err, ErrTooLarge) {
		t.Errorf("oversized: err %v, want ErrTooLarge", err)
	}
}

func TestAppendReply(t *testing.T) {
	cases := []struct {
		d    decision
		want string
	}{
		{decision{Allowed: true}, `{"allowed":true,"policy":"","revision":0,"remaining":0,"retry_after_ms":0,"reset_after_ms":0}`},
		{decision{Policy: "acme", Revision: 12, Remaining: 1_500_000, RetryAfter: 100_000_001, ResetAfter: 4_000_000_000},
			`{"allowed":false,"policy":"acme","revision":12,"remaining":1.5,"retry_after_ms":101,"reset_after_ms":4000}`},
		{decision{Allowed: true, ShadowDenied: true, Policy: "s", RetryAfter: kvstate.Never, Remaining: 7},
			`{"allowed":true,"policy":"s","revision":0,"remaining":0.000007,"retry_after_ms":-1,"reset_after_ms":0,"shadow_denied":true}`},
	}
	for _, c := range cases {
		if got := string(appendReply(nil, c.d)); got != c.want {
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
			if !errors.Is(err, ErrBadRequest) && !errors.Is(err, ErrTooLarge) {
				t.Fatalf("error %v is neither 400 nor 413", err)
			}
			return
		}
		if len(b) > MaxRequestBytes || r.cost <= 0 || r.cost > 1_000_000_000*kvstate.Unit || len(r.id) > MaxRequestIDBytes || len(r.desc) == 0 || len(r.desc) > 16 {
			t.Fatalf("accepted out-of-contract request %q: %+v", b, r)
		}
	})
}
