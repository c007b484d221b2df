package service

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/fail"
	"github.com/limitmesh/limitmesh/policies"
	"pgregory.net/rapid"
)

// strictCase is a decide body and what decodeRequest makes of it: the
// request (want, formatted by showRequest) or the error message without
// the sentinel's prefix (err).
type strictCase struct {
	name string
	body string
	want string
	err  string
}

var strictCases = []strictCase{
	// Accepted.
	{name: "minimal", body: `{"descriptor":{"tenant":"acme"}}`, want: `tenant="acme" cost=1000000`},
	{name: "all fields", body: `{"descriptor":{"tenant":"acme","operation":"search","plan":"v7"},"cost":3,"request_id":"7f1c2e","dry_run":false}`,
		want: `operation="search" plan="v7" tenant="acme" cost=3000000 id="7f1c2e"`},
	{name: "white space around and inside", body: " \t\r\n{ \"descriptor\" : { \"b\" : \"2\" , \"a\" : \"1\" } , \"dry_run\" : true }\n ",
		want: `a="1" b="2" cost=1000000 dry`},
	{name: "value with spaces", body: `{"descriptor":{"plan":"v 7 "}}`, want: `plan="v 7 " cost=1000000`},
	{name: "escapes in a value", body: `{"descriptor":{"tenant":"\u0061c\/m\"e"}}`, want: `tenant="ac/m\"e" cost=1000000`},
	{name: "non-ASCII value", body: `{"descriptor":{"city":"Zürich"}}`, want: `city="Zürich" cost=1000000`},
	{name: "surrogate pair", body: `{"descriptor":{"e":"\ud83d\ude00"}}`, want: `e="😀" cost=1000000`},
	{name: "upper-case hex escape", body: `{"descriptor":{"e":"\u00E9"}}`, want: `e="é" cost=1000000`},
	{name: "value of 128 bytes", body: `{"descriptor":{"k":"` + strings.Repeat("v", 128) + `"}}`, want: `k="` + strings.Repeat("v", 128) + `" cost=1000000`},
	{name: "16 dimensions", body: `{"descriptor":{` + dims(16) + `}}`, want: sixteen + ` cost=1000000`},
	{name: "null optional fields", body: `{"descriptor":{"t":"a"},"cost":null,"request_id":null,"dry_run":null}`, want: `t="a" cost=1000000`},
	{name: "cost string", body: `{"descriptor":{"t":"a"},"cost":"0.5"}`, want: `t="a" cost=500000`},
	{name: "cost string with an escape", body: `{"descriptor":{"t":"a"},"cost":"\u0031"}`, want: `t="a" cost=1000000`},
	{name: "cost micro", body: `{"descriptor":{"t":"a"},"cost":0.000001}`, want: `t="a" cost=1`},
	{name: "cost max", body: `{"descriptor":{"t":"a"},"cost":1000000000}`, want: `t="a" cost=1000000000000000`},
	{name: "cost max string", body: `{"descriptor":{"t":"a"},"cost":"1000000000.000000"}`, want: `t="a" cost=1000000000000000`},
	{name: "request_id empty is none", body: `{"descriptor":{"t":"a"},"request_id":""}`, want: `t="a" cost=1000000`},
	{name: "request_id escapes", body: `{"descriptor":{"t":"a"},"request_id":"r\n\u00e9"}`, want: `t="a" cost=1000000 id="r\né"`},
	{name: "request_id of 128 bytes", body: `{"descriptor":{"t":"a"},"request_id":"` + strings.Repeat("r", 128) + `"}`,
		want: `t="a" cost=1000000 id="` + strings.Repeat("r", 128) + `"`},
	{name: "unknown fields", body: `{"x":1,"descriptor":{"t":"a"},"meta":{"x":[1,{"y":null}],"n":-1.5E-300,"b":[true,false],"s":"\u0000"},"e":{}}`,
		want: `t="a" cost=1000000`},
	{name: "unknown number with a huge exponent", body: `{"descriptor":{"t":"a"},"n":1e999999999}`, want: `t="a" cost=1000000`},
	{name: "field names inside unknown fields are free", body: `{"descriptor":{"t":"a"},"m":{"Cost":1,"\u0063ost":2,"COST":3}}`, want: `t="a" cost=1000000`},
	{name: "nested 32 levels", body: `{"descriptor":{"t":"a"},"x":` + strings.Repeat("[", 31) + strings.Repeat("]", 31) + `}`, want: `t="a" cost=1000000`},
	{name: "body of 4096 bytes", body: `{"descriptor":{"t":"a"},"p":"` + strings.Repeat("x", MaxRequestBytes-31) + `"}`, want: `t="a" cost=1000000`},

	// The body.
	{name: "empty", body: ``, err: `body: is empty`},
	{name: "white space only", body: " ", err: `malformed JSON at byte 1: unexpected end of input`},
	{name: "byte order mark", body: "\xef\xbb\xbf" + `{"descriptor":{"t":"a"}}`, err: `body: starts with a byte order mark`},
	{name: "array", body: `[{"descriptor":{"t":"a"}}]`, err: `body: is an array, not a JSON object`},
	{name: "null", body: `null`, err: `body: is null, not a JSON object`},
	{name: "string", body: `"x"`, err: `body: is a string, not a JSON object`},
	{name: "number", body: `1`, err: `body: is a number, not a JSON object`},
	{name: "trailing data", body: `{"descriptor":{"t":"a"}} x`, err: `malformed JSON at byte 25: data after the JSON value`},
	{name: "two objects", body: `{"descriptor":{"t":"a"}}{}`, err: `malformed JSON at byte 24: data after the JSON value`},
	{name: "truncated", body: `{"descriptor":{"t":"a"}`, err: `malformed JSON at byte 23: unexpected end of input`},
	{name: "trailing comma", body: `{"descriptor":{"t":"a"},}`, err: `malformed JSON at byte 24: unexpected '}'`},
	{name: "single quotes", body: `{'descriptor':{"t":"a"}}`, err: `malformed JSON at byte 1: unexpected '\''`},
	{name: "form feed is not white space", body: "{\f\"descriptor\":{\"t\":\"a\"}}", err: `malformed JSON at byte 1: unexpected byte 0x0c`},
	{name: "no-break space is not white space", body: "{\u00a0\"descriptor\":{\"t\":\"a\"}}", err: `malformed JSON at byte 1: unexpected byte 0xc2`},
	{name: "invalid byte outside strings", body: "{\"descriptor\":{\"t\":\"a\"}\xff}", err: `malformed JSON at byte 23: unexpected byte 0xff`},
	{name: "raw control character in a string", body: "{\"descriptor\":{\"t\":\"a\tb\"}}", err: `malformed JSON at byte 21: control character in a string (escape it)`},
	{name: "invalid escape", body: `{"descriptor":{"t":"a\x"}}`, err: `malformed JSON at byte 22: invalid escape "\\x"`},
	{name: "short unicode escape", body: `{"descriptor":{"t":"\u12"}}`, err: `malformed JSON at byte 24: invalid \u escape`},
	{name: "unterminated string", body: `{"descriptor":{"t":"a`, err: `malformed JSON at byte 21: unterminated string`},
	{name: "nested 33 levels", body: `{"descriptor":{"t":"a"},"x":` + strings.Repeat("[", 32) + strings.Repeat("]", 32) + `}`,
		err: `malformed JSON at byte 59: nested deeper than 32 levels`},
	{name: "literal in capitals", body: `{"descriptor":{"t":"a"},"dry_run":TRUE}`, err: `malformed JSON at byte 34: unexpected 'T'`},
	{name: "NaN", body: `{"descriptor":{"t":"a"},"n":NaN}`, err: `malformed JSON at byte 28: unexpected 'N'`},
	{name: "plus sign", body: `{"descriptor":{"t":"a"},"n":+1}`, err: `malformed JSON at byte 28: unexpected '+'`},
	{name: "leading dot", body: `{"descriptor":{"t":"a"},"n":.5}`, err: `malformed JSON at byte 28: unexpected '.'`},
	{name: "trailing dot", body: `{"descriptor":{"t":"a"},"n":1.}`, err: `malformed JSON at byte 30: unexpected '}'`},
	{name: "bare minus", body: `{"descriptor":{"t":"a"},"n":-}`, err: `malformed JSON at byte 29: unexpected '}'`},
	{name: "empty exponent", body: `{"descriptor":{"t":"a"},"n":1e}`, err: `malformed JSON at byte 30: unexpected '}'`},

	// Top-level field names.
	{name: "duplicate cost", body: `{"descriptor":{"t":"a"},"cost":1,"cost":2}`, err: `cost: duplicate field`},
	{name: "duplicate cost, first invalid", body: `{"descriptor":{"t":"a"},"cost":-1,"cost":2}`, err: `cost: duplicate field`},
	{name: "duplicate descriptor", body: `{"descriptor":{"t":"a"},"descriptor":{"p":"b"}}`, err: `descriptor: duplicate field`},
	{name: "duplicate null request_id", body: `{"descriptor":{"t":"a"},"request_id":null,"request_id":"r"}`, err: `request_id: duplicate field`},
	{name: "duplicate dry_run", body: `{"descriptor":{"t":"a"},"dry_run":false,"dry_run":true}`, err: `dry_run: duplicate field`},
	{name: "duplicate unknown field", body: `{"descriptor":{"t":"a"},"x":1,"x":2}`, err: `"x": duplicate field`},
	{name: "duplicate among many fields", body: `{"descriptor":{"t":"a"},` + dims(20) + `,"d07":1}`, err: `"d07": duplicate field`},
	{name: "many fields", body: `{"descriptor":{"t":"a"},` + dims(20) + `}`, want: `t="a" cost=1000000`},
	{name: "duplicate by escape", body: `{"descriptor":{"t":"a"},"x":1,"\u0078":2}`, err: `"x": duplicate field`},
	{name: "field name in capitals", body: `{"descriptor":{"t":"a"},"Cost":2}`, err: `"Cost": field names are case-sensitive (write "cost")`},
	{name: "field name by Unicode folding", body: `{"descriptor":{"t":"a"},"co\u017ft":2}`, err: `"co\u017ft": field names are case-sensitive (write "cost")`},
	{name: "field name in mixed case", body: `{"descriptor":{"t":"a"},"Dry_Run":true}`, err: `"Dry_Run": field names are case-sensitive (write "dry_run")`},
	{name: "descriptor in capitals", body: `{"DESCRIPTOR":{"t":"b"},"descriptor":{"t":"a"}}`, err: `"DESCRIPTOR": field names are case-sensitive (write "descriptor")`},
	{name: "field name with escapes", body: `{"descriptor":{"t":"a"},"\u0063ost":2}`, err: `cost: field name is written with escapes`},
	{name: "field name with NUL", body: `{"descriptor":{"t":"a"},"descriptor\u0000":{"t":"b"}}`, err: `"descriptor\x00": field name has a control character`},
	{name: "field name with C1 control", body: `{"descriptor":{"t":"a"},"x` + "\u0085" + `":1}`, err: `"x\u0085": field name has a control character`},
	{name: "field name of invalid UTF-8", body: "{\"descriptor\":{\"t\":\"a\"},\"\xff\":1}", err: `"\xff": field name is not valid UTF-8`},
	{name: "field name with a lone surrogate", body: `{"descriptor":{"t":"a"},"\ud800":1}`, err: `"\ufffd": field name is not valid UTF-8`},
	{name: "long unknown name in a message", body: `{"descriptor":{"t":"a"},"` + strings.Repeat("é", 30) + `":1,"` + strings.Repeat("é", 30) + `":2}`,
		err: `"` + strings.Repeat(`\u00e9`, 20) + `"...: duplicate field`},

	// Unknown fields.
	{name: "unknown object with a duplicate", body: `{"descriptor":{"t":"a"},"meta":{"a":1,"a":2}}`, err: `"meta": has an object with two members named "a"`},
	{name: "unknown object with a duplicate among many", body: `{"descriptor":{"t":"a"},"meta":{` + dims(20) + `,"d19":2}}`, err: `"meta": has an object with two members named "d19"`},
	{name: "unknown string of invalid UTF-8", body: "{\"descriptor\":{\"t\":\"a\"},\"meta\":[\"\xff\"]}", err: `"meta": has a string that is not valid UTF-8`},
	{name: "unknown string with a lone surrogate", body: `{"descriptor":{"t":"a"},"meta":"\udfff"}`, err: `"meta": has a string that is not valid UTF-8`},
	{name: "unknown member name with a lone surrogate", body: `{"descriptor":{"t":"a"},"meta":{"\ud800":1}}`, err: `"meta": has a member name that is not valid UTF-8`},
	{name: "unknown member name with NUL", body: `{"descriptor":{"t":"a"},"meta":{"a\u0000":1}}`, err: `"meta": has a member name that has a control character`},
	{name: "unknown field before the descriptor", body: `{"meta":"\ud800","descriptor":{"t":"a"}}`, err: `"meta": has a string that is not valid UTF-8`},

	// descriptor.
	{name: "no descriptor", body: `{"cost":1}`, err: `descriptor: required`},
	{name: "empty object", body: `{}`, err: `descriptor: required`},
	{name: "null descriptor", body: `{"descriptor":null}`, err: `descriptor: required`},
	{name: "descriptor array", body: `{"descriptor":[]}`, err: `descriptor: is an array, not an object`},
	{name: "descriptor string", body: `{"descriptor":"tenant=a"}`, err: `descriptor: is a string, not an object`},
	{name: "no dimensions", body: `{"descriptor":{}}`, err: `descriptor: has no dimensions (needs 1..16)`},
	{name: "17 dimensions", body: `{"descriptor":{` + dims(17) + `}}`, err: `descriptor: has 17 dimensions (at most 16)`},
	{name: "17 dimensions, one repeated", body: `{"descriptor":{` + dims(16) + `,"d03":"w"}}`, err: `descriptor.d03: duplicate dimension`},
	{name: "duplicate dimension", body: `{"descriptor":{"tenant":"x","tenant":"y"}}`, err: `descriptor.tenant: duplicate dimension`},
	{name: "duplicate dimension, first not a string", body: `{"descriptor":{"tenant":null,"tenant":"a"}}`, err: `descriptor.tenant: duplicate dimension`},
	{name: "duplicate dimension, same value", body: `{"descriptor":{"tenant":"x","plan":"p","tenant":"x"}}`, err: `descriptor.tenant: duplicate dimension`},
	{name: "dimension name in capitals", body: `{"descriptor":{"Tenant":"a"}}`, err: `descriptor: dimension name "Tenant" is not [a-z][a-z0-9_]{0,31}`},
	{name: "dimension name with escapes", body: `{"descriptor":{"t\u0065nant":"a"}}`, err: `descriptor: dimension name "tenant" is written with escapes`},
	{name: "dimension name too long", body: `{"descriptor":{"` + strings.Repeat("n", 33) + `":"a"}}`, err: `descriptor: dimension name "` + strings.Repeat("n", 33) + `" is not [a-z][a-z0-9_]{0,31}`},
	{name: "dimension name invalid UTF-8", body: "{\"descriptor\":{\"\xff\":\"a\"}}", err: `descriptor: dimension name "\xff" is not [a-z][a-z0-9_]{0,31}`},
	{name: "value of invalid UTF-8", body: "{\"descriptor\":{\"tenant\":\"\xff\xfe\"}}", err: `descriptor.tenant: value is not valid UTF-8`},
	{name: "value overlong UTF-8", body: "{\"descriptor\":{\"tenant\":\"\xc0\xaf\"}}", err: `descriptor.tenant: value is not valid UTF-8`},
	{name: "value UTF-8 surrogate", body: "{\"descriptor\":{\"tenant\":\"\xed\xa0\x80\"}}", err: `descriptor.tenant: value is not valid UTF-8`},
	{name: "value lone high surrogate", body: `{"descriptor":{"plan":"\ud800"}}`, err: `descriptor.plan: value is not valid UTF-8`},
	{name: "value lone low surrogate", body: `{"descriptor":{"plan":"a\udc00"}}`, err: `descriptor.plan: value is not valid UTF-8`},
	{name: "value reversed surrogates", body: `{"descriptor":{"plan":"\udc00\ud800"}}`, err: `descriptor.plan: value is not valid UTF-8`},
	{name: "value high surrogate then letter escape", body: `{"descriptor":{"plan":"\ud800\u0041"}}`, err: `descriptor.plan: value is not valid UTF-8`},
	{name: "value number", body: `{"descriptor":{"tenant":1}}`, err: `descriptor.tenant: value is a number, not a string`},
	{name: "value null", body: `{"descriptor":{"tenant":null}}`, err: `descriptor.tenant: value is null, not a string`},
	{name: "value object", body: `{"descriptor":{"tenant":{}}}`, err: `descriptor.tenant: value is an object, not a string`},
	{name: "value empty", body: `{"descriptor":{"tenant":""}}`, err: `descriptor.tenant: value is empty`},
	{name: "value escaped control", body: `{"descriptor":{"tenant":"a\u0001"}}`, err: `descriptor.tenant: value has a control character`},
	{name: "value escaped newline", body: `{"descriptor":{"tenant":"a\n"}}`, err: `descriptor.tenant: value has a control character`},
	{name: "value DEL", body: "{\"descriptor\":{\"tenant\":\"a\x7f\"}}", err: `descriptor.tenant: value has a control character`},
	{name: "value C1 control", body: `{"descriptor":{"tenant":"a` + "\u0085" + `"}}`, err: `descriptor.tenant: value has a control character`},
	{name: "value too long", body: `{"descriptor":{"tenant":"` + strings.Repeat("x", 129) + `"}}`, err: `descriptor.tenant: value is 129 bytes (at most 128)`},
	{name: "value too long after unescaping", body: `{"descriptor":{"tenant":"` + strings.Repeat(`\u00e9`, 65) + `"}}`, err: `descriptor.tenant: value is 130 bytes (at most 128)`},

	// cost.
	{name: "cost negative", body: `{"descriptor":{"t":"a"},"cost":-1}`, err: `cost: "-1" must be > 0`},
	{name: "cost negative zero", body: `{"descriptor":{"t":"a"},"cost":-0}`, err: `cost: "-0" must be > 0`},
	{name: "cost zero", body: `{"descriptor":{"t":"a"},"cost":0}`, err: `cost: "0" must be > 0`},
	{name: "cost zero fraction", body: `{"descriptor":{"t":"a"},"cost":"0.000000"}`, err: `cost: "0.000000" must be > 0`},
	{name: "cost exponent", body: `{"descriptor":{"t":"a"},"cost":1.0e0}`, err: `cost: "1.0e0" has an exponent (write the digits out)`},
	{name: "cost huge exponent", body: `{"descriptor":{"t":"a"},"cost":1e999999999}`, err: `cost: "1e999999999" has an exponent (write the digits out)`},
	{name: "cost exponent string", body: `{"descriptor":{"t":"a"},"cost":"1E2"}`, err: `cost: "1E2" has an exponent (write the digits out)`},
	{name: "cost leading zero", body: `{"descriptor":{"t":"a"},"cost":01}`, err: `malformed JSON at byte 32: unexpected '1'`},
	{name: "cost leading zero string", body: `{"descriptor":{"t":"a"},"cost":"01"}`, err: `cost: "01" is not a decimal number`},
	{name: "cost plus string", body: `{"descriptor":{"t":"a"},"cost":"+1"}`, err: `cost: "+1" is not a decimal number`},
	{name: "cost space string", body: `{"descriptor":{"t":"a"},"cost":" 1"}`, err: `cost: " 1" is not a decimal number`},
	{name: "cost empty string", body: `{"descriptor":{"t":"a"},"cost":""}`, err: `cost: "" is empty`},
	{name: "cost hex string", body: `{"descriptor":{"t":"a"},"cost":"0x10"}`, err: `cost: "0x10" is not a decimal number`},
	{name: "cost invalid UTF-8", body: "{\"descriptor\":{\"t\":\"a\"},\"cost\":\"1\xff\"}", err: `cost: is not valid UTF-8`},
	{name: "cost too large", body: `{"descriptor":{"t":"a"},"cost":1000000001}`, err: `cost: "1000000001" is too large (at most 1000000000)`},
	{name: "cost too precise", body: `{"descriptor":{"t":"a"},"cost":0.0000001}`, err: `cost: "0.0000001" has more than 6 fractional digits`},
	{name: "cost boolean", body: `{"descriptor":{"t":"a"},"cost":true}`, err: `cost: is a boolean, not a number or a decimal string`},
	{name: "cost array", body: `{"descriptor":{"t":"a"},"cost":[1]}`, err: `cost: is an array, not a number or a decimal string`},

	// request_id and dry_run.
	{name: "request_id too long", body: `{"descriptor":{"t":"a"},"request_id":"` + strings.Repeat("x", 129) + `"}`, err: `request_id: is 129 bytes (at most 128)`},
	{name: "request_id too long after unescaping", body: `{"descriptor":{"t":"a"},"request_id":"` + strings.Repeat(`\u00e9`, 65) + `"}`, err: `request_id: is 130 bytes (at most 128)`},
	{name: "request_id invalid UTF-8", body: "{\"descriptor\":{\"t\":\"a\"},\"request_id\":\"\xff\"}", err: `request_id: is not valid UTF-8`},
	{name: "request_id lone surrogate", body: `{"descriptor":{"t":"a"},"request_id":"r\udfff"}`, err: `request_id: is not valid UTF-8`},
	{name: "request_id number", body: `{"descriptor":{"t":"a"},"request_id":7}`, err: `request_id: is a number, not a string`},
	{name: "dry_run string", body: `{"descriptor":{"t":"a"},"dry_run":"true"}`, err: `dry_run: is a string, not true or false`},
	{name: "dry_run number", body: `{"descriptor":{"t":"a"},"dry_run":1}`, err: `dry_run: is a number, not true or false`},
}

// dims returns n descriptor members "d00":"v", "d01":"v", ...
func dims(n int) string {
	var b strings.Builder
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, `"d%02d":"v"`, i)
	}
	return b.String()
}

var sixteen = func() string {
	var parts []string
	for i := range 16 {
		parts = append(parts, fmt.Sprintf(`d%02d="v"`, i))
	}
	return strings.Join(parts, " ")
}()

// showRequest formats r for comparisons: the dimensions in order, the cost
// in micro-units, then the id and "dry" when set.
func showRequest(r request) string {
	var b strings.Builder
	for _, d := range r.desc {
		fmt.Fprintf(&b, "%s=%q ", d.Name, d.Value)
	}
	fmt.Fprintf(&b, "cost=%d", r.cost)
	if r.id != "" {
		fmt.Fprintf(&b, " id=%q", r.id)
	}
	if r.dryRun {
		b.WriteString(" dry")
	}
	return b.String()
}

// sameRequest reports whether a and b are the same request.
func sameRequest(a, b request) bool {
	if a.cost != b.cost || a.id != b.id || a.dryRun != b.dryRun || len(a.desc) != len(b.desc) {
		return false
	}
	for i := range a.desc {
		if a.desc[i] != b.desc[i] {
			return false
		}
	}
	return true
}

// message is err's text without the sentinel's prefix, as a client sees it.
func message(err error) string {
	s := err.Error()
	for _, sentinel := range []error{fail.ErrBadRequest, fail.ErrTooLarge} {
		s = strings.TrimPrefix(s, sentinel.Error()+": ")
	}
	return s
}

func TestDecodeRequestStrictCases(t *testing.T) {
	for _, c := range strictCases {
		t.Run(c.name, func(t *testing.T) {
			for _, dec := range []struct {
				name string
				f    func([]byte) (request, error)
			}{{"decodeRequest", decodeRequest}, {"decodeRequestStrict", decodeRequestStrict}} {
				r, err := dec.f([]byte(c.body))
				switch {
				case c.err == "" && err != nil:
					t.Errorf("%s(%q): %v", dec.name, c.body, err)
				case c.err == "" && showRequest(r) != c.want:
					t.Errorf("%s(%q)\n got %s\nwant %s", dec.name, c.body, showRequest(r), c.want)
				case c.err != "" && err == nil:
					t.Errorf("%s(%q) = %s, want error %s", dec.name, c.body, showRequest(r), c.err)
				case c.err != "" && !errors.Is(err, fail.ErrBadRequest):
					t.Errorf("%s(%q): error %v does not wrap fail.ErrBadRequest", dec.name, c.body, err)
				case c.err != "" && message(err) != c.err:
					t.Errorf("%s(%q)\n got error %s\nwant error %s", dec.name, c.body, message(err), c.err)
				}
			}
		})
	}
}

func TestDecodeRequestTooLarge(t *testing.T) {
	body := `{"descriptor":{"t":"a"},"p":"` + strings.Repeat("x", MaxRequestBytes-30) + `"}`
	_, err := decodeRequest([]byte(body))
	if !errors.Is(err, fail.ErrTooLarge) || message(err) != "body is 4097 bytes, at most 4096" {
		t.Errorf("%d bytes: err %v, want fail.ErrTooLarge", len(body), err)
	}
	// Size first: an oversized body is a 413 whatever it holds.
	_, err = decodeRequest(bytes.Repeat([]byte{0xff}, MaxRequestBytes+1))
	if !errors.Is(err, fail.ErrTooLarge) {
		t.Errorf("oversized garbage: err %v, want fail.ErrTooLarge", err)
	}
}

// TestStrictCasesExplainStdlib checks the table against encoding/json
// (decodeRequestStdlib, the decoder limitmesh used before): every body the
// strict decoder accepts, encoding/json accepts with the same request; a
// body encoding/json accepts and the strict decoder refuses is one of the
// ambiguous cases (strictOnly), never a plain valid request.
func TestStrictCasesExplainStdlib(t *testing.T) {
	for _, c := range strictCases {
		if err := checkAgainstStdlib([]byte(c.body)); err != nil {
			t.Errorf("%s: %v", c.name, err)
		}
	}
}

// strictOnly lists what the strict decoder refuses beyond encoding/json:
// a body that encoding/json takes may be refused with a message holding
// one of these texts, when ambiguities (found by encoding/json's own
// tokenizer, see findAmbiguities) show the message's fault.
var strictOnly = []struct{ text, evidence string }{
	{"not valid UTF-8", "utf8"}, // encoding/json writes U+FFFD instead
	{": duplicate field", "duplicate"},
	{": duplicate dimension", "duplicate"}, // it keeps the last (and merges objects)
	{": has an object with two members named", "duplicate"},
	{": field names are case-sensitive", "case"}, // it matches names ignoring case
	{"is written with escapes", "escape"},
	{": field name has a control character", "control"}, // it ignores unknown names
	{": has a member name that has a control character", "control"},
	{": nested deeper than", "depth"}, // its limit is 10000
}

// checkAgainstStdlib compares decodeRequestStrict with decodeRequestStdlib
// on b (see TestStrictCasesExplainStdlib).
func checkAgainstStdlib(b []byte) error {
	strict, serr := decodeRequestStrict(b)
	std, jerr := decodeRequestStdlib(b)
	switch {
	case serr == nil && jerr != nil:
		return fmt.Errorf("%q: strict accepts %s, encoding/json refuses: %v", b, showRequest(strict), jerr)
	case serr == nil && !sameRequest(strict, std):
		return fmt.Errorf("%q: strict %s, encoding/json %s", b, showRequest(strict), showRequest(std))
	case serr != nil && jerr == nil:
		msg := message(serr)
		found := findAmbiguities(b)
		for _, s := range strictOnly {
			if strings.Contains(msg, s.text) {
				if !found[s.evidence] {
					return fmt.Errorf("%q: strict refuses (%s), but encoding/json's tokens show no %s problem", b, msg, s.evidence)
				}
				return nil
			}
		}
		return fmt.Errorf("%q: strict refuses (%s), encoding/json accepts %s", b, msg, showRequest(std))
	}
	return nil
}

// findAmbiguities reads b, which encoding/json accepts, with encoding/json's
// tokenizer and the raw bytes, independently of parseJSON, and reports
// which ambiguities b has: "utf8" (invalid UTF-8 or a surrogate escape),
// "duplicate" (an object repeats a name), "case" (a member of the body's
// object whose name folds to a field name but differs from it), "escape"
// (a backslash in a member name), "control" (a control character in a
// member name), "depth" (nesting beyond MaxRequestDepth).
func findAmbiguities(b []byte) map[string]bool {
	found := map[string]bool{}
	if !utf8.Valid(b) || surrogateEscape.Match(b) {
		found["utf8"] = true
	}
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	var walk func(depth int) bool
	walk = func(depth int) bool {
		tok, err := d.Token()
		if err != nil {
			return false
		}
		delim, ok := tok.(json.Delim)
		if !ok {
			return true
		}
		if depth > MaxRequestDepth {
			found["depth"] = true
		}
		names := map[string]bool{}
		for d.More() {
			if delim == '{' {
				keyStart := d.InputOffset()
				tok, err := d.Token()
				if err != nil {
					return false
				}
				name := tok.(string)
				if names[name] {
					found["duplicate"] = true
				}
				names[name] = true
				if bytes.IndexByte(b[keyStart:d.InputOffset()], '\\') >= 0 {
					found["escape"] = true
				}
				if strings.IndexFunc(name, unicode.IsControl) >= 0 {
					found["control"] = true
				}
				for _, f := range requestFields {
					if depth == 1 && name != f && strings.EqualFold(name, f) {
						found["case"] = true
					}
				}
			}
			if !walk(depth + 1) {
				return false
			}
		}
		_, err = d.Token() // the closing delimiter
		return err == nil
	}
	walk(1)
	return found
}

// surrogateEscape matches a \u escape of a UTF-16 surrogate.
var surrogateEscape = regexp.MustCompile(`\\u[dD][89abcdefABCDEF]`)

// checkMessage checks a rejection as a client sees it: a 400 (or a 413
// over the size limit) whose message names the field once and is safe in
// a NATS header.
func checkMessage(b []byte, err error) error {
	if errors.Is(err, fail.ErrTooLarge) {
		if len(b) <= MaxRequestBytes {
			return fmt.Errorf("%q: 413 for %d bytes", b, len(b))
		}
		return nil
	}
	if !errors.Is(err, fail.ErrBadRequest) {
		return fmt.Errorf("%q: error %v is neither 400 nor 413", b, err)
	}
	msg := message(err)
	if msg == "" || !utf8.ValidString(msg) || strings.ContainsAny(msg, "\r\n\x00") {
		return fmt.Errorf("%q: message %q is empty or unsafe in a header", b, msg)
	}
	head, rest, ok := strings.Cut(msg, ": ")
	if !ok {
		return fmt.Errorf("%q: message %q names no field", b, msg)
	}
	if strings.HasPrefix(rest, head) {
		return fmt.Errorf("%q: message %q names the field twice", b, msg)
	}
	return nil
}

// FuzzDecodeRequestDifferential is the differential test of the decide
// decoder: decodeRequest (the fast path, then the strict decoder) agrees
// with the reference decodeRequestStrict on every input (accept or
// refuse, the same request, the same message); the fast path never
// accepts what the reference refuses; the reference accepts nothing
// encoding/json refuses and refuses nothing encoding/json accepts except
// the ambiguous cases; every message names its field once.
func FuzzDecodeRequestDifferential(f *testing.F) {
	for _, c := range strictCases {
		f.Add([]byte(c.body))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		got, err := decodeRequest(b)
		if len(b) > MaxRequestBytes {
			if !errors.Is(err, fail.ErrTooLarge) {
				t.Fatalf("%d bytes: err %v, want fail.ErrTooLarge", len(b), err)
			}
			return
		}
		want, werr := decodeRequestStrict(b)
		switch {
		case (err == nil) != (werr == nil):
			t.Fatalf("%q: decodeRequest %s, %v; reference %s, %v", b, showRequest(got), err, showRequest(want), werr)
		case err != nil && err.Error() != werr.Error():
			t.Fatalf("%q: decodeRequest error %v, reference %v", b, err, werr)
		case err == nil && !sameRequest(got, want):
			t.Fatalf("%q: decodeRequest %s, reference %s", b, showRequest(got), showRequest(want))
		}
		if fast, ok := decodeRequestFast(b); ok && (werr != nil || !sameRequest(fast, want)) {
			t.Fatalf("%q: fast path %s, reference %s, %v", b, showRequest(fast), showRequest(want), werr)
		}
		if err != nil {
			if merr := checkMessage(b, err); merr != nil {
				t.Fatal(merr)
			}
		} else if len(got.desc) == 0 || len(got.desc) > policies.MaxDims || got.cost <= 0 || got.cost > policies.MaxCost || len(got.id) > MaxRequestIDBytes {
			t.Fatalf("%q: accepted out-of-contract request %s", b, showRequest(got))
		}
		if serr := checkAgainstStdlib(b); serr != nil {
			t.Fatal(serr)
		}
	})
}

// FuzzParseJSON checks the strict tokenizer against encoding/json: the
// same texts are JSON (up to the depth limit), and where every string is
// valid UTF-8 and no object repeats a name, the same values.
func FuzzParseJSON(f *testing.F) {
	for _, c := range strictCases {
		f.Add([]byte(c.body))
	}
	for _, s := range []string{`[]`, `[1,"a",{"b":[null,true,false,-0.5e+7]}]`, `"\u00e9\ud83d\ude00"`, `0`, `-`, `1.5E-3`, ` {"a" :1 } `} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		v, err := parseJSON(b)
		valid := json.Valid(b)
		if err != nil {
			if valid && !strings.Contains(err.Error(), "nested deeper than") {
				t.Fatalf("%q: encoding/json takes it, parseJSON: %v", b, err)
			}
			if !errors.Is(err, fail.ErrBadRequest) {
				t.Fatalf("%q: error %v is not a 400", b, err)
			}
			return
		}
		if !valid {
			t.Fatalf("%q: encoding/json refuses it, parseJSON takes it", b)
		}
		mine, ok := plainValue(v)
		if !ok {
			if hasBadUTF8(v) && utf8.Valid(b) && !surrogateEscape.Match(b) {
				t.Fatalf("%q: parseJSON finds a string not valid UTF-8, but the text is valid UTF-8 without surrogate escapes", b)
			}
			return
		}
		d := json.NewDecoder(bytes.NewReader(b))
		d.UseNumber()
		var theirs any
		if err := d.Decode(&theirs); err != nil {
			t.Fatalf("%q: encoding/json: %v", b, err)
		}
		if a, b2 := fmt.Sprintf("%#v", mine), fmt.Sprintf("%#v", theirs); a != b2 {
			t.Fatalf("%q:\nparseJSON    %s\nencoding/json %s", b, a, b2)
		}
	})
}

// plainValue converts v to what encoding/json decodes (with UseNumber)
// into an any, or reports false when v has a string that is not valid
// UTF-8 or an object with a repeated name (which encoding/json reads
// differently).
func plainValue(v jsonValue) (any, bool) {
	switch v.kind {
	case jsonNull:
		return nil, true
	case jsonBool:
		return v.boolean, true
	case jsonNumber:
		return json.Number(v.str), true
	case jsonString:
		return v.str, !v.badUTF8
	case jsonArray:
		out := make([]any, 0, len(v.elems))
		for _, e := range v.elems {
			x, ok := plainValue(e)
			if !ok {
				return nil, false
			}
			out = append(out, x)
		}
		return out, true
	}
	out := make(map[string]any, len(v.members))
	for _, m := range v.members {
		if _, dup := out[m.name.str]; dup || m.name.badUTF8 {
			return nil, false
		}
		x, ok := plainValue(m.value)
		if !ok {
			return nil, false
		}
		out[m.name.str] = x
	}
	return out, true
}

// hasBadUTF8 reports whether a string in v, member names included, is
// marked not valid UTF-8.
func hasBadUTF8(v jsonValue) bool {
	if v.badUTF8 {
		return true
	}
	for _, e := range v.elems {
		if hasBadUTF8(e) {
			return true
		}
	}
	for _, m := range v.members {
		if hasBadUTF8(m.name) || hasBadUTF8(m.value) {
			return true
		}
	}
	return false
}

// decodeRequestStdlib is the encoding/json decoder limitmesh used before
// the strict one, kept as an independent second opinion for the tests: a
// plain reading of CONTRACT.md §2 by encoding/json's rules (which keep the
// last of repeated names, match names ignoring case and replace invalid
// UTF-8 with U+FFFD).
func decodeRequestStdlib(b []byte) (request, error) {
	var r request
	var w struct {
		Descriptor map[string]string `json:"descriptor"`
		Cost       json.RawMessage   `json:"cost"`
		RequestID  *string           `json:"request_id"`
		DryRun     *bool             `json:"dry_run"`
	}
	if err := json.Unmarshal(b, &w); err != nil {
		return r, fmt.Errorf("%w: malformed JSON: %v", fail.ErrBadRequest, err)
	}
	if w.Descriptor == nil {
		return r, fmt.Errorf("%w: descriptor: required", fail.ErrBadRequest)
	}
	ds := make([]policies.Dim, 0, len(w.Descriptor))
	for k, v := range w.Descriptor {
		ds = append(ds, policies.Dim{Name: k, Value: v})
	}
	sort.Slice(ds, func(i, j int) bool { return ds[i].Name < ds[j].Name })
	d, err := policies.NewDescriptor(ds)
	if err != nil {
		return r, fmt.Errorf("%w: %v", fail.ErrBadRequest, err)
	}
	r.desc = d
	r.cost = kvstate.Unit
	if c := bytes.TrimSpace(w.Cost); len(c) > 0 && !bytes.Equal(c, []byte("null")) {
		text := string(c)
		if c[0] == '"' {
			if err := json.Unmarshal(c, &text); err != nil {
				return r, fmt.Errorf("%w: %v", fail.ErrBadRequest, err)
			}
		} else if (c[0] < '0' || c[0] > '9') && c[0] != '-' {
			return r, fmt.Errorf("%w: cost: not a number or a decimal string", fail.ErrBadRequest)
		}
		if r.cost, err = policies.ParseCost(text); err != nil {
			return r, fmt.Errorf("%w: %v", fail.ErrBadRequest, err)
		}
	}
	if w.RequestID != nil {
		if len(*w.RequestID) > MaxRequestIDBytes {
			return r, fmt.Errorf("%w: request_id: too long", fail.ErrBadRequest)
		}
		r.id = *w.RequestID
	}
	if w.DryRun != nil {
		r.dryRun = *w.DryRun
	}
	return r, nil
}

// BenchmarkDecodeRequestStdlib is encoding/json's reading of the
// benchmark body, for comparison with BenchmarkDecodeRequestStrict.
func BenchmarkDecodeRequestStdlib(b *testing.B) {
	body := []byte(`{"descriptor":{"bench_run":"0badcafe","key":"k42"},"cost":"1"}`)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := decodeRequestStdlib(body); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkDecodeRequestSlowShapes decodes bodies the fast path leaves to
// the strict decoder: a non-ASCII value, an unknown field, an escape, and
// a malformed body.
func BenchmarkDecodeRequestSlowShapes(b *testing.B) {
	for _, c := range []struct{ name, body string }{
		{"non-ASCII", `{"descriptor":{"tenant":"acme","city":"Zürich"},"cost":1}`},
		{"unknown field", `{"descriptor":{"tenant":"acme","plan":"v7"},"cost":1,"trace":{"id":"abc","sampled":true}}`},
		{"escape", `{"descriptor":{"tenant":"a\u0063me"}}`},
		{"invalid", `{"descriptor":{"tenant":"acme"},"cost":-1}`},
	} {
		body := []byte(c.body)
		b.Run(c.name+"/strict", func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				_, _ = decodeRequest(body)
			}
		})
		b.Run(c.name+"/stdlib", func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				_, _ = decodeRequestStdlib(body)
			}
		})
	}
}

// TestDecodeRequestGenerated builds decide bodies from parts that lean
// towards the ambiguous cases (names in other cases or with escapes,
// repeated names, lone surrogates, invalid bytes, control characters,
// odd numbers, deep unknown fields) and checks what
// FuzzDecodeRequestDifferential checks, so every `go test` run covers
// them.
func TestDecodeRequestGenerated(t *testing.T) {
	var accepted, refused int
	rapid.Check(t, func(t *rapid.T) {
		b := genBody(t)
		r, err := decodeRequest(b)
		want, werr := decodeRequestStrict(b)
		switch {
		case (err == nil) != (werr == nil) || err != nil && err.Error() != werr.Error() || err == nil && !sameRequest(r, want):
			t.Fatalf("%q: decodeRequest %s, %v; reference %s, %v", b, showRequest(r), err, showRequest(want), werr)
		case err != nil:
			refused++
			if merr := checkMessage(b, err); merr != nil {
				t.Fatal(merr)
			}
		default:
			accepted++
		}
		if fast, ok := decodeRequestFast(b); ok && (werr != nil || !sameRequest(fast, want)) {
			t.Fatalf("%q: fast path %s, reference %s, %v", b, showRequest(fast), showRequest(want), werr)
		}
		if serr := checkAgainstStdlib(b); serr != nil {
			t.Fatal(serr)
		}
	})
	t.Logf("%d accepted, %d refused", accepted, refused)
	if accepted == 0 || refused == 0 {
		t.Errorf("generated %d accepted and %d refused bodies: the generator is lopsided", accepted, refused)
	}
}

// pick draws one of good, or, unless clean, one of good and bad.
func pick(t *rapid.T, clean bool, good, bad []string, label string) string {
	if clean {
		return rapid.SampledFrom(good).Draw(t, label)
	}
	return rapid.SampledFrom(append(append([]string(nil), good...), bad...)).Draw(t, label)
}

// genBody draws a decide body: a clean one (valid but for rare parts), or
// one from any parts.
func genBody(t *rapid.T) []byte {
	clean := rapid.Bool().Draw(t, "clean")
	var b []byte
	ws := func() {
		b = append(b, rapid.SampledFrom([]string{"", "", "", " ", "\n\t", "\r\n  "}).Draw(t, "ws")...)
	}
	ws()
	b = append(b, '{')
	names := []string{`"descriptor"`, `"cost"`, `"request_id"`, `"dry_run"`, `"x"`, `"meta"`}
	if clean {
		names = rapid.Permutation(names).Draw(t, "order")[:rapid.IntRange(1, len(names)).Draw(t, "fields")]
		if !slices.Contains(names, `"descriptor"`) {
			names = append(names, `"descriptor"`)
		}
	} else {
		names = rapid.SliceOfN(rapid.SampledFrom(append(names, `"descriptor"`, `"descriptor"`, `"cost"`,
			`"Descriptor"`, `"COST"`, `"co\u017ft"`, `"\u0063ost"`, `"dry_run\u0000"`, `"\ud800"`, "\"\xff\"")), 0, 5).Draw(t, "names")
	}
	for i, name := range names {
		if i > 0 {
			b = append(b, ',')
		}
		ws()
		b = append(b, name...)
		ws()
		b = append(b, ':')
		ws()
		switch name {
		case `"descriptor"`, `"Descriptor"`:
			b = genDescriptor(t, b, clean)
		case `"cost"`, `"COST"`, `"co\u017ft"`, `"\u0063ost"`:
			b = append(b, pick(t, clean, []string{`1`, `3`, `0.5`, `"2.25"`, `1000000000`, `0.000001`, `"\u0031"`, `null`},
				[]string{`1000000001`, `0.0000001`, `-1`, `-0`, `0`, `1.0e0`, `1E999999999`, `01`, `1.`, `"01"`, `""`, `" 1"`, "\"1\xff\"", `true`, `[1]`}, "cost")...)
		case `"request_id"`:
			switch pick(t, clean, []string{"null", "string", "string", "string"}, []string{"7"}, "request_id kind") {
			case "string":
				b = append(b, genString(t, "request_id")...)
			case "null":
				b = append(b, "null"...)
			default:
				b = append(b, "7"...)
			}
		case `"dry_run"`, `"dry_run\u0000"`:
			b = append(b, pick(t, clean, []string{`true`, `false`, `null`}, []string{`"true"`, `1`, `TRUE`}, "dry_run")...)
		default:
			depth := rapid.IntRange(1, 6).Draw(t, "depth")
			if !clean {
				depth = rapid.IntRange(1, MaxRequestDepth+2).Draw(t, "depth")
			}
			b = genAny(t, b, depth, clean)
		}
		ws()
	}
	b = append(b, '}')
	ws()
	if rapid.IntRange(0, 20).Draw(t, "suffix") == 0 {
		b = append(b, rapid.SampledFrom([]string{"x", "{}", "\xef\xbb\xbf"}).Draw(t, "extra")...)
	}
	return b
}

// genDescriptor appends a descriptor object (or something else) to b.
func genDescriptor(t *rapid.T, b []byte, clean bool) []byte {
	if !clean && rapid.IntRange(0, 10).Draw(t, "descriptor kind") == 0 {
		return append(b, rapid.SampledFrom([]string{`null`, `[]`, `"tenant=a"`, `{}`}).Draw(t, "not an object")...)
	}
	b = append(b, '{')
	n := rapid.IntRange(1, 16).Draw(t, "dims")
	if !clean {
		n = rapid.IntRange(1, 17).Draw(t, "dims")
	}
	good := []string{`"tenant"`, `"plan"`, `"op"`, `"` + strings.Repeat("n", 32) + `"`}
	for i := range n {
		if i > 0 {
			b = append(b, ',')
		}
		d := `"d` + strconv.Itoa(i) + `"`
		if clean || rapid.Bool().Draw(t, "numbered") {
			b = append(b, d...)
		} else {
			b = append(b, pick(t, false, good, []string{`"Tenant"`, `"t\u0065nant"`, `""`, `"1a"`, `"` + strings.Repeat("n", 33) + `"`}, "dim name")...)
		}
		b = append(b, ':')
		if !clean && rapid.IntRange(0, 15).Draw(t, "value kind") == 0 {
			b = append(b, rapid.SampledFrom([]string{`1`, `null`, `{}`, `true`}).Draw(t, "not a string")...)
			continue
		}
		b = append(b, genString(t, "value")...)
	}
	return append(b, '}')
}

// genString draws a JSON string of printable text, escapes, non-ASCII
// runes and, rarely, something invalid.
func genString(t *rapid.T, label string) []byte {
	parts := rapid.SliceOfN(rapid.SampledFrom([]string{
		"a", "b", "acme", " ", "v7", "é", "😀", "\u2028", "\ufffd",
		`\n`, `\"`, `\\`, `\/`, `\u0041`, `\u00e9`, `\ud83d\ude00`, `\u0000`,
		`\ud800`, `\udc00`, "\u0085", "\x7f", "\xff", "\xc0\xaf", "\xed\xa0\x80",
		strings.Repeat("x", 60),
	}), 1, 5).Draw(t, label)
	s := []byte{'"'}
	for i, p := range parts {
		invalid := p[0] >= 0x80 && !utf8.ValidString(p) || p == `\ud800` || p == `\udc00` || p == "\x7f" || p == "\u0085" || p == `\n` || p == `\u0000`
		if invalid && rapid.IntRange(0, 9).Draw(t, label+" keep "+strconv.Itoa(i)) != 0 {
			p = "z"
		}
		s = append(s, p...)
	}
	return append(s, '"')
}

// genAny appends an unknown field's value of at most depth levels.
func genAny(t *rapid.T, b []byte, depth int, clean bool) []byte {
	kind := rapid.IntRange(0, 6).Draw(t, "any kind")
	if depth <= 1 && kind >= 5 {
		kind = 0
	}
	switch kind {
	case 0:
		return append(b, rapid.SampledFrom([]string{`null`, `true`, `0`, `-1.5e+300`, `1e999999999`, `"x"`}).Draw(t, "scalar")...)
	case 1, 2:
		return append(b, genString(t, "any string")...)
	case 3, 4:
		b = append(b, '[')
		for i := range rapid.IntRange(0, 2).Draw(t, "elems") {
			if i > 0 {
				b = append(b, ',')
			}
			b = genAny(t, b, depth-1, clean)
		}
		return append(b, ']')
	}
	b = append(b, '{')
	names := []string{`"a"`, `"b"`, `"cost"`, `"Cost"`, `"\u0063ost"`}
	if !clean {
		names = append(names, `"\u0061"`, `"a\u0000"`, `"\udfff"`)
	}
	n := rapid.IntRange(0, 2).Draw(t, "members")
	if clean {
		names = rapid.Permutation(names).Draw(t, "member names")[:n]
	} else {
		names = rapid.SliceOfN(rapid.SampledFrom(names), n, n).Draw(t, "member names")
	}
	for i, name := range names {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, name...)
		b = append(b, ':')
		b = genAny(t, b, depth-1, clean)
	}
	return append(b, '}')
}
