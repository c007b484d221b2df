package service

import (
	"fmt"
	"strconv"
	"unicode/utf8"

	"github.com/limitmesh/limitmesh/mesh/internal/fail"
)

// The strict decoder's JSON parser: RFC 8259 into a tree of jsonValue,
// nothing more (request_strict.go applies the contract's rules to the
// tree).

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
