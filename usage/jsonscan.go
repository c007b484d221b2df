// The JSON scanning of the usage decoder: whitespace, objects, strings,
// numbers, skipped values. Strict RFC 8259: invalid UTF-8, lone surrogate
// escapes and malformed numbers are errors.

package usage

import (
	"strconv"
	"strings"
	"unicode/utf8"
)

func (d *decoder) ws() {
	data, i := d.data, d.pos
	for i < len(data) && (data[i] == ' ' || data[i] == '\t' || data[i] == '\n' || data[i] == '\r') {
		i++
	}
	d.pos = i
}

// expect consumes byte c (after whitespace).
func (d *decoder) expect(c byte, at loc) error {
	d.ws()
	if d.pos >= len(d.data) {
		return fail(at, "unexpected end of input, want "+strconv.QuoteRune(rune(c)))
	}
	if d.data[d.pos] != c {
		return fail(at, "unexpected "+strconv.QuoteRune(rune(d.data[d.pos]))+", want "+strconv.QuoteRune(rune(c)))
	}
	d.pos++
	return nil
}

// peek returns the next non-space byte, or 0 at the end.
func (d *decoder) peek() byte {
	d.ws()
	if d.pos >= len(d.data) {
		return 0
	}
	return d.data[d.pos]
}

// object calls field for every member of an object at at; field reports
// whether it read the member's value (else it is skipped).
func (d *decoder) object(at loc, field func(name string) (bool, error)) error {
	if err := d.expect('{', at); err != nil {
		return err
	}
	if d.peek() == '}' {
		d.pos++
		return nil
	}
	for {
		name, err := d.str(at)
		if err != nil {
			return err
		}
		if err := d.expect(':', at); err != nil {
			return err
		}
		known, err := field(name)
		if err != nil {
			return err
		}
		if !known {
			if err := d.skip(at.with(name), 0); err != nil {
				return err
			}
		}
		switch d.peek() {
		case ',':
			d.pos++
		case '}':
			d.pos++
			return nil
		case 0:
			return fail(at, "unexpected end of input")
		default:
			return fail(at, "unexpected "+strconv.QuoteRune(rune(d.data[d.pos]))+" after a member")
		}
	}
}

// str reads a JSON string; invalid UTF-8 (raw or through lone surrogate
// escapes) is an error. A string without escapes is a substring of data.
func (d *decoder) str(at loc) (string, error) {
	if err := d.expect('"', at); err != nil {
		return "", err
	}
	start := d.pos
	// The common string: printable ASCII without escapes (in locals: the
	// loop is the decoder's hottest).
	data, i := d.data, d.pos
	for i < len(data) && plainASCII[data[i]] {
		i++
	}
	if i < len(data) && data[i] == '"' {
		d.pos = i + 1
		return data[start:i], nil
	}
	d.pos = i
	ascii := true
	for d.pos < len(d.data) {
		c := d.data[d.pos]
		if c == '"' {
			s := d.data[start:d.pos]
			d.pos++
			if !ascii && !utf8.ValidString(s) {
				return "", fail(at, "is not valid UTF-8")
			}
			return s, nil
		}
		if c == '\\' {
			break
		}
		if c < 0x20 {
			return "", fail(at, "has a raw control character")
		}
		if c >= utf8.RuneSelf {
			ascii = false
		}
		d.pos++
	}
	buf := []byte(d.data[start:d.pos])
	for d.pos < len(d.data) {
		c := d.data[d.pos]
		switch {
		case c == '"':
			d.pos++
			if !utf8.Valid(buf) {
				return "", fail(at, "is not valid UTF-8")
			}
			return string(buf), nil
		case c < 0x20:
			return "", fail(at, "has a raw control character")
		case c != '\\':
			buf = append(buf, c)
			d.pos++
			continue
		}
		d.pos++
		if d.pos >= len(d.data) {
			break
		}
		e := d.data[d.pos]
		d.pos++
		switch e {
		case '"', '\\', '/':
			buf = append(buf, e)
		case 'b':
			buf = append(buf, '\b')
		case 'f':
			buf = append(buf, '\f')
		case 'n':
			buf = append(buf, '\n')
		case 'r':
			buf = append(buf, '\r')
		case 't':
			buf = append(buf, '\t')
		case 'u':
			r, ok := d.hex4()
			if !ok {
				return "", fail(at, `has a bad \u escape`)
			}
			if r >= 0xd800 && r <= 0xdfff {
				// A high surrogate must be followed by \u and a low one.
				if r >= 0xdc00 || d.pos+1 >= len(d.data) || d.data[d.pos] != '\\' || d.data[d.pos+1] != 'u' {
					return "", fail(at, "is not valid UTF-8 (lone surrogate)")
				}
				d.pos += 2
				lo, ok := d.hex4()
				if !ok || lo < 0xdc00 || lo > 0xdfff {
					return "", fail(at, "is not valid UTF-8 (lone surrogate)")
				}
				r = 0x10000 + (r-0xd800)<<10 + (lo - 0xdc00)
			}
			buf = utf8.AppendRune(buf, r)
		default:
			return "", fail(at, "has a bad escape")
		}
	}
	return "", fail(at, "unterminated string")
}

func (d *decoder) hex4() (rune, bool) {
	if d.pos+4 > len(d.data) {
		return 0, false
	}
	var r rune
	for k := 0; k < 4; k++ {
		c := d.data[d.pos+k]
		switch {
		case c >= '0' && c <= '9':
			r = r<<4 | rune(c-'0')
		case c >= 'a' && c <= 'f':
			r = r<<4 | rune(c-'a'+10)
		case c >= 'A' && c <= 'F':
			r = r<<4 | rune(c-'A'+10)
		default:
			return 0, false
		}
	}
	d.pos += 4
	return r, true
}

// number returns the text of a JSON number (validated by the caller's
// rules; here only its extent is found).
func (d *decoder) number(at loc) (string, error) {
	d.ws()
	start := d.pos
	for d.pos < len(d.data) {
		if !numberByte(d.data[d.pos]) {
			break
		}
		d.pos++
	}
	if d.pos == start {
		return "", fail(at, "is not a number")
	}
	return d.data[start:d.pos], nil
}

// uint reads a JSON integer >= 0 (no sign, fraction or exponent).
func (d *decoder) uint(at loc) (uint64, error) {
	// The common integer: 1 to 19 digits, no leading zero, then a byte
	// that cannot continue a number (the rest take the checked path).
	d.ws()
	var n uint64
	data, start := d.data, d.pos
	i := start
	for i < len(data) && i-start < 19 && data[i] >= '0' && data[i] <= '9' {
		n = n*10 + uint64(data[i]-'0')
		i++
	}
	if i > start && (i-start == 1 || data[start] != '0') && (i == len(data) || !numberByte(data[i])) {
		d.pos = i
		return n, nil
	}
	text, err := d.number(at)
	if err != nil {
		return 0, err
	}
	if len(text) > 1 && text[0] == '0' {
		return 0, fail(at, strconv.Quote(text)+" is not an integer >= 0")
	}
	n, err = strconv.ParseUint(text, 10, 64)
	if err != nil {
		return 0, fail(at, strconv.Quote(text)+" is not an integer >= 0 below 2^64")
	}
	return n, nil
}

// numberByte reports whether c can be part of a JSON number's text.
func numberByte(c byte) bool {
	return c >= '0' && c <= '9' || c == '-' || c == '+' || c == '.' || c == 'e' || c == 'E'
}

// plainASCII holds the bytes a string's common fast path reads: printable
// ASCII other than '"' and '\\'.
var plainASCII = func() (t [256]bool) {
	for c := 0x20; c < 0x7f; c++ {
		t[c] = c != '"' && c != '\\'
	}
	return t
}()

// skip skips one JSON value, checking that it is well formed.
func (d *decoder) skip(at loc, depth int) error {
	if depth > maxSkipDepth {
		return fail(at, "nests too deep")
	}
	switch c := d.peek(); {
	case c == '"':
		_, err := d.str(at)
		return err
	case c == '{':
		return d.object(at, func(string) (bool, error) { return true, d.skip(at, depth+1) })
	case c == '[':
		return d.array(at, func(int) error { return d.skip(at, depth+1) })
	case c == 't':
		return d.literal(at, "true")
	case c == 'f':
		return d.literal(at, "false")
	case c == 'n':
		return d.literal(at, "null")
	case c == '-' || c >= '0' && c <= '9':
		text, err := d.number(at)
		if err != nil {
			return err
		}
		if !validJSONNumber(text) {
			return fail(at, strconv.Quote(text)+" is not a JSON number")
		}
		return nil
	case c == 0:
		return fail(at, "unexpected end of input")
	default:
		return fail(at, "unexpected "+strconv.QuoteRune(rune(c)))
	}
}

func (d *decoder) literal(at loc, lit string) error {
	if !strings.HasPrefix(d.data[d.pos:], lit) {
		return fail(at, "bad literal")
	}
	d.pos += len(lit)
	return nil
}

// validJSONNumber reports whether s is a number in JSON's grammar.
func validJSONNumber(s string) bool {
	i := 0
	if i < len(s) && s[i] == '-' {
		i++
	}
	switch {
	case i < len(s) && s[i] == '0':
		i++
	case i < len(s) && s[i] >= '1' && s[i] <= '9':
		for i < len(s) && s[i] >= '0' && s[i] <= '9' {
			i++
		}
	default:
		return false
	}
	if i < len(s) && s[i] == '.' {
		i++
		j := i
		for i < len(s) && s[i] >= '0' && s[i] <= '9' {
			i++
		}
		if i == j {
			return false
		}
	}
	if i < len(s) && (s[i] == 'e' || s[i] == 'E') {
		i++
		if i < len(s) && (s[i] == '+' || s[i] == '-') {
			i++
		}
		j := i
		for i < len(s) && s[i] >= '0' && s[i] <= '9' {
			i++
		}
		if i == j {
			return false
		}
	}
	return i == len(s)
}

// array reads a JSON array, calling elem for each element.
func (d *decoder) array(at loc, elem func(i int) error) error {
	if err := d.expect('[', at); err != nil {
		return err
	}
	if d.peek() == ']' {
		d.pos++
		return nil
	}
	return d.arrayFrom(at, 0, elem)
}

// arrayFrom reads the rest of an array from its element i on (d.pos at
// that element).
func (d *decoder) arrayFrom(at loc, i int, elem func(i int) error) error {
	for ; ; i++ {
		if i >= maxGrouped {
			return fail(at, "has over "+strconv.Itoa(maxGrouped)+" elements")
		}
		if err := elem(i); err != nil {
			return err
		}
		switch d.peek() {
		case ',':
			d.pos++
		case ']':
			d.pos++
			return nil
		default:
			return fail(at, "unexpected input after an element")
		}
	}
}
