package wire

import (
	"strconv"
	"strings"
	"unicode/utf8"
)

// Scanner reads JSON text (RFC 8259) one token at a time, leaving the
// shape of what is read to its caller: a decoder calls the method for the
// token it expects next. Every method first skips white space (space, tab,
// line feed, carriage return: nothing else). Strings without escapes are
// returned as substrings of Text, so reading allocates only for escaped
// strings and errors.
//
// Errors are *[SyntaxError] and leave Pos at the offending byte; a Scanner
// is not used after one. The zero value reads an empty text. A Scanner is
// not safe for concurrent use.
type Scanner struct {
	Text string // the JSON text
	Pos  int    // offset in Text of the next byte to read
}

// SyntaxError is text that is not JSON: Msg says what is wrong at byte
// Offset.
type SyntaxError struct {
	Offset int
	Msg    string
}

func (e *SyntaxError) Error() string {
	return "malformed JSON at byte " + strconv.Itoa(e.Offset) + ": " + e.Msg
}

// StringFlags describe how a string was written.
type StringFlags uint8

const (
	// Escaped: the string holds at least one escape.
	Escaped StringFlags = 1 << iota
	// InvalidUTF8: the string is not valid UTF-8 after unescaping: it has
	// a byte of invalid UTF-8 or an unpaired surrogate escape (\ud800).
	// RFC 8259 §8.1 requires UTF-8; each decoder decides whether such a
	// string is an error, and where to report it.
	InvalidUTF8
)

func (s *Scanner) fail(msg string) error { return &SyntaxError{Offset: s.Pos, Msg: msg} }

// Unexpected returns the error for the byte at Pos: "unexpected 'x'",
// "unexpected byte 0xff" or "unexpected end of input".
func (s *Scanner) Unexpected() error {
	if s.Pos >= len(s.Text) {
		return s.fail("unexpected end of input")
	}
	c := s.Text[s.Pos]
	if c >= 0x20 && c < 0x7f {
		return s.fail("unexpected " + strconv.QuoteRune(rune(c)))
	}
	return s.fail("unexpected byte 0x" + string([]byte{hexDigits[c>>4], hexDigits[c&0xf]}))
}

// Space skips white space.
func (s *Scanner) Space() {
	t, i := s.Text, s.Pos
	for i < len(t) && (t[i] == ' ' || t[i] == '\t' || t[i] == '\n' || t[i] == '\r') {
		i++
	}
	s.Pos = i
}

// Peek returns the next byte after white space without reading it, or 0
// at the end of the text (a NUL byte, never valid outside a string, also
// reads as 0).
func (s *Scanner) Peek() byte {
	s.Space()
	if s.Pos < len(s.Text) {
		return s.Text[s.Pos]
	}
	return 0
}

// Consume reads the byte c (not 0) if it comes next and reports whether it
// did.
func (s *Scanner) Consume(c byte) bool {
	if s.Peek() == c {
		s.Pos++
		return true
	}
	return false
}

// Expect reads the byte c (not 0), or returns the error for what comes
// instead.
func (s *Scanner) Expect(c byte) error {
	if s.Consume(c) {
		return nil
	}
	return s.Unexpected()
}

// End checks that only white space is left.
func (s *Scanner) End() error {
	s.Space()
	if s.Pos != len(s.Text) {
		return s.fail("data after the JSON value")
	}
	return nil
}

// Literal reads word ("true", "false" or "null") if it comes next and
// reports whether it did.
func (s *Scanner) Literal(word string) bool {
	s.Space()
	if strings.HasPrefix(s.Text[s.Pos:], word) {
		s.Pos += len(word)
		return true
	}
	return false
}

// ExpectLiteral reads word, or returns the error for the first byte that
// differs.
func (s *Scanner) ExpectLiteral(word string) error {
	s.Space()
	for k := 0; k < len(word); k++ {
		if s.Pos >= len(s.Text) || s.Text[s.Pos] != word[k] {
			return s.Unexpected()
		}
		s.Pos++
	}
	return nil
}

// More steps through an object or an array whose opening byte has been
// read: it reads the closing byte close ('}' or ']') and returns false, or
// returns true when a member or element comes next, reading the ',' before
// it unless first. first is true before the first member or element, where
// a ',' is an error (and so is anything but a separator or the closing
// byte after a value).
func (s *Scanner) More(close byte, first bool) (bool, error) {
	switch c := s.Peek(); {
	case c == close && c != 0:
		s.Pos++
		return false, nil
	case first:
		return true, nil
	case c == ',':
		s.Pos++
		return true, nil
	}
	return false, s.Unexpected()
}

// plain marks the bytes of the common string: printable ASCII other than
// '"' and '\'.
var plain = func() (t [256]bool) {
	for c := 0x20; c < 0x7f; c++ {
		t[c] = c != '"' && c != '\\'
	}
	return t
}()

// PlainString reads a string of printable ASCII without escapes (the
// common string of this project's formats) and returns its contents, a
// substring of Text. It returns false, having read only white space, when
// the next value is anything else.
func (s *Scanner) PlainString() (string, bool) {
	s.Space()
	t, i := s.Text, s.Pos
	if i >= len(t) || t[i] != '"' {
		return "", false
	}
	i++
	start := i
	for i < len(t) && plain[t[i]] {
		i++
	}
	if i < len(t) && t[i] == '"' {
		s.Pos = i + 1
		return t[start:i], true
	}
	return "", false
}

// String reads a string and returns it unescaped, with flags saying
// whether it had escapes and whether it is valid UTF-8. A raw control
// character, an invalid escape and a missing closing quote are errors;
// invalid UTF-8 is not (see [InvalidUTF8]): the string then holds the
// invalid bytes as they came and U+FFFD for each unpaired surrogate.
func (s *Scanner) String() (string, StringFlags, error) {
	return s.str(true)
}

// str is String; with build false it only checks the string (and returns
// "" for one with escapes).
func (s *Scanner) str(build bool) (string, StringFlags, error) {
	s.Space()
	t, i := s.Text, s.Pos
	if i >= len(t) || t[i] != '"' {
		return "", 0, s.Unexpected()
	}
	i++
	start := i
	for i < len(t) && plain[t[i]] {
		i++
	}
	if i < len(t) && t[i] == '"' {
		s.Pos = i + 1
		return t[start:i], 0, nil
	}
	var (
		flags StringFlags
		buf   []byte
		run   = start // the raw bytes since the last escape: t[run:i]
		check = i     // t[run:check] is printable ASCII, valid UTF-8
	)
	for {
		for i < len(t) && t[i] >= 0x20 && t[i] != '"' && t[i] != '\\' {
			i++
		}
		// A raw run is valid UTF-8 exactly when it is so in the unescaped
		// string: an escape writes whole characters, never a continuation
		// byte, so it neither completes nor breaks its neighbours.
		if !utf8.ValidString(t[check:i]) {
			flags |= InvalidUTF8
		}
		if i >= len(t) {
			s.Pos = i
			return "", 0, s.fail("unterminated string")
		}
		switch t[i] {
		case '"':
			s.Pos = i + 1
			switch {
			case flags&Escaped == 0:
				return t[start:i], flags, nil
			case build:
				return string(append(buf, t[run:i]...)), flags, nil
			}
			return "", flags, nil
		case '\\':
			flags |= Escaped
			if build {
				buf = append(buf, t[run:i]...)
			}
			s.Pos = i
			r, ok, err := s.escape()
			if err != nil {
				return "", 0, err
			}
			if !ok {
				flags |= InvalidUTF8
			}
			if build {
				buf = utf8.AppendRune(buf, r)
			}
			i = s.Pos
			run, check = i, i
		default:
			s.Pos = i
			return "", 0, s.fail("control character in a string (escape it)")
		}
	}
}

// escape reads the escape at Pos (a backslash) and returns the rune it
// stands for. A \uXXXX high surrogate followed by a \uXXXX low surrogate
// is one rune; an unpaired surrogate returns U+FFFD and ok false.
func (s *Scanner) escape() (r rune, ok bool, err error) {
	s.Pos++ // '\\'
	if s.Pos >= len(s.Text) {
		return 0, false, s.fail("unterminated string")
	}
	c := s.Text[s.Pos]
	s.Pos++
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
		s.Pos--
		return 0, false, s.fail("invalid escape " + strconv.Quote(`\`+s.Text[s.Pos:s.Pos+1]))
	}
	r, err = s.hex4()
	if err != nil {
		return 0, false, err
	}
	switch {
	case r >= 0xDC00 && r <= 0xDFFF: // a low surrogate first
		return utf8.RuneError, false, nil
	case r >= 0xD800 && r <= 0xDBFF: // a high surrogate: a low one must follow
		if s.Pos+1 < len(s.Text) && s.Text[s.Pos] == '\\' && s.Text[s.Pos+1] == 'u' {
			save := s.Pos
			s.Pos += 2
			lo, err := s.hex4()
			if err != nil {
				return 0, false, err
			}
			if lo >= 0xDC00 && lo <= 0xDFFF {
				return 0x10000 + (r-0xD800)<<10 + (lo - 0xDC00), true, nil
			}
			s.Pos = save // not a low surrogate: an escape of its own
		}
		return utf8.RuneError, false, nil
	}
	return r, true, nil
}

// hex4 reads four hex digits.
func (s *Scanner) hex4() (rune, error) {
	var r rune
	for k := 0; k < 4; k++ {
		if s.Pos >= len(s.Text) {
			return 0, s.fail("unterminated string")
		}
		c := s.Text[s.Pos]
		var d byte
		switch {
		case c >= '0' && c <= '9':
			d = c - '0'
		case c >= 'a' && c <= 'f':
			d = c - 'a' + 10
		case c >= 'A' && c <= 'F':
			d = c - 'A' + 10
		default:
			return 0, s.fail(`invalid \u escape`)
		}
		r = r<<4 | rune(d)
		s.Pos++
	}
	return r, nil
}

// Number reads a number, `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]?
// [0-9]+)?`, and returns its text, a substring of Text. What the number
// means (its range, whether a fraction or an exponent is allowed) is the
// caller's to check.
func (s *Scanner) Number() (string, error) {
	s.Space()
	t, i := s.Text, s.Pos
	start := i
	if i < len(t) && t[i] == '-' {
		i++
	}
	switch {
	case i < len(t) && t[i] == '0':
		i++
	case i < len(t) && t[i] >= '1' && t[i] <= '9':
		i = digits(t, i)
	default:
		s.Pos = i
		return "", s.Unexpected()
	}
	if i < len(t) && t[i] == '.' {
		j := digits(t, i+1)
		if j == i+1 {
			s.Pos = j
			return "", s.Unexpected()
		}
		i = j
	}
	if i < len(t) && (t[i] == 'e' || t[i] == 'E') {
		i++
		if i < len(t) && (t[i] == '+' || t[i] == '-') {
			i++
		}
		j := digits(t, i)
		if j == i {
			s.Pos = j
			return "", s.Unexpected()
		}
		i = j
	}
	s.Pos = i
	return t[start:i], nil
}

// digits returns the end of the run of digits in t from i.
func digits(t string, i int) int {
	for i < len(t) && t[i] >= '0' && t[i] <= '9' {
		i++
	}
	return i
}

// Skip reads one value of any kind, checking that it is well formed, and
// returns the flags of the strings in it, member names included, or'ed
// together. The value may nest objects and arrays at most maxDepth levels
// deep (an object of scalars is one level; with maxDepth 0 only a scalar
// is read).
func (s *Scanner) Skip(maxDepth int) (StringFlags, error) {
	var f StringFlags
	err := s.skip(maxDepth, &f)
	return f, err
}

func (s *Scanner) skip(levels int, f *StringFlags) error {
	switch c := s.Peek(); {
	case c == '"':
		_, sf, err := s.str(false)
		*f |= sf
		return err
	case c == '{' || c == '[':
		if levels <= 0 {
			return s.fail("nested too deep")
		}
		s.Pos++
		end := byte(']')
		if c == '{' {
			end = '}'
		}
		for first := true; ; first = false {
			more, err := s.More(end, first)
			if err != nil || !more {
				return err
			}
			if c == '{' {
				_, sf, err := s.str(false)
				*f |= sf
				if err != nil {
					return err
				}
				if err := s.Expect(':'); err != nil {
					return err
				}
			}
			if err := s.skip(levels-1, f); err != nil {
				return err
			}
		}
	case c == 't':
		return s.ExpectLiteral("true")
	case c == 'f':
		return s.ExpectLiteral("false")
	case c == 'n':
		return s.ExpectLiteral("null")
	case c == '-' || c >= '0' && c <= '9':
		_, err := s.Number()
		return err
	}
	return s.Unexpected()
}
