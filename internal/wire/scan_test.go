package wire

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"regexp"
	"strings"
	"testing"
	"unicode/utf8"
)

// decodeAny reads one value as encoding/json decodes it into an any (with
// UseNumber), reporting false when a string is not valid UTF-8 or an
// object repeats a name (which encoding/json reads differently).
func decodeAny(s *Scanner, levels int) (any, bool, error) {
	switch c := s.Peek(); {
	case c == '{' || c == '[':
		if levels == 0 {
			return nil, false, s.fail("nested too deep")
		}
		s.Pos++
		end := byte(']')
		if c == '{' {
			end = '}'
		}
		obj, arr, valid := map[string]any{}, []any{}, true
		for first := true; ; first = false {
			more, err := s.More(end, first)
			if err != nil {
				return nil, false, err
			}
			if !more {
				if c == '{' {
					return obj, valid, nil
				}
				return arr, valid, nil
			}
			var name string
			if c == '{' {
				n, f, err := s.String()
				if err != nil {
					return nil, false, err
				}
				if err := s.Expect(':'); err != nil {
					return nil, false, err
				}
				_, dup := obj[n]
				valid = valid && f&InvalidUTF8 == 0 && !dup
				name = n
			}
			v, ok, err := decodeAny(s, levels-1)
			if err != nil {
				return nil, false, err
			}
			valid = valid && ok
			if c == '{' {
				obj[name] = v
			} else {
				arr = append(arr, v)
			}
		}
	case c == '"':
		v, f, err := s.String()
		return v, f&InvalidUTF8 == 0, err
	case c == 't' || c == 'f':
		if s.Literal("true") {
			return true, true, nil
		}
		return false, true, s.ExpectLiteral("false")
	case c == 'n':
		return nil, true, s.ExpectLiteral("null")
	case c == '-' || c >= '0' && c <= '9':
		n, err := s.Number()
		return json.Number(n), true, err
	}
	return nil, false, s.Unexpected()
}

var surrogateEscape = regexp.MustCompile(`\\[uU][dD][89a-fA-F]`)

// FuzzScanner checks the scanner against encoding/json: Skip and a decoder
// built on the token methods take the same texts as json.Valid, and give
// the same values where every string is valid UTF-8 and no name repeats;
// String's flags and Skip's agree.
func FuzzScanner(f *testing.F) {
	for _, s := range []string{`[]`, `[1,"a",{"b":[null,true,false,-0.5e+7]}]`, `"\u00e9\ud83d\ude00"`, `0`, `-`, `1.5E-3`,
		` {"a" :1 } `, `{"a":1,}`, `[1,]`, "\"\xff\"", `"\ud800"`, `"\ud800\u0041"`, `"\udc00"`, `{"a":1,"a":2}`,
		`"a\u0000b\/"`, "\"\t\"", `[[[[[[]]]]]]`, `tru`, `01`, `1.`, `{"\u0061":"\\"}`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		const levels = 8
		valid := json.Valid([]byte(in))
		deep := strings.Count(in, "[")+strings.Count(in, "{") > levels

		sk := Scanner{Text: in}
		flags, err := sk.Skip(levels)
		if err == nil {
			err = sk.End()
		}
		if (err == nil) != valid && !(deep && valid) {
			t.Fatalf("%q: Skip: %v; json.Valid %v", in, err, valid)
		}
		var se *SyntaxError
		if err != nil && !errors.As(err, &se) {
			t.Fatalf("%q: Skip error %v is not a SyntaxError", in, err)
		}

		s := Scanner{Text: in}
		v, plainValue, err := decodeAny(&s, levels)
		if err == nil {
			err = s.End()
		}
		if (err == nil) != valid && !(deep && valid) {
			t.Fatalf("%q: decodeAny: %v; json.Valid %v", in, err, valid)
		}
		if err != nil {
			return
		}
		bad := flags&InvalidUTF8 != 0
		switch {
		case bad && utf8.ValidString(in) && !surrogateEscape.MatchString(in):
			t.Fatalf("%q: Skip reports invalid UTF-8 in valid UTF-8 without surrogate escapes", in)
		case !bad && !utf8.ValidString(in):
			t.Fatalf("%q: Skip reports no invalid UTF-8", in)
		case bad && plainValue:
			t.Fatalf("%q: Skip reports invalid UTF-8, String does not", in)
		case !plainValue:
			return
		}
		d := json.NewDecoder(bytes.NewReader([]byte(in)))
		d.UseNumber()
		var want any
		if err := d.Decode(&want); err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(v, want) {
			t.Fatalf("%q:\nScanner       %#v\nencoding/json %#v", in, v, want)
		}
	})
}

func TestScannerErrors(t *testing.T) {
	cases := []struct{ in, err string }{
		{` `, `malformed JSON at byte 1: unexpected end of input`},
		{`{"a":1} x`, `malformed JSON at byte 8: data after the JSON value`},
		{`{"a":1,}`, `malformed JSON at byte 7: unexpected '}'`},
		{`{'a':1}`, `malformed JSON at byte 1: unexpected '\''`},
		{"{\f}", `malformed JSON at byte 1: unexpected byte 0x0c`},
		{"{\"a\":1\xff}", `malformed JSON at byte 6: unexpected byte 0xff`},
		{"\"a\tb\"", `malformed JSON at byte 2: control character in a string (escape it)`},
		{`"a\x"`, `malformed JSON at byte 3: invalid escape "\\x"`},
		{"\"\\\xff\"", `malformed JSON at byte 2: invalid escape "\\\xff"`},
		{`"\u12"`, `malformed JSON at byte 5: invalid \u escape`},
		{`"\ud800\u12"`, `malformed JSON at byte 11: invalid \u escape`},
		{`"a`, `malformed JSON at byte 2: unterminated string`},
		{`"\u12`, `malformed JSON at byte 5: unterminated string`},
		{`"\`, `malformed JSON at byte 2: unterminated string`},
		{`[TRUE]`, `malformed JSON at byte 1: unexpected 'T'`},
		{`[tru]`, `malformed JSON at byte 4: unexpected ']'`},
		{`[+1]`, `malformed JSON at byte 1: unexpected '+'`},
		{`[.5]`, `malformed JSON at byte 1: unexpected '.'`},
		{`[1.]`, `malformed JSON at byte 3: unexpected ']'`},
		{`[-]`, `malformed JSON at byte 2: unexpected ']'`},
		{`[1e]`, `malformed JSON at byte 3: unexpected ']'`},
		{`[1 2]`, `malformed JSON at byte 3: unexpected '2'`},
		{`{"a" 1}`, `malformed JSON at byte 5: unexpected '1'`},
		{`[[[1]]]`, `malformed JSON at byte 2: nested too deep`},
	}
	for _, c := range cases {
		s := Scanner{Text: c.in}
		_, err := s.Skip(2)
		if err == nil {
			err = s.End()
		}
		if err == nil || err.Error() != c.err {
			t.Errorf("Skip(%q): %v, want %s", c.in, err, c.err)
		}
	}
}

func TestScannerString(t *testing.T) {
	cases := []struct {
		in    string
		want  string
		flags StringFlags
	}{
		{`"plain"`, "plain", 0},
		{` "caf` + "\u00e9" + `"`, "caf\u00e9", 0},
		{`"a\"b\\c\/d\b\f\n\r\t"`, "a\"b\\c/d\b\f\n\r\t", Escaped},
		{`"\u00e9\ud83d\ude00"`, "\u00e9\U0001F600", Escaped},
		{"\"\xff\"", "\xff", InvalidUTF8},
		{"\"\xc3\\u00a9\"", "\xc3\u00a9", Escaped | InvalidUTF8},
		{"\"\\u00e9\xa9\"", "\u00e9\xa9", Escaped | InvalidUTF8},
		{`"\ud800"`, "\ufffd", Escaped | InvalidUTF8},
		{`"\udc00\ud800x"`, "\ufffd\ufffdx", Escaped | InvalidUTF8},
		{`"\ud800\u0041"`, "\ufffdA", Escaped | InvalidUTF8},
		{"\"\x7f\"", "\x7f", 0},
	}
	for _, c := range cases {
		s := Scanner{Text: c.in}
		got, flags, err := s.String()
		if err != nil || got != c.want || flags != c.flags || s.Pos != len(c.in) {
			t.Errorf("String(%s) = %q, %b, %v at %d; want %q, %b", c.in, got, flags, err, s.Pos, c.want, c.flags)
		}
		s = Scanner{Text: c.in}
		if _, flags, err := s.str(false); err != nil || flags != c.flags || s.Pos != len(c.in) {
			t.Errorf("str(%s, false) = %b, %v at %d; want %b", c.in, flags, err, s.Pos, c.flags)
		}
		s = Scanner{Text: c.in}
		plain, ok := s.PlainString()
		if want := c.flags == 0 && strings.Trim(c.want, " abcdefghijklmnopqrstuvwxyz") == ""; ok != want || ok && plain != c.want {
			t.Errorf("PlainString(%s) = %q, %v; want %v", c.in, plain, ok, want)
		}
		if !ok && s.Pos != strings.IndexByte(c.in, '"') {
			t.Errorf("PlainString(%s) read to %d", c.in, s.Pos)
		}
	}
}

func TestScannerTokens(t *testing.T) {
	s := Scanner{Text: ` { "n" : -1.5e3 , "b" : [ true , null ] } `}
	steps := []func() (any, error){
		func() (any, error) { return s.Consume('{'), nil },
		func() (any, error) { return s.More('}', true) },
		func() (any, error) { v, _, err := s.String(); return v, err },
		func() (any, error) { return nil, s.Expect(':') },
		func() (any, error) { return s.Number() },
		func() (any, error) { return s.More('}', false) },
		func() (any, error) { v, ok := s.PlainString(); return fmt.Sprintf("%s %v", v, ok), nil },
		func() (any, error) { return nil, s.Expect(':') },
		func() (any, error) { return s.Consume('['), nil },
		func() (any, error) { return s.More(']', true) },
		func() (any, error) { return fmt.Sprint(s.Literal("false"), s.Literal("true")), nil },
		func() (any, error) { return s.More(']', false) },
		func() (any, error) { return nil, s.ExpectLiteral("null") },
		func() (any, error) { return s.More(']', false) },
		func() (any, error) { return s.More('}', false) },
		func() (any, error) { return nil, s.End() },
	}
	want := []any{true, true, "n", nil, "-1.5e3", true, "b true", nil, true, true, "false true", true, nil, false, false, nil}
	for i, step := range steps {
		got, err := step()
		if err != nil || got != want[i] {
			t.Fatalf("step %d = %v, %v; want %v", i, got, err, want[i])
		}
	}
}
