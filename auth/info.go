package auth

import (
	"fmt"
	"strings"
)

// RequestInfoHeader is the header in which the NATS server states who sent
// a request that crossed a service import: the JSON of server.ClientInfo,
// whose field "acc" is the calling account (its public key in operator
// mode). The server replaces any value the sender set. Inside one account
// no import is crossed and the header is whatever the sender wrote.
const RequestInfoHeader = "Nats-Request-Info"

// maxInfoDepth bounds the nesting of a Nats-Request-Info value (the
// server's has depth 2: the object and its arrays).
const maxInfoDepth = 16

// RequestInfoAccount returns the "acc" field of a Nats-Request-Info value:
// a substring of info, so it allocates nothing. info must be one JSON
// object, valid throughout, with exactly one field named "acc" (in any
// letter case, as encoding/json matches names), whose value is a string of
// 1..128 printable ASCII characters without escapes; object keys must not
// hold escapes. Anything else is an error wrapping [ErrBadRequestInfo].
// Whatever it accepts, encoding/json decodes to the same account.
func RequestInfoAccount(info string) (string, error) {
	s := infoScanner{s: info}
	s.space()
	if !s.byte('{') {
		return "", s.fail("not a JSON object")
	}
	var acc string
	found := false
	s.space()
	if !s.byte('}') {
		for {
			s.space()
			key, ok := s.key()
			if !ok {
				return "", s.fail("bad object key")
			}
			s.space()
			if !s.byte(':') {
				return "", s.fail("missing ':'")
			}
			s.space()
			if len(key) == 3 && strings.EqualFold(key, "acc") {
				if found {
					return "", s.fail(`"acc" given twice`)
				}
				found = true
				v, ok := s.plainString()
				if !ok {
					return "", s.fail(`"acc" is not a plain string`)
				}
				acc = v
			} else if !s.value(1) {
				return "", s.fail("bad value")
			}
			s.space()
			if s.byte('}') {
				break
			}
			if !s.byte(',') {
				return "", s.fail("missing ',' or '}'")
			}
		}
	}
	s.space()
	if s.i != len(s.s) {
		return "", s.fail("data after the object")
	}
	if !found {
		return "", fmt.Errorf(`%w: no "acc" field`, ErrBadRequestInfo)
	}
	return acc, nil
}

// infoScanner reads a JSON text: s from byte i on.
type infoScanner struct {
	s string
	i int
}

func (d *infoScanner) fail(what string) error {
	return fmt.Errorf("%w: %s at byte %d", ErrBadRequestInfo, what, d.i)
}

func (d *infoScanner) space() {
	s, i := d.s, d.i
	for i < len(s) && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r') {
		i++
	}
	d.i = i
}

func (d *infoScanner) byte(c byte) bool {
	if d.i < len(d.s) && d.s[d.i] == c {
		d.i++
		return true
	}
	return false
}

// key reads an object key without escapes.
func (d *infoScanner) key() (string, bool) {
	start := d.i
	if !d.string() {
		return "", false
	}
	k := d.s[start+1 : d.i-1]
	return k, strings.IndexByte(k, '\\') < 0
}

// plainString reads a string of 1..128 printable ASCII bytes without
// escapes.
func (d *infoScanner) plainString() (string, bool) {
	if !d.byte('"') {
		return "", false
	}
	rest := d.s[d.i:]
	end := strings.IndexByte(rest, '"')
	if end < 1 || end > 128 {
		return "", false
	}
	v := rest[:end]
	for i := 0; i < len(v); i++ {
		if c := v[i]; c < 0x20 || c > 0x7e || c == '\\' {
			return "", false
		}
	}
	d.i += end + 1
	return v, true
}

// string reads one JSON string (the opening quote at i).
func (d *infoScanner) string() bool {
	if !d.byte('"') {
		return false
	}
	s, i := d.s, d.i
	for i < len(s) {
		switch c := s[i]; {
		case c == '"':
			d.i = i + 1
			return true
		case c < 0x20:
			return false
		case c != '\\':
			i++
		case i+1 < len(s) && strings.IndexByte(`"\/bfnrt`, s[i+1]) >= 0:
			i += 2
		case i+5 < len(s) && s[i+1] == 'u' && isHex(s[i+2]) && isHex(s[i+3]) && isHex(s[i+4]) && isHex(s[i+5]):
			i += 6
		default:
			return false
		}
	}
	return false
}

func isHex(c byte) bool {
	return c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F'
}

// value reads any JSON value at nesting depth.
func (d *infoScanner) value(depth int) bool {
	if d.i >= len(d.s) {
		return false
	}
	switch c := d.s[d.i]; {
	case c == '"':
		return d.string()
	case c == '{':
		if depth >= maxInfoDepth {
			return false
		}
		d.i++
		d.space()
		if d.byte('}') {
			return true
		}
		for {
			d.space()
			if !d.string() {
				return false
			}
			d.space()
			if !d.byte(':') {
				return false
			}
			d.space()
			if !d.value(depth + 1) {
				return false
			}
			d.space()
			if d.byte('}') {
				return true
			}
			if !d.byte(',') {
				return false
			}
		}
	case c == '[':
		if depth >= maxInfoDepth {
			return false
		}
		d.i++
		d.space()
		if d.byte(']') {
			return true
		}
		for {
			d.space()
			if !d.value(depth + 1) {
				return false
			}
			d.space()
			if d.byte(']') {
				return true
			}
			if !d.byte(',') {
				return false
			}
		}
	case c == '-' || c >= '0' && c <= '9':
		return d.number()
	case c == 't':
		return d.lit("true")
	case c == 'f':
		return d.lit("false")
	case c == 'n':
		return d.lit("null")
	}
	return false
}

func (d *infoScanner) lit(w string) bool {
	if strings.HasPrefix(d.s[d.i:], w) {
		d.i += len(w)
		return true
	}
	return false
}

// number reads a JSON number: -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
func (d *infoScanner) number() bool {
	d.byte('-')
	switch {
	case d.byte('0'):
	case d.i < len(d.s) && d.s[d.i] >= '1' && d.s[d.i] <= '9':
		d.digits()
	default:
		return false
	}
	if d.byte('.') && !d.digits() {
		return false
	}
	if d.byte('e') || d.byte('E') {
		if !d.byte('+') {
			d.byte('-')
		}
		if !d.digits() {
			return false
		}
	}
	return true
}

// digits reads [0-9]* and reports whether there was at least one.
func (d *infoScanner) digits() bool {
	s, i := d.s, d.i
	for i < len(s) && s[i] >= '0' && s[i] <= '9' {
		i++
	}
	ok := i > d.i
	d.i = i
	return ok
}
