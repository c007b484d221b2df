// The usage decoder's reading of JSON, on a wire.Scanner: strict RFC
// 8259, so invalid UTF-8 and lone surrogate escapes are errors, and every
// error names the field it is in.

package usage

import (
	"strconv"

	"github.com/limitmesh/limitmesh/internal/wire"
)

// syntax names the field at at in a syntax error of the scanner.
func syntax(at loc, err error) error { return fail(at, err.Error()) }

// expect consumes byte c (after whitespace).
func (d *decoder) expect(c byte, at loc) error {
	if err := d.sc.Expect(c); err != nil {
		return syntax(at, err)
	}
	return nil
}

// peek returns the next non-space byte, or 0 at the end.
func (d *decoder) peek() byte { return d.sc.Peek() }

// object calls field for every member of an object at at; field reports
// whether it read the member's value (else it is skipped).
func (d *decoder) object(at loc, field func(name string) (bool, error)) error {
	if err := d.expect('{', at); err != nil {
		return err
	}
	var name string
	for first := true; ; first = false {
		more, err := d.sc.More('}', first)
		if err != nil {
			if !first {
				at = at.with(name) // what cannot follow a value belongs to it ("x":01)
			}
			return syntax(at, err)
		}
		if !more {
			return nil
		}
		name, err = d.str(at)
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
			if err := d.skip(at.with(name)); err != nil {
				return err
			}
		}
	}
}

// str reads a JSON string; invalid UTF-8 (raw or through lone surrogate
// escapes) is an error. A string without escapes is a substring of data.
func (d *decoder) str(at loc) (string, error) {
	s, flags, err := d.sc.String()
	switch {
	case err != nil:
		return "", syntax(at, err)
	case flags&wire.InvalidUTF8 != 0:
		return "", fail(at, "is not valid UTF-8")
	}
	return s, nil
}

// number returns the text of a JSON number (what it means is checked by
// the caller's rules).
func (d *decoder) number(at loc) (string, error) {
	text, err := d.sc.Number()
	if err != nil {
		return "", syntax(at, err)
	}
	return text, nil
}

// uint reads a JSON integer >= 0 (no sign, fraction or exponent).
func (d *decoder) uint(at loc) (uint64, error) {
	// The common integer: 1 to 19 digits, no leading zero, then a byte
	// that cannot continue a number (the rest take the checked path).
	d.sc.Space()
	var n uint64
	data, start := d.sc.Text, d.sc.Pos
	i := start
	for i < len(data) && i-start < 19 && data[i] >= '0' && data[i] <= '9' {
		n = n*10 + uint64(data[i]-'0')
		i++
	}
	if i > start && (i-start == 1 || data[start] != '0') && (i == len(data) || !numberByte(data[i])) {
		d.sc.Pos = i
		return n, nil
	}
	text, err := d.number(at)
	if err != nil {
		return 0, err
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

// skip skips one JSON value, checking that it is well formed and that its
// strings are valid UTF-8.
func (d *decoder) skip(at loc) error {
	flags, err := d.sc.Skip(maxSkipDepth)
	switch {
	case err != nil:
		return syntax(at, err)
	case flags&wire.InvalidUTF8 != 0:
		return fail(at, "has a string that is not valid UTF-8")
	}
	return nil
}

// array reads a JSON array, calling elem for each element.
func (d *decoder) array(at loc, elem func(i int) error) error {
	if err := d.expect('[', at); err != nil {
		return err
	}
	if d.peek() == ']' {
		d.sc.Pos++
		return nil
	}
	return d.arrayFrom(at, 0, elem)
}

// arrayFrom reads the rest of an array from its element i on (the cursor
// at that element).
func (d *decoder) arrayFrom(at loc, i int, elem func(i int) error) error {
	for ; ; i++ {
		if i >= maxGrouped {
			return fail(at, "has over "+strconv.Itoa(maxGrouped)+" elements")
		}
		if err := elem(i); err != nil {
			return err
		}
		more, err := d.sc.More(']', false)
		if err != nil {
			return syntax(at, err)
		}
		if !more {
			return nil
		}
	}
}
