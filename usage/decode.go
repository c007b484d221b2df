package usage

import (
	"errors"
	"strconv"
	"unicode"
	"unicode/utf8"

	"github.com/limitmesh/limitmesh/policies"
)

// DecodeBatch decodes and validates one usage stream message (CONTRACT.md
// §6). It is strict, because anyone able to publish on the usage subjects
// can send it anything:
//
//   - the body is one JSON object (whitespace around it is allowed) with
//     "node" (1..256 bytes of printable UTF-8), "policy" ("" or a policy
//     name, [a-z0-9][a-z0-9_-]{0,63}) and "records" (an array);
//   - each record has "id" (1..256 bytes of printable UTF-8), "t_us" (an
//     integer >= 0), "revision" (an integer >= 0), "key" ("" exactly when
//     the batch's policy is "", else a valid KV key of at most 256 bytes),
//     "descriptor" (an object following CONTRACT.md §2), "cost" (a JSON
//     number > 0 and <= 1e9 with at most 6 fractional digits, no exponent),
//     "result" ("allowed" or "denied") and optionally "request_id" (at most
//     128 bytes of printable UTF-8);
//   - unknown fields are skipped (new optional fields are a compatible
//     extension); a known field given twice, a missing required field,
//     invalid UTF-8 in a string and trailing data are errors.
//
// Errors match [ErrInvalid] and name the field. The returned descriptors
// are sorted by name.
func DecodeBatch(data []byte) (Batch, error) {
	d := decoder{data: data}
	b, err := d.batch()
	if err != nil {
		return Batch{}, err
	}
	return b, nil
}

// decodeError is a rejection naming the offending field.
type decodeError struct {
	path   string
	reason string
}

func (e *decodeError) Error() string {
	if e.path == "" {
		return "usage: invalid batch: " + e.reason
	}
	return "usage: invalid batch: " + e.path + ": " + e.reason
}

func (e *decodeError) Is(target error) bool { return target == ErrInvalid }

// maxSkipDepth bounds the nesting of unknown fields' values.
const maxSkipDepth = 32

// decoder reads one batch from data; pos is the next byte.
type decoder struct {
	data []byte
	pos  int
}

func fail(path, reason string) error { return &decodeError{path: path, reason: reason} }

func (d *decoder) ws() {
	for d.pos < len(d.data) {
		switch d.data[d.pos] {
		case ' ', '\t', '\n', '\r':
			d.pos++
		default:
			return
		}
	}
}

// expect consumes byte c (after whitespace).
func (d *decoder) expect(c byte, path string) error {
	d.ws()
	if d.pos >= len(d.data) {
		return fail(path, "unexpected end of input, want "+strconv.QuoteRune(rune(c)))
	}
	if d.data[d.pos] != c {
		return fail(path, "unexpected "+strconv.QuoteRune(rune(d.data[d.pos]))+", want "+strconv.QuoteRune(rune(c)))
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

// object calls field for every member of an object, after checking
// duplicates are not given for names that field knows (field reports
// whether it knew the name).
func (d *decoder) object(path string, field func(name string) (bool, error)) error {
	if err := d.expect('{', path); err != nil {
		return err
	}
	if d.peek() == '}' {
		d.pos++
		return nil
	}
	for {
		name, err := d.str(path)
		if err != nil {
			return err
		}
		if err := d.expect(':', path); err != nil {
			return err
		}
		known, err := field(name)
		if err != nil {
			return err
		}
		if !known {
			if err := d.skip(path+"."+name, 0); err != nil {
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
			return fail(path, "unexpected end of input")
		default:
			return fail(path, "unexpected "+strconv.QuoteRune(rune(d.data[d.pos]))+" after a member")
		}
	}
}

func (d *decoder) batch() (Batch, error) {
	var (
		b    Batch
		seen uint8
	)
	const (
		fNode = 1 << iota
		fPolicy
		fRecords
	)
	err := d.object("", func(name string) (bool, error) {
		var bit uint8
		switch name {
		case "node":
			bit = fNode
		case "policy":
			bit = fPolicy
		case "records":
			bit = fRecords
		default:
			return false, nil
		}
		if seen&bit != 0 {
			return true, fail(name, "given twice")
		}
		seen |= bit
		var err error
		switch bit {
		case fNode:
			b.Node, err = d.str("node")
			if err == nil {
				err = checkID("node", b.Node)
			}
		case fPolicy:
			b.Policy, err = d.str("policy")
			if err == nil && b.Policy != "" && policies.ValidateName(b.Policy) != nil {
				err = fail("policy", strconv.Quote(b.Policy)+" is not [a-z0-9][a-z0-9_-]{0,63}")
			}
		case fRecords:
			b.Records, err = d.records()
		}
		return true, err
	})
	if err != nil {
		return Batch{}, err
	}
	d.ws()
	if d.pos != len(d.data) {
		return Batch{}, fail("", "trailing data after the batch")
	}
	switch {
	case seen&fNode == 0:
		return Batch{}, fail("node", "missing")
	case seen&fPolicy == 0:
		return Batch{}, fail("policy", "missing")
	case seen&fRecords == 0:
		return Batch{}, fail("records", "missing")
	}
	// A key is "" exactly for the decisions no policy matched.
	for i := range b.Records {
		switch k := b.Records[i].Key; {
		case b.Policy == "" && k != "":
			return Batch{}, fail("records["+strconv.Itoa(i)+"].key", "must be \"\" in a batch of policy \"\"")
		case b.Policy != "" && k == "":
			return Batch{}, fail("records["+strconv.Itoa(i)+"].key", "is empty")
		}
	}
	return b, nil
}

func (d *decoder) records() ([]Record, error) {
	if err := d.expect('[', "records"); err != nil {
		return nil, err
	}
	var out []Record
	if d.peek() == ']' {
		d.pos++
		return out, nil
	}
	for i := 0; ; i++ {
		r, err := d.record("records[" + strconv.Itoa(i) + "]")
		if err != nil {
			return nil, err
		}
		out = append(out, r)
		switch d.peek() {
		case ',':
			d.pos++
		case ']':
			d.pos++
			return out, nil
		default:
			return nil, fail("records", "unexpected input after a record")
		}
	}
}

func (d *decoder) record(path string) (Record, error) {
	var (
		r    Record
		seen uint16
		dims []policies.Dim
	)
	const (
		fID = 1 << iota
		fTime
		fRevision
		fKey
		fDescriptor
		fCost
		fResult
		fRequestID
		required = fID | fTime | fRevision | fKey | fDescriptor | fCost | fResult
	)
	err := d.object(path, func(name string) (bool, error) {
		var bit uint16
		switch name {
		case "id":
			bit = fID
		case "t_us":
			bit = fTime
		case "revision":
			bit = fRevision
		case "key":
			bit = fKey
		case "descriptor":
			bit = fDescriptor
		case "cost":
			bit = fCost
		case "result":
			bit = fResult
		case "request_id":
			bit = fRequestID
		default:
			return false, nil
		}
		fp := path + "." + name
		if seen&bit != 0 {
			return true, fail(fp, "given twice")
		}
		seen |= bit
		var err error
		switch bit {
		case fID:
			if r.ID, err = d.str(fp); err == nil {
				err = checkID(fp, r.ID)
			}
		case fTime:
			var n uint64
			if n, err = d.uint(fp); err == nil {
				if n > 1<<63-1 {
					err = fail(fp, "is too large")
				}
				r.TimeUs = int64(n)
			}
		case fRevision:
			r.Revision, err = d.uint(fp)
		case fKey:
			if r.Key, err = d.str(fp); err == nil {
				err = checkKey(fp, r.Key)
			}
		case fDescriptor:
			dims, err = d.descriptor(fp)
		case fCost:
			var text string
			if text, err = d.number(fp); err == nil {
				if r.Cost, err = policies.ParseCost(text); err != nil {
					err = fail(fp, strconv.Quote(text)+" is not a cost > 0 and <= 1e9 with at most 6 fractional digits")
				}
			}
		case fResult:
			var s string
			if s, err = d.str(fp); err == nil {
				switch s {
				case "allowed":
					r.Allowed = true
				case "denied":
				default:
					err = fail(fp, strconv.Quote(s)+" is not \"allowed\" or \"denied\"")
				}
			}
		case fRequestID:
			if r.RequestID, err = d.str(fp); err == nil {
				if len(r.RequestID) > MaxRequestIDLen {
					err = fail(fp, "is "+strconv.Itoa(len(r.RequestID))+" bytes (at most 128)")
				} else if reason := printable(r.RequestID); reason != "" {
					err = fail(fp, reason)
				}
			}
		}
		return true, err
	})
	if err != nil {
		return Record{}, err
	}
	if missing := required &^ seen; missing != 0 {
		names := []string{"id", "t_us", "revision", "key", "descriptor", "cost", "result"}
		for i, n := range names {
			if missing&(1<<i) != 0 {
				return Record{}, fail(path+"."+n, "missing")
			}
		}
	}
	desc, err := policies.NewDescriptor(dims)
	if err != nil {
		var pe *policies.Error
		if errors.As(err, &pe) {
			return Record{}, fail(path+"."+pe.Path, pe.Reason)
		}
		return Record{}, fail(path+".descriptor", err.Error())
	}
	r.Descriptor = desc
	return r, nil
}

func (d *decoder) descriptor(path string) ([]policies.Dim, error) {
	var dims []policies.Dim
	err := d.object(path, func(name string) (bool, error) {
		if len(dims) == policies.MaxDims {
			return true, fail(path, "has more than 16 dimensions")
		}
		v, err := d.str(path + "." + name)
		if err != nil {
			return true, err
		}
		dims = append(dims, policies.Dim{Name: name, Value: v})
		return true, nil
	})
	return dims, err
}

// str reads a JSON string; invalid UTF-8 (raw or through lone surrogate
// escapes) is an error.
func (d *decoder) str(path string) (string, error) {
	if err := d.expect('"', path); err != nil {
		return "", err
	}
	start := d.pos
	// Fast path: no escapes.
	for d.pos < len(d.data) {
		c := d.data[d.pos]
		if c == '"' {
			s := d.data[start:d.pos]
			d.pos++
			if !utf8.Valid(s) {
				return "", fail(path, "is not valid UTF-8")
			}
			return string(s), nil
		}
		if c == '\\' {
			break
		}
		if c < 0x20 {
			return "", fail(path, "has a raw control character")
		}
		d.pos++
	}
	buf := append([]byte(nil), d.data[start:d.pos]...)
	for d.pos < len(d.data) {
		c := d.data[d.pos]
		switch {
		case c == '"':
			d.pos++
			if !utf8.Valid(buf) {
				return "", fail(path, "is not valid UTF-8")
			}
			return string(buf), nil
		case c < 0x20:
			return "", fail(path, "has a raw control character")
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
				return "", fail(path, "has a bad \\u escape")
			}
			if utf16IsSurrogate(r) {
				// A high surrogate must be followed by \u and a low one.
				if r >= 0xdc00 || d.pos+1 >= len(d.data) || d.data[d.pos] != '\\' || d.data[d.pos+1] != 'u' {
					return "", fail(path, "is not valid UTF-8 (lone surrogate)")
				}
				d.pos += 2
				lo, ok := d.hex4()
				if !ok || lo < 0xdc00 || lo > 0xdfff {
					return "", fail(path, "is not valid UTF-8 (lone surrogate)")
				}
				r = 0x10000 + (r-0xd800)<<10 + (lo - 0xdc00)
			}
			buf = utf8.AppendRune(buf, r)
		default:
			return "", fail(path, "has a bad escape")
		}
	}
	return "", fail(path, "unterminated string")
}

func utf16IsSurrogate(r rune) bool { return r >= 0xd800 && r <= 0xdfff }

func (d *decoder) hex4() (rune, bool) {
	if d.pos+4 > len(d.data) {
		return 0, false
	}
	var r rune
	for _, c := range d.data[d.pos : d.pos+4] {
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
func (d *decoder) number(path string) (string, error) {
	d.ws()
	start := d.pos
	for d.pos < len(d.data) {
		c := d.data[d.pos]
		if c >= '0' && c <= '9' || c == '-' || c == '+' || c == '.' || c == 'e' || c == 'E' {
			d.pos++
			continue
		}
		break
	}
	if d.pos == start {
		return "", fail(path, "is not a number")
	}
	return string(d.data[start:d.pos]), nil
}

// uint reads a JSON integer >= 0 (no sign, fraction or exponent).
func (d *decoder) uint(path string) (uint64, error) {
	text, err := d.number(path)
	if err != nil {
		return 0, err
	}
	if len(text) > 1 && text[0] == '0' {
		return 0, fail(path, strconv.Quote(text)+" is not an integer >= 0")
	}
	n, err := strconv.ParseUint(text, 10, 64)
	if err != nil {
		return 0, fail(path, strconv.Quote(text)+" is not an integer >= 0 below 2^64")
	}
	return n, nil
}

// skip skips one JSON value, checking that it is well formed.
func (d *decoder) skip(path string, depth int) error {
	if depth > maxSkipDepth {
		return fail(path, "nests too deep")
	}
	switch c := d.peek(); {
	case c == '"':
		_, err := d.str(path)
		return err
	case c == '{':
		return d.object(path, func(string) (bool, error) { return true, d.skip(path, depth+1) })
	case c == '[':
		d.pos++
		if d.peek() == ']' {
			d.pos++
			return nil
		}
		for {
			if err := d.skip(path, depth+1); err != nil {
				return err
			}
			switch d.peek() {
			case ',':
				d.pos++
			case ']':
				d.pos++
				return nil
			default:
				return fail(path, "bad array")
			}
		}
	case c == 't':
		return d.literal(path, "true")
	case c == 'f':
		return d.literal(path, "false")
	case c == 'n':
		return d.literal(path, "null")
	case c == '-' || c >= '0' && c <= '9':
		text, err := d.number(path)
		if err != nil {
			return err
		}
		if !validJSONNumber(text) {
			return fail(path, strconv.Quote(text)+" is not a JSON number")
		}
		return nil
	case c == 0:
		return fail(path, "unexpected end of input")
	default:
		return fail(path, "unexpected "+strconv.QuoteRune(rune(c)))
	}
}

func (d *decoder) literal(path, lit string) error {
	if len(d.data)-d.pos < len(lit) || string(d.data[d.pos:d.pos+len(lit)]) != lit {
		return fail(path, "bad literal")
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

// checkID checks a record id or node name: 1..256 bytes of printable UTF-8.
func checkID(path, s string) error {
	if s == "" {
		return fail(path, "is empty")
	}
	if len(s) > MaxIDLen {
		return fail(path, "is "+strconv.Itoa(len(s))+" bytes (at most 256)")
	}
	if reason := printable(s); reason != "" {
		return fail(path, reason)
	}
	return nil
}

// printable returns why s is not printable UTF-8, or "".
func printable(s string) string {
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c < 0x20 || c == 0x7f {
				return "has a control character"
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			return "is not valid UTF-8"
		}
		if unicode.IsControl(r) {
			return "has a control character"
		}
		i += size
	}
	return ""
}

// checkKey checks a record's limit key: "" or a valid KV key
// ([-/_=.a-zA-Z0-9], no empty token) of at most 256 bytes.
func checkKey(path, key string) error {
	switch {
	case key == "":
		return nil
	case len(key) > MaxKeyLen:
		return fail(path, "is "+strconv.Itoa(len(key))+" bytes (at most 256)")
	case !ValidKVKey(key):
		return fail(path, strconv.Quote(key)+" is not a valid KV key")
	}
	return nil
}

// ValidKVKey reports whether s is a valid JetStream KV key: 1 or more of
// [-/_=.a-zA-Z0-9], without a leading or trailing '.' or an empty token.
func ValidKVKey(s string) bool {
	if s == "" || s[0] == '.' || s[len(s)-1] == '.' {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '-', c == '/', c == '_', c == '=':
		case c == '.':
			if s[i-1] == '.' {
				return false
			}
		default:
			return false
		}
	}
	return true
}
