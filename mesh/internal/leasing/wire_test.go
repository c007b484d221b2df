package leasing

import (
	"errors"
	"testing"
)

// TestDecode: requests decode when they are one JSON object with a known
// op and no negative quantity; everything else is a bad request.
func TestDecode(t *testing.T) {
	var o ownerRequest
	if err := decode([]byte(`{"op":"acquire","policy":"p","key":"p.p.t=a","holder":"n1","want":10,"min":1,"x":1}`), &o); err != nil || o.Want != 10 {
		t.Fatalf("owner acquire: %+v %v", o, err)
	}
	var g gatewayRequest
	if err := decode([]byte(`{"op":"return","grant":7,"epoch":3,"spent":5}`), &g); err != nil || g.Grant != 7 || g.Spent != 5 {
		t.Fatalf("gateway return: %+v %v", g, err)
	}
	for _, bad := range []string{
		``, `[]`, `{"op":"steal"}`, `{"op":"acquire"} {}`, `{"op":"report","spent":-1}`, `{"op":"acquire","want":-5}`,
		`{"op":"acquire","descriptor":{"a":1}}`, string(make([]byte, maxBody+1)),
	} {
		var g gatewayRequest
		if err := decode([]byte(bad), &g); !errors.Is(err, errBadRequest) {
			t.Errorf("%.40q: err %v, want a bad request", bad, err)
		}
	}
	if err := decode([]byte(`{"op":"acquire","holder":"n1"}`), &ownerRequest{}); !errors.Is(err, errBadRequest) {
		t.Errorf("owner request without policy and key: %v", err)
	}
}

// FuzzDecode: decoding arbitrary bytes never panics, and a request that
// decodes has a known op and no negative quantity.
func FuzzDecode(f *testing.F) {
	f.Add([]byte(`{"op":"acquire","policy":"p","key":"p.p","holder":"n","want":10,"min":1}`))
	f.Add([]byte(`{"op":"report","descriptor":{"tenant":"a"},"grant":1,"epoch":2,"spent":3}`))
	f.Add([]byte(`{"op":"return","spent":1e3}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		var o ownerRequest
		if decode(b, &o) == nil && (o.Want < 0 || o.Min < 0 || o.Spent < 0 || o.Policy == "") {
			t.Fatalf("decoded %+v", o)
		}
		var g gatewayRequest
		if decode(b, &g) == nil && (g.Op != opAcquire && g.Op != opReport && g.Op != opReturn) {
			t.Fatalf("decoded %+v", g)
		}
	})
}
