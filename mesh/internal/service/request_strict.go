package service

import (
	"fmt"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/fail"
	"github.com/limitmesh/limitmesh/policies"
)

// The strict decide decoder. decodeRequestStrict is the definition of
// which decide bodies are accepted and what they mean; decodeRequestFast
// is a shortcut for the common shape that must agree with it
// (FuzzDecodeRequestDifferential). It is written for clarity, in two
// passes: parseJSON reads the body into a tree by RFC 8259 and nothing
// more, then decodeTree applies CONTRACT.md §2 and the rules below.
//
// Besides the contract's field rules, a body is refused (400) when two
// JSON parsers could read it differently, since a gateway in front of
// limitmesh that reads a body one way while limitmesh reads it another
// (a tenant checked by one, another tenant spent by the other) is a
// security hole. The rules, for every value in the body, unknown fields
// included:
//
//   - The body is exactly one JSON object: no byte order mark, nothing
//     but white space (space, tab, LF, CR) before or after it. Empty
//     bodies, arrays, strings, numbers, literals and null are refused.
//   - Every string, member names included, is valid UTF-8 after
//     unescaping: no invalid bytes and no unpaired surrogate escape
//     (\ud800 alone). Parsers replace, keep or refuse these.
//   - No object has two members with the same name (after unescaping):
//     parsers keep the first, keep the last or refuse.
//   - No member name has a control character (Unicode Cc, as an escape
//     or raw): parsers on C strings stop at \u0000.
//   - Objects and arrays nest at most MaxRequestDepth levels (the body's
//     object is level 1): parsers' depth limits differ.
//   - The field names descriptor, cost, request_id and dry_run are exact:
//     a member whose name equals one of them only under Unicode case
//     folding ("Cost", "DRY_RUN", "coſt") is refused, since
//     encoding/json and others match names case-insensitively; and
//     one that spells one of them with escapes ("\u0063ost") is refused,
//     since parsers that compare names without unescaping them (some
//     fast ones do) miss it.
//   - Dimension names are written without escapes, for the same reason;
//     a duplicate dimension is refused by the rule on duplicate names.
//
// Null means absent for cost (default 1), request_id and dry_run; a null
// descriptor is a missing one. request_id "" is no request_id. Lengths
// (dimension values, request_id) count bytes after unescaping. A cost is
// a JSON number or string whose text is `(0|[1-9][0-9]*)(\.[0-9]{1,6})?`
// (policies.ParseCost): -0, 01, 1.0e0 and 1e999999999 are refused before
// any arithmetic. Numbers in unknown fields are not evaluated: any RFC
// 8259 number is accepted there.
//
// The first failed check is the error, in this order: the body's size
// (decodeRequest), the JSON syntax and depth, the body's member names
// (format, case and escapes, then repeats), then the fields in body
// order; within the descriptor: its dimension names, repeats, count,
// then values. So an ambiguous body is refused as ambiguous, not for a
// value that one reading of it has.
//
// Error messages name the offending field once: `cost: "-1" must be > 0`,
// `descriptor.tenant: duplicate dimension`, `"Cost": field names are
// case-sensitive (write "cost")`, `malformed JSON at byte 17: ...`.

// MaxRequestDepth is the deepest nesting of objects and arrays in a decide
// body; the body's object is level 1, the descriptor level 2.
const MaxRequestDepth = 32

// decodeRequestStrict is decodeRequest without the fast path and without
// the size check: it applies every rule above to b. Errors wrap
// fail.ErrBadRequest.
func decodeRequestStrict(b []byte) (request, error) {
	if len(b) == 0 {
		return request{}, badRequest("body", "is empty")
	}
	if len(b) >= 3 && b[0] == 0xEF && b[1] == 0xBB && b[2] == 0xBF {
		return request{}, badRequest("body", "starts with a byte order mark")
	}
	root, err := parseJSON(b)
	if err != nil {
		return request{}, err
	}
	return decodeTree(root)
}

// badRequest is a 400 error about the field path: `path: reason`.
func badRequest(path, reason string) error {
	return fmt.Errorf("%w: %s: %s", fail.ErrBadRequest, path, reason)
}

// The request's field names.
const (
	fieldDescriptor = "descriptor"
	fieldCost       = "cost"
	fieldRequestID  = "request_id"
	fieldDryRun     = "dry_run"
)

var requestFields = [...]string{fieldDescriptor, fieldCost, fieldRequestID, fieldDryRun}

// decodeTree applies the contract to a parsed body. Name rules and
// duplicates are checked for every member before any value, so an
// ambiguous body is reported as such rather than by a value error.
func decodeTree(root jsonValue) (request, error) {
	var r request
	if root.kind != jsonObject {
		return r, badRequest("body", "is "+root.kind.String()+", not a JSON object")
	}
	for _, m := range root.members {
		if err := checkMemberName(m.name, ""); err != nil {
			return r, err
		}
		for _, f := range requestFields {
			switch {
			case m.name.str == f && m.name.escaped:
				return r, badRequest(f, "field name is written with escapes")
			case m.name.str != f && strings.EqualFold(m.name.str, f):
				return r, badRequest(label(m.name.str), "field names are case-sensitive (write "+strconv.Quote(f)+")")
			}
		}
	}
	if name, ok := repeatedName(root.members); ok {
		return r, badRequest(fieldPath(name), "duplicate field")
	}
	r.cost = kvstate.Unit
	seenDesc := false
	for _, m := range root.members {
		v := m.value
		switch m.name.str {
		case fieldDescriptor:
			if v.kind == jsonNull {
				continue
			}
			d, err := decodeDescriptor(v)
			if err != nil {
				return r, err
			}
			r.desc, seenDesc = d, true
		case fieldCost:
			switch v.kind {
			case jsonNull:
			case jsonNumber, jsonString:
				if v.kind == jsonString && v.badUTF8 {
					return r, badRequest(fieldCost, "is not valid UTF-8")
				}
				c, err := policies.ParseCost(v.str)
				if err != nil {
					return r, fmt.Errorf("%w: %v", fail.ErrBadRequest, err) // names "cost"
				}
				r.cost = c
			default:
				return r, badRequest(fieldCost, "is "+v.kind.String()+", not a number or a decimal string")
			}
		case fieldRequestID:
			switch {
			case v.kind == jsonNull:
			case v.kind != jsonString:
				return r, badRequest(fieldRequestID, "is "+v.kind.String()+", not a string")
			case v.badUTF8:
				return r, badRequest(fieldRequestID, "is not valid UTF-8")
			case len(v.str) > MaxRequestIDBytes:
				return r, badRequest(fieldRequestID, "is "+strconv.Itoa(len(v.str))+" bytes (at most "+strconv.Itoa(MaxRequestIDBytes)+")")
			default:
				r.id = v.str
			}
		case fieldDryRun:
			switch v.kind {
			case jsonNull:
			case jsonBool:
				r.dryRun = v.boolean
			default:
				return r, badRequest(fieldDryRun, "is "+v.kind.String()+", not true or false")
			}
		default:
			if err := checkUnknown(v, label(m.name.str)); err != nil {
				return r, err
			}
		}
	}
	if !seenDesc {
		return r, badRequest(fieldDescriptor, "required")
	}
	return r, nil
}

// decodeDescriptor decodes the descriptor object v (not null). As in
// decodeTree, names and duplicates come before values.
func decodeDescriptor(v jsonValue) (policies.Descriptor, error) {
	if v.kind != jsonObject {
		return nil, badRequest(fieldDescriptor, "is "+v.kind.String()+", not an object")
	}
	for _, m := range v.members {
		if m.name.escaped {
			return nil, badRequest(fieldDescriptor, "dimension name "+label(m.name.str)+" is written with escapes")
		}
		if !validDimName(m.name.str) {
			return nil, badRequest(fieldDescriptor, "dimension name "+label(m.name.str)+" is not [a-z][a-z0-9_]{0,31}")
		}
	}
	if name, ok := repeatedName(v.members); ok {
		return nil, badRequest(fieldDescriptor+"."+name, "duplicate dimension")
	}
	switch n := len(v.members); {
	case n == 0:
		return nil, badRequest(fieldDescriptor, "has no dimensions (needs 1..16)")
	case n > policies.MaxDims:
		return nil, badRequest(fieldDescriptor, "has "+strconv.Itoa(n)+" dimensions (at most 16)")
	}
	dims := make([]policies.Dim, 0, len(v.members))
	for _, m := range v.members {
		path := fieldDescriptor + "." + m.name.str
		if m.value.kind != jsonString {
			return nil, badRequest(path, "value is "+m.value.kind.String()+", not a string")
		}
		if m.value.badUTF8 {
			return nil, badRequest(path, "value is not valid UTF-8")
		}
		dims = append(dims, policies.Dim{Name: m.name.str, Value: m.value.str})
	}
	d, err := policies.NewDescriptor(dims) // the value rules; names "descriptor.<name>"
	if err != nil {
		return nil, fmt.Errorf("%w: %v", fail.ErrBadRequest, err)
	}
	return d, nil
}

// validDimName reports whether s matches [a-z][a-z0-9_]{0,31}.
func validDimName(s string) bool {
	if len(s) == 0 || len(s) > policies.MaxDimNameLen || s[0] < 'a' || s[0] > 'z' {
		return false
	}
	for i := 1; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_') {
			return false
		}
	}
	return true
}

// checkUnknown checks the value of an unknown field (labelled path) against
// the rules every value obeys: valid UTF-8 strings and member names
// without control characters, each name once per object.
func checkUnknown(v jsonValue, path string) error {
	switch v.kind {
	case jsonString:
		if v.badUTF8 {
			return badRequest(path, "has a string that is not valid UTF-8")
		}
	case jsonArray:
		for _, e := range v.elems {
			if err := checkUnknown(e, path); err != nil {
				return err
			}
		}
	case jsonObject:
		for _, m := range v.members {
			if err := checkMemberName(m.name, path); err != nil {
				return err
			}
		}
		if name, ok := repeatedName(v.members); ok {
			return badRequest(path, "has an object with two members named "+label(name))
		}
		for _, m := range v.members {
			if err := checkUnknown(m.value, path); err != nil {
				return err
			}
		}
	}
	return nil
}

// repeatedName returns the first name in members that an earlier member
// has, and whether there is one.
func repeatedName(members []jsonMember) (string, bool) {
	if len(members) <= 16 {
		for i := range members {
			for _, prev := range members[:i] {
				if prev.name.str == members[i].name.str {
					return members[i].name.str, true
				}
			}
		}
		return "", false
	}
	seen := make(map[string]bool, len(members)) // the quadratic scan is slow for hundreds of members
	for _, m := range members {
		if seen[m.name.str] {
			return m.name.str, true
		}
		seen[m.name.str] = true
	}
	return "", false
}

// checkMemberName checks that a member name is valid UTF-8 without control
// characters. path is the unknown field it is inside, "" for a member of
// the body's object.
func checkMemberName(name jsonValue, path string) error {
	problem := ""
	switch {
	case name.badUTF8:
		problem = "is not valid UTF-8"
	case strings.IndexFunc(name.str, unicode.IsControl) >= 0:
		problem = "has a control character"
	default:
		return nil
	}
	if path == "" {
		return badRequest(label(name.str), "field name "+problem)
	}
	return badRequest(path, "has a member name that "+problem)
}

// fieldPath is how an error message names the body's member name: bare
// for the request's fields, else as label does.
func fieldPath(name string) string {
	for _, f := range requestFields {
		if name == f {
			return f
		}
	}
	return label(name)
}

// label is a member name as an error message shows it: quoted with Go
// escapes, ASCII only, and cut after 40 bytes.
func label(name string) string {
	const max = 40
	if len(name) <= max {
		return strconv.QuoteToASCII(name)
	}
	cut := max
	for cut > 0 && !utf8.RuneStart(name[cut]) {
		cut--
	}
	return strconv.QuoteToASCII(name[:cut]) + "..."
}

// jsonKind is the type of a JSON value.
type jsonKind uint8

const (
	jsonNull jsonKind = iota
	jsonBool
	jsonNumber
	jsonString
	jsonArray
	jsonObject
)

// String names the kind with its article, for error messages ("is an array").
func (k jsonKind) String() string {
	return [...]string{"null", "a boolean", "a number", "a string", "an array", "an object"}[k]
}

// jsonValue is a parsed JSON value.
type jsonValue struct {
	kind jsonKind
	// str is a string's unescaped bytes or a number's text.
	str string
	// escaped: the string was written with at least one escape.
	escaped bool
	// badUTF8: the string is not valid UTF-8 after unescaping (an invalid
	// byte or an unpaired surrogate escape); str then holds the invalid
	// bytes as they came and U+FFFD for each unpaired surrogate.
	badUTF8 bool
	boolean bool
	members []jsonMember // an object's members, in order
	elems   []jsonValue  // an array's elements
}

// jsonMember is one name-value pair of an object.
type jsonMember struct {
	name  jsonValue // a string
	value jsonValue
}

// jsonParser reads JSON text (RFC 8259) from b, nesting at most
// MaxRequestDepth levels. Its errors wrap fail.ErrBadRequest and give
// the byte offset.
type jsonParser struct {
	b []byte
	i int
}

// parseJSON parses b as one JSON value surrounded by optional white space.
func parseJSON(b []byte) (jsonValue, error) {
	p := &jsonParser{b: b}
	p.space()
	v, err := p.value(1)
	if err != nil {
		return v, err
	}
	p.space()
	if p.i != len(p.b) {
		return v, p.fail("data after the JSON value")
	}
	return v, nil
}

func (p *jsonParser) fail(what string) error {
	return fmt.Errorf("%w: malformed JSON at byte %d: %s", fail.ErrBadRequest, p.i, what)
}

// unexpected reports the byte at p.i, or the end of the input.
func (p *jsonParser) unexpected() error {
	if p.i >= len(p.b) {
		return p.fail("unexpected end of input")
	}
	c := p.b[p.i]
	if c >= 0x20 && c < 0x7f {
		return p.fail("unexpected " + strconv.QuoteRune(rune(c)))
	}
	return p.fail(fmt.Sprintf("unexpected byte 0x%02x", c))
}

// space skips white space: space, tab, line feed, carriage return.
func (p *jsonParser) space() {
	for p.i < len(p.b) && (p.b[p.i] == ' ' || p.b[p.i] == '\t' || p.b[p.i] == '\n' || p.b[p.i] == '\r') {
		p.i++
	}
}

// value parses the value at p.i, which is at nesting level depth if it is
// an object or an array.
func (p *jsonParser) value(depth int) (jsonValue, error) {
	if p.i >= len(p.b) {
		return jsonValue{}, p.unexpected()
	}
	switch c := p.b[p.i]; {
	case c == '{' || c == '[':
		if depth > MaxRequestDepth {
			return jsonValue{}, p.fail("nested deeper than " + strconv.Itoa(MaxRequestDepth) + " levels")
		}
		if c == '{' {
			return p.object(depth)
		}
		return p.array(depth)
	case c == '"':
		return p.string()
	case c == '-' || c >= '0' && c <= '9':
		return p.number()
	case c == 't':
		return jsonValue{kind: jsonBool, boolean: true}, p.literal("true")
	case c == 'f':
		return jsonValue{kind: jsonBool}, p.literal("false")
	case c == 'n':
		return jsonValue{kind: jsonNull}, p.literal("null")
	}
	return jsonValue{}, p.unexpected()
}

func (p *jsonParser) literal(word string) error {
	for k := 0; k < len(word); k++ {
		if p.i >= len(p.b) || p.b[p.i] != word[k] {
			return p.unexpected()
		}
		p.i++
	}
	return nil
}

// object parses `{ [string : value] {, string : value} }`.
func (p *jsonParser) object(depth int) (jsonValue, error) {
	v := jsonValue{kind: jsonObject}
	p.i++ // '{'
	p.space()
	if p.i < len(p.b) && p.b[p.i] == '}' {
		p.i++
		return v, nil
	}
	for {
		if p.i >= len(p.b) || p.b[p.i] != '"' {
			return v, p.unexpected()
		}
		name, err := p.string()
		if err != nil {
			return v, err
		}
		p.space()
		if p.i >= len(p.b) || p.b[p.i] != ':' {
			return v, p.unexpected()
		}
		p.i++
		p.space()
		val, err := p.value(depth + 1)
		if err != nil {
			return v, err
		}
		v.members = append(v.members, jsonMember{name: name, value: val})
		p.space()
		if p.i >= len(p.b) {
			return v, p.unexpected()
		}
		switch p.b[p.i] {
		case ',':
			p.i++
			p.space()
		case '}':
			p.i++
			return v, nil
		default:
			return v, p.unexpected()
		}
	}
}

// array parses `[ [value] {, value} ]`.
func (p *jsonParser) array(depth int) (jsonValue, error) {
	v := jsonValue{kind: jsonArray}
	p.i++ // '['
	p.space()
	if p.i < len(p.b) && p.b[p.i] == ']' {
		p.i++
		return v, nil
	}
	for {
		e, err := p.value(depth + 1)
		if err != nil {
			return v, err
		}
		v.elems = append(v.elems, e)
		p.space()
		if p.i >= len(p.b) {
			return v, p.unexpected()
		}
		switch p.b[p.i] {
		case ',':
			p.i++
			p.space()
		case ']':
			p.i++
			return v, nil
		default:
			return v, p.unexpected()
		}
	}
}

// number parses `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`
// and keeps its text.
func (p *jsonParser) number() (jsonValue, error) {
	start := p.i
	if p.b[p.i] == '-' {
		p.i++
	}
	switch {
	case p.i < len(p.b) && p.b[p.i] == '0':
		p.i++
	case p.i < len(p.b) && p.b[p.i] >= '1' && p.b[p.i] <= '9':
		p.digits()
	default:
		return jsonValue{}, p.unexpected()
	}
	if p.i < len(p.b) && p.b[p.i] == '.' {
		p.i++
		if p.digits() == 0 {
			return jsonValue{}, p.unexpected()
		}
	}
	if p.i < len(p.b) && (p.b[p.i] == 'e' || p.b[p.i] == 'E') {
		p.i++
		if p.i < len(p.b) && (p.b[p.i] == '+' || p.b[p.i] == '-') {
			p.i++
		}
		if p.digits() == 0 {
			return jsonValue{}, p.unexpected()
		}
	}
	return jsonValue{kind: jsonNumber, str: string(p.b[start:p.i])}, nil
}

// digits skips [0-9]* and returns how many.
func (p *jsonParser) digits() int {
	start := p.i
	for p.i < len(p.b) && p.b[p.i] >= '0' && p.b[p.i] <= '9' {
		p.i++
	}
	return p.i - start
}

// string parses a string and unescapes it. Raw bytes below 0x20 are a
// syntax error; invalid UTF-8 and unpaired surrogates are not (they set
// badUTF8), so the caller can name the field they are in.
func (p *jsonParser) string() (jsonValue, error) {
	v := jsonValue{kind: jsonString}
	p.i++ // '"'
	start := p.i
	var s []byte // the unescaped bytes once there is an escape
	for {
		if p.i >= len(p.b) {
			return v, p.fail("unterminated string")
		}
		c := p.b[p.i]
		switch {
		case c == '"':
			if v.escaped {
				v.str = string(s)
			} else {
				v.str = string(p.b[start:p.i])
			}
			p.i++
			return v, nil
		case c < 0x20:
			return v, p.fail("control character in a string (escape it)")
		case c == '\\':
			if !v.escaped {
				v.escaped = true
				s = append(s, p.b[start:p.i]...)
			}
			r, ok, err := p.escape()
			if err != nil {
				return v, err
			}
			if !ok {
				v.badUTF8 = true
			}
			s = utf8.AppendRune(s, r)
		default:
			size := 1
			if c >= utf8.RuneSelf {
				var r rune
				r, size = utf8.DecodeRune(p.b[p.i:])
				if r == utf8.RuneError && size == 1 {
					v.badUTF8 = true
				}
			}
			if v.escaped {
				s = append(s, p.b[p.i:p.i+size]...)
			}
			p.i += size
		}
	}
}

// escape parses the escape at p.i (a backslash) and returns the rune it
// stands for. A \uXXXX high surrogate followed by a \uXXXX low surrogate
// is one rune; an unpaired surrogate returns U+FFFD and ok false.
func (p *jsonParser) escape() (r rune, ok bool, err error) {
	p.i++ // '\\'
	if p.i >= len(p.b) {
		return 0, false, p.fail("unterminated string")
	}
	c := p.b[p.i]
	p.i++
	switch c {
	case '"', '\\', '/':
		return rune(c), true, nil
	case 'b':
		return '\b', true, nil
	case 'f':
		return '\f', true, nil
	case 'n':
		return '\n', true, nil
	case 'r':
		return '\r', true, nil
	case 't':
		return '\t', true, nil
	case 'u':
	default:
		p.i--
		return 0, false, p.fail("invalid escape " + strconv.Quote(`\`+string(p.b[p.i:p.i+1])))
	}
	r, err = p.hex4()
	if err != nil {
		return 0, false, err
	}
	switch {
	case r >= 0xDC00 && r <= 0xDFFF: // a low surrogate first
		return utf8.RuneError, false, nil
	case r >= 0xD800 && r <= 0xDBFF: // a high surrogate: a low one must follow
		if p.i+1 < len(p.b) && p.b[p.i] == '\\' && p.b[p.i+1] == 'u' {
			save := p.i
			p.i += 2
			lo, err := p.hex4()
			if err != nil {
				return 0, false, err
			}
			if lo >= 0xDC00 && lo <= 0xDFFF {
				return 0x10000 + (r-0xD800)<<10 + (lo - 0xDC00), true, nil
			}
			p.i = save // not a low surrogate: an escape of its own
		}
		return utf8.RuneError, false, nil
	}
	return r, true, nil
}

// hex4 parses four hex digits.
func (p *jsonParser) hex4() (rune, error) {
	var r rune
	for k := 0; k < 4; k++ {
		if p.i >= len(p.b) {
			return 0, p.fail("unterminated string")
		}
		c := p.b[p.i]
		var d byte
		switch {
		case c >= '0' && c <= '9':
			d = c - '0'
		case c >= 'a' && c <= 'f':
			d = c - 'a' + 10
		case c >= 'A' && c <= 'F':
			d = c - 'A' + 10
		default:
			return 0, p.fail("invalid \\u escape")
		}
		r = r<<4 | rune(d)
		p.i++
	}
	return r, nil
}
