package wire

import (
	"encoding/json"
	"testing"
	"unicode/utf8"
)

func TestAppendString(t *testing.T) {
	cases := []struct{ in, want string }{
		{"", `""`},
		{"acme-search", `"acme-search"`},
		{`say "hi" \ bye`, `"say \"hi\" \\ bye"`},
		{"\n\r\t", `"\n\r\t"`},
		{"\x00\x01\b\f\x1f", `"\u0000\u0001\u0008\u000c\u001f"`},
		{"\x7f", "\"\x7f\""},
		{"<a&b>", `"<a&b>"`},
		{"caf\u00e9 \U0001F600 \u2028\u2029", "\"caf\u00e9 \U0001F600 \u2028\u2029\""},
		{"a\xffb", `"a\ufffdb"`},
		{"\xc3", `"\ufffd"`},                     // a truncated sequence
		{"\xed\xa0\x80", `"\ufffd\ufffd\ufffd"`}, // an encoded surrogate: three invalid bytes
	}
	for _, c := range cases {
		if got := string(AppendString([]byte("x"), c.in)); got != "x"+c.want {
			t.Errorf("AppendString(%q) = %s, want x%s", c.in, got, c.want)
		}
	}
}

// FuzzAppendString: the output is JSON that encoding/json decodes to what
// it decodes its own encoding of the input to (the input itself when it is
// valid UTF-8), and printable ASCII is copied as it is.
func FuzzAppendString(f *testing.F) {
	for _, s := range []string{"", "plain", `q"b\s`, "\x00\x1f\x7f", "tab\tnl\ncr\r", "ünï", "\xff\xfe", "a\xc3", "\u2028<>&", "\xed\xa0\x80"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		got := AppendString(nil, s)
		var back string
		if err := json.Unmarshal(got, &back); err != nil {
			t.Fatalf("AppendString(%q) = %s: not a JSON string: %v", s, got, err)
		}
		ref, _ := json.Marshal(s)
		var want string
		if err := json.Unmarshal(ref, &want); err != nil {
			t.Fatal(err)
		}
		if back != want {
			t.Fatalf("AppendString(%q) = %s decodes to %q; encoding/json's encoding decodes to %q", s, got, back, want)
		}
		if utf8.ValidString(s) && back != s {
			t.Fatalf("AppendString(%q) = %s decodes to %q", s, got, back)
		}
		plainASCII := true
		for i := 0; i < len(s); i++ {
			plainASCII = plainASCII && plain[s[i]]
		}
		if plainASCII && string(got) != `"`+s+`"` {
			t.Fatalf("AppendString(%q) = %s, want the bytes between quotes", s, got)
		}
	})
}
