package clitext

import (
	"encoding/json"
	"testing"
	"unicode/utf8"
)

func TestNumberJSON(t *testing.T) {
	cases := []struct{ in, want string }{
		{"3", `3`},
		{"0", `0`},
		{"-2", `-2`},
		{"0.5", `0.5`},
		{"12.500", `12.500`},
		// Not JSON numbers, or with an exponent: strings for the node to reject.
		{"1e3", `"1e3"`},
		{"1E3", `"1E3"`},
		{"01", `"01"`},
		{".5", `".5"`},
		{"5.", `"5."`},
		{"+5", `"+5"`},
		{"", `""`},
		{"3\n", `"3\n"`},
		{"three", `"three"`},
		{`3"}`, `"3\"}"`},
	}
	for _, c := range cases {
		got := NumberJSON(c.in)
		if string(got) != c.want {
			t.Errorf("NumberJSON(%q) = %s, want %s", c.in, got, c.want)
		}
		if !json.Valid(got) {
			t.Errorf("NumberJSON(%q) = %s is not JSON", c.in, got)
		}
	}
}

func FuzzNumberJSON(f *testing.F) {
	for _, s := range []string{"3", "0.5", "1e3", "01", `"`, "-0"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		got := NumberJSON(s)
		if !json.Valid(got) {
			t.Fatalf("NumberJSON(%q) = %s is not JSON", s, got)
		}
		var v any
		if err := json.Unmarshal(got, &v); err != nil {
			t.Fatal(err)
		}
		if str, ok := v.(string); ok && utf8.ValidString(s) && str != s {
			t.Fatalf("NumberJSON(%q) = %s: the string is not the input", s, got)
		}
		if _, ok := v.(float64); ok && string(got) != s {
			t.Fatalf("NumberJSON(%q) = %s: the number is not the input", s, got)
		}
	})
}
