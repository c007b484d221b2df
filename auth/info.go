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
	for d.i < len(d.s) {
		switch d.s[d.i] {
		case ' ', '\t', '\n', '\r':
			d.i++
		default:
			return
		}
	}
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
	start := d.i
	for d.i < len(d.s) && d.i-start <= 128 {
		c := d.s[d.i]
		if c == '"' {
			v := d.s[start:d.i]
			d.i++
			return v, len(v) > 0
		}
		if c < 0x20 || c > 0x7e || c == '\\' {
			return "", false
		}
		d.i++
	}
	return "", false
}

// string reads one JSON string (the opening quote at i).
func (d *infoScanner) string() bool {
	if !d.byte('"') {
		return false
	}
	for d.i < len(d.s) {
		c := d.s[d.i]
		switch {
		case c == '"':
			d.i++
			return true
		case c < 0x20:
			return false
		case c == '\\':
			d.i++
			if d.i >= len(d.s) {
				return false
			}
			switch d.s[d.i] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				d.i++
			case 'u':
				if d.i+5 > len(d.s) {
					return false
				}
				for _, h := range []byte(d.s[d.i+1 : d.i+5]) {
					if !isHex(h) {
						return false
					}
				}
				d.i += 5
			default:
				return false
			}
		default:
			d.i++
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
	start := d.i
	for d.i < len(d.s) && d.s[d.i] >= '0' && d.s[d.i] <= '9' {
		d.i++
	}
	return d.i > start
}
