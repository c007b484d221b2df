package service

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/fail"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/policies"
)

func TestDecodeReserve(t *testing.T) {
	req, ttl, err := decodeReserve([]byte(`{"descriptor":{"tenant":"acme"},"cost":"2.5","ttl":"90s","request_id":"x"}`))
	if err != nil || req.cost != 2_500_000 || ttl != int64(90*time.Second) || req.id != "x" {
		t.Fatalf("%+v %d %v", req, ttl, err)
	}
	if _, ttl, err := decodeReserve([]byte(`{"descriptor":{"tenant":"acme"},"ttl":null}`)); err != nil || ttl != int64(policies.DefaultReservationTTL) {
		t.Fatalf("default ttl %d %v", ttl, err)
	}
	for body, want := range map[string]string{
		`{"descriptor":{"tenant":"acme"},"ttl":"2h"}`:            `ttl: "2h" is above the longest, 1h0m0s`,
		`{"descriptor":{"tenant":"acme"},"ttl":"0s"}`:            `ttl: "0s" must be > 0`,
		`{"descriptor":{"tenant":"acme"},"ttl":30}`:              `ttl: is a number, not a duration string such as "30s"`,
		`{"descriptor":{"tenant":"acme"},"ttl":"soon"}`:          `ttl: "soon" is not a Go duration such as "30s"`,
		`{"descriptor":{"tenant":"acme"},"TTL":"1s"}`:            `"TTL": field names are case-sensitive (write "ttl")`,
		`{"descriptor":{"tenant":"acme"},"ttl":"1s","ttl":"2s"}`: `ttl: duplicate field`,
		`{"descriptor":{"tenant":"acme"},"\u0074tl":"1s"}`:       `ttl: field name is written with escapes`,
		`{"ttl":"1s"}`: `descriptor: required`,
		`{"descriptor":{"tenant":"acme"},"cost":0}`:                                          `cost: "0" must be > 0`,
		`{"descriptor":{"tenant":"acme"},"ttl":"1s"}` + strings.Repeat(" ", MaxRequestBytes): `body is`,
	} {
		_, _, err := decodeReserve([]byte(body))
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want %q", body, err, want)
		}
	}
}

func TestDecodeResBody(t *testing.T) {
	id := keyrec.ReservationID("p.acme.tenant=acme", 12, 0xabc)
	for _, tt := range []struct {
		body  string
		kind  resKind
		units int64
		ttl   int64
	}{
		{`{"reservation":"` + id + `","cost":37}`, opSettle, 37 * kvstate.Unit, int64(policies.DefaultReservationTTL)},
		{`{"reservation":"` + id + `","cost":"0.5"}`, opSettle, kvstate.Unit / 2, int64(policies.DefaultReservationTTL)},
		{`{"reservation":"` + id + `","cost":0}`, opSettle, 0, int64(policies.DefaultReservationTTL)},
		{`{"reservation":"` + id + `","cost":"0.000"}`, opSettle, 0, int64(policies.DefaultReservationTTL)},
		{`{"reservation":"` + id + `"}`, opSettle, -1, int64(policies.DefaultReservationTTL)},
		{`{"reservation":"` + id + `"}`, opRelease, -1, int64(policies.DefaultReservationTTL)},
		{`{"reservation":"` + id + `","ttl":"5m"}`, opRenew, -1, int64(5 * time.Minute)},
		{`{"reservation":"` + id + `","other":[1,{"a":null}]}`, opRelease, -1, int64(policies.DefaultReservationTTL)},
	} {
		b, err := decodeResBody([]byte(tt.body), tt.kind)
		if err != nil || b.id != id || b.units != tt.units || b.ttl != tt.ttl {
			t.Errorf("%s: %+v %v", tt.body, b, err)
		}
	}
	for _, tt := range []struct {
		body string
		kind resKind
		want string
	}{
		{`{}`, opSettle, `reservation: required`},
		{`{"reservation":""}`, opSettle, `reservation: is empty`},
		{`{"reservation":7}`, opSettle, `reservation: is a number, not a string`},
		{`{"reservation":"` + strings.Repeat("r", 129) + `"}`, opSettle, `reservation: is 129 bytes (at most 128)`},
		{`{"reservation":"a","cost":-1}`, opSettle, `cost: "-1" must be > 0`},
		{`{"reservation":"a","cost":"01"}`, opSettle, `cost: "01"`},
		{`{"reservation":"a","cost":1e3}`, opSettle, `cost: "1e3"`},
		{`{"reservation":"a","cost":true}`, opSettle, `cost: is a boolean, not a number or a decimal string`},
		{`{"reservation":"a","Cost":1}`, opSettle, `"Cost": field names are case-sensitive (write "cost")`},
		{`{"reservation":"a","reservation":"b"}`, opRelease, `reservation: duplicate field`},
		{`{"reservation":"a","ttl":"2h"}`, opRenew, `ttl: "2h" is above the longest`},
		{`[]`, opRelease, `body: is an array, not a JSON object`},
		{"\xef\xbb\xbf{}", opRelease, `byte order mark`},
		{`{"reservation":"a"`, opRelease, `malformed JSON`},
	} {
		_, err := decodeResBody([]byte(tt.body), tt.kind)
		if err == nil || !errors.Is(err, fail.ErrBadRequest) || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: %v, want a 400 with %q", tt.body, err, tt.want)
		}
	}
}

// FuzzDecodeReservation: the reservation decoders never panic, refuse
// with a 400 or 413 only, and what they accept obeys the contract's
// ranges; a reservation id round-trips through ParseReservationID.
func FuzzDecodeReservation(f *testing.F) {
	id := keyrec.ReservationID("p.acme.tenant=acme", 1796422682677, 0xd5a4162f60de)
	for _, s := range []string{
		`{"descriptor":{"tenant":"acme"},"cost":3,"ttl":"30s"}`,
		`{"reservation":"` + id + `","cost":37}`,
		`{"reservation":"` + id + `","ttl":"1h"}`,
		`{"reservation":"r1.000000000000.p.x","cost":"0.000001"}`, `{}`, `null`, `{"ttl":"-1s"}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		req, ttl, err := decodeReserve(b)
		if len(b) <= MaxRequestBytes {
			sreq, sttl, serr := decodeReserveStrict(b)
			switch {
			case (err == nil) != (serr == nil), err != nil && err.Error() != serr.Error():
				t.Fatalf("%q: decodeReserve %v, strict %v", b, err, serr)
			case err == nil && (!sameRequest(req, sreq) || ttl != sttl):
				t.Fatalf("%q: decodeReserve %s %d, strict %s %d", b, showRequest(req), ttl, showRequest(sreq), sttl)
			}
		}
		if err == nil {
			if ttl <= 0 || ttl > int64(policies.MaxReservationTTL) || req.cost <= 0 || len(req.desc) == 0 {
				t.Fatalf("%q: accepted %+v ttl %d", b, req, ttl)
			}
		} else if !errors.Is(err, fail.ErrBadRequest) && !errors.Is(err, fail.ErrTooLarge) {
			t.Fatalf("%q: %v", b, err)
		}
		for k := opSettle; k <= opRenew; k++ {
			rb, err := decodeResBody(b, k)
			if err != nil {
				if !errors.Is(err, fail.ErrBadRequest) && !errors.Is(err, fail.ErrTooLarge) {
					t.Fatalf("%q: %v", b, err)
				}
				continue
			}
			if rb.id == "" || len(rb.id) > keyrec.MaxReservationID || rb.units < -1 || rb.ttl <= 0 || rb.ttl > int64(policies.MaxReservationTTL) {
				t.Fatalf("%q (%s): accepted %+v", b, k, rb)
			}
			if key, seq, nonce, ok := keyrec.ParseReservationID(rb.id); ok {
				if again := keyrec.ReservationID(key, seq, nonce); again != rb.id {
					t.Fatalf("id %q parses to %q %d %x, which is %q", rb.id, key, seq, nonce, again)
				}
			}
		}
	})
}
