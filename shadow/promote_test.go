package shadow

import (
	"errors"
	"testing"
)

func TestWithoutShadow(t *testing.T) {
	cases := []struct{ in, want string }{
		{`{"match":{"tenant":"acme"},"limits":[{"algorithm":"gcra","rate":"1/s","burst":2}],"shadow":true}`,
			`{"match":{"tenant":"acme"},"limits":[{"algorithm":"gcra","rate":"1/s","burst":2}]}`},
		{`{"shadow": true, "match": {"tenant": "acme"}, "limits": [{"algorithm": "gcra", "rate": "1/s", "burst": 2}]}`,
			`{"match": {"tenant": "acme"}, "limits": [{"algorithm": "gcra", "rate": "1/s", "burst": 2}]}`},
		{"{\n  \"match\": {\"tenant\": \"acme\"},\n  \"shadow\": true,\n  \"limits\": [{\"algorithm\": \"gcra\", \"rate\": \"1/s\", \"burst\": 2}],\n  \"description\": \"shadow: true\"\n}\n",
			"{\n  \"match\": {\"tenant\": \"acme\"},\n  \"limits\": [{\"algorithm\": \"gcra\", \"rate\": \"1/s\", \"burst\": 2}],\n  \"description\": \"shadow: true\"\n}\n"},
		{"{\n  \"shadow\" : true ,\n  \"limits\": [{\"algorithm\": \"gcra\", \"rate\": \"1/s\", \"burst\": 2}]\n}",
			"{\n  \"limits\": [{\"algorithm\": \"gcra\", \"rate\": \"1/s\", \"burst\": 2}]\n}"},
	}
	for _, c := range cases {
		got, err := WithoutShadow("acme", []byte(c.in))
		if err != nil || string(got) != c.want {
			t.Errorf("WithoutShadow(%q) =\n%q, %v\nwant\n%q", c.in, got, err, c.want)
		}
	}
	for _, in := range []string{
		`{"limits":[{"algorithm":"gcra","rate":"1/s","burst":2}]}`,
		`{"limits":[{"algorithm":"gcra","rate":"1/s","burst":2}],"shadow":false}`,
	} {
		if _, err := WithoutShadow("acme", []byte(in)); !errors.Is(err, ErrNotCandidate) {
			t.Errorf("%s: %v, want ErrNotCandidate", in, err)
		}
	}
	for _, in := range []string{`[1]`, `{"shadow":true}`, `{"limits":[],"shadow":true}`, `not json`} {
		if _, err := WithoutShadow("acme", []byte(in)); !errors.Is(err, ErrInvalidDocument) {
			t.Errorf("%s: %v, want ErrInvalidDocument", in, err)
		}
	}
}

// FuzzWithoutShadow: never panics; a result parses to a live policy.
func FuzzWithoutShadow(f *testing.F) {
	f.Add([]byte(`{"shadow": true, "match": {"tenant": "acme"}, "limits": [{"algorithm": "gcra", "rate": "1/s", "burst": 2}]}`))
	f.Add([]byte(`{"match":{},"limits":[{"algorithm":"fixed_window","limit":1,"window":"1s"}],"shadow":true,"description":"x"}`))
	f.Fuzz(func(t *testing.T, doc []byte) {
		out, err := WithoutShadow("p", doc)
		if err != nil {
			if !errors.Is(err, ErrNotCandidate) && !errors.Is(err, ErrInvalidDocument) {
				t.Fatalf("unexpected error %v", err)
			}
			return
		}
		if _, err := WithoutShadow("p", out); !errors.Is(err, ErrNotCandidate) {
			t.Fatalf("result %q is still a candidate or invalid: %v", out, err)
		}
	})
}
