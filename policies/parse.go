package policies

import (
	"bytes"
	"encoding/json"
	"io"
	"slices"
	"strconv"
)

// Parse parses and validates one policy document (CONTRACT.md §3) stored
// under name. Decoding is strict: unknown fields, duplicate keys, wrong
// types and trailing data are invalid. The document's fields:
//
//	match        object of dimension -> value ("*": present with any value);
//	             absent or {} matches every descriptor
//	key          array of dimension names forming the limit key; absent or
//	             null: the match names; [] : one key shared by everyone
//	limits       1..8 limit objects (below)
//	mode         "strict" (default), "async", "local" or "leased"
//	lease        leased mode only: object with the optional fields size
//	             (decimal units), ttl (a Go duration >= 100ms) and
//	             max_outstanding (decimal units); see [Lease] for the
//	             defaults, which Parse fills in for every leased policy
//	max_keys     positive integer (number or string), default 1,000,000
//	shadow       bool
//	layer        string, [a-z0-9][a-z0-9_-]{0,31}, default "" (CONTRACT.md §11)
//	description  string, at most 1024 bytes
//
// A null value is the same as an absent field, except for limits.
//
// A limit object has "name" (optional, [a-z0-9_-]{1,64}, default the
// algorithm's name, unique in the policy), "algorithm" and the fields of its
// algorithm, and no others:
//
//	token_bucket, gcra       rate ("N/s", "N/m", "N/h", "N/d"), burst
//	fixed_window,
//	sliding_window,
//	sliding_log              limit, window (a Go duration >= 1ms);
//	                         sliding_log limit <= 10000
//	concurrency              limit (held at once), window (optional, default
//	                         MaxReservationTTL: the longest a hold lasts, a
//	                         Go duration >= 1ms; a reservation's ttl is
//	                         capped at it)
//	quota                    limit (<= 1e12 per period), period ("hour",
//	                         "day", "week" or "month", UTC; weeks start on
//	                         Monday)
//
// burst and limit are a JSON number or a string holding one, with at most 6
// fractional digits and no exponent, > 0; they become micro-units exactly.
// A rate's N follows the same syntax; the rate is kept exactly, per second
// or over its own period (see parseRate).
//
// Errors are [*Error] naming the field, such as
// `limits[0].rate: "ten per second" is not N/s, N/m, N/h or N/d`, and match
// [ErrInvalid]. Revision is left 0 for the caller to set.
func Parse(name string, doc []byte) (*Policy, error) {
	if err := ValidateName(name); err != nil {
		return nil, err
	}
	ps := &parser{dec: json.NewDecoder(bytes.NewReader(doc))}
	ps.dec.UseNumber()
	p, err := ps.policy(name)
	if err != nil {
		return nil, err
	}
	if _, err := ps.dec.Token(); err != io.EOF {
		return nil, invalid("", "trailing data after the policy object")
	}
	return p, nil
}

type parser struct {
	dec *json.Decoder
}

// token reads the next token; a syntax error or early end is reported at path.
func (ps *parser) token(path string) (json.Token, error) {
	t, err := ps.dec.Token()
	if err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return nil, invalid(path, "malformed JSON: "+err.Error())
	}
	return t, nil
}

// key reads an object key, or returns ok=false at the object's end.
func (ps *parser) key(path string) (string, bool, error) {
	if !ps.dec.More() {
		if _, err := ps.token(path); err != nil { // the closing '}'
			return "", false, err
		}
		return "", false, nil
	}
	t, err := ps.token(path)
	if err != nil {
		return "", false, err
	}
	k, _ := t.(string) // the decoder only yields string keys
	return k, true, nil
}

func (ps *parser) expectDelim(path string, d json.Delim, what string) (isNull bool, err error) {
	t, err := ps.token(path)
	if err != nil {
		return false, err
	}
	if t == nil {
		return true, nil
	}
	if got, ok := t.(json.Delim); !ok || got != d {
		return false, invalid(path, "must be "+what)
	}
	return false, nil
}

// str reads a string value (or null, when nullOK).
func (ps *parser) str(path string, nullOK bool) (s string, isNull bool, err error) {
	t, err := ps.token(path)
	if err != nil {
		return "", false, err
	}
	switch v := t.(type) {
	case string:
		return v, false, nil
	case nil:
		if nullOK {
			return "", true, nil
		}
	}
	return "", false, invalid(path, "must be a string")
}

// decimal reads a JSON number or a string holding a decimal; text is the
// raw text and display how to print it in errors.
func (ps *parser) decimal(path string) (text, display string, err error) {
	t, err := ps.token(path)
	if err != nil {
		return "", "", err
	}
	switch v := t.(type) {
	case json.Number:
		return string(v), string(v), nil
	case string:
		return v, strconv.Quote(v), nil
	}
	return "", "", invalid(path, "must be a number or a decimal string")
}

func fieldPath(base, k string) string {
	ident := k != ""
	for i := 0; i < len(k); i++ {
		c := k[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-') {
			ident = false
			break
		}
	}
	if !ident {
		k = strconv.Quote(k)
	}
	if base == "" {
		return k
	}
	return base + "." + k
}

func (ps *parser) policy(name string) (*Policy, error) {
	t, err := ps.dec.Token()
	if err == io.EOF {
		return nil, invalid("", "policy is empty")
	}
	if err != nil {
		return nil, invalid("", "malformed JSON: "+err.Error())
	}
	if d, ok := t.(json.Delim); !ok || d != '{' {
		return nil, invalid("", "policy must be a JSON object")
	}
	p := &Policy{Name: name, MaxKeys: DefaultMaxKeys}
	var (
		seen      = map[string]bool{}
		keyGiven  bool
		keyNames  []string
		hasLimits bool
		lease     *rawLease
	)
	for {
		k, ok, err := ps.key("")
		if err != nil {
			return nil, err
		}
		if !ok {
			break
		}
		path := fieldPath("", k)
		if seen[k] {
			return nil, invalid(path, "duplicate field")
		}
		seen[k] = true
		switch k {
		case "match":
			if p.Match, err = ps.match(); err != nil {
				return nil, err
			}
		case "key":
			if keyNames, keyGiven, err = ps.keyDims(); err != nil {
				return nil, err
			}
		case "limits":
			if p.Limits, err = ps.limits(); err != nil {
				return nil, err
			}
			hasLimits = true
		case "mode":
			s, null, err := ps.str(path, true)
			if err != nil {
				return nil, err
			}
			if !null {
				m, ok := ParseMode(s)
				if !ok {
					return nil, invalid(path, strconv.Quote(s)+" is not strict, async, local or leased")
				}
				p.Mode = m
			}
		case "max_keys":
			if p.MaxKeys, err = ps.maxKeys(path); err != nil {
				return nil, err
			}
		case "lease":
			if lease, err = ps.lease(path); err != nil {
				return nil, err
			}
		case "shadow":
			t, err := ps.token(path)
			if err != nil {
				return nil, err
			}
			switch v := t.(type) {
			case bool:
				p.Shadow = v
			case nil:
			default:
				return nil, invalid(path, "must be true or false")
			}
		case "layer":
			s, _, err := ps.str(path, true)
			if err != nil {
				return nil, err
			}
			if !ValidLayer(s) {
				return nil, invalid(path, strconv.Quote(s)+" is not [a-z0-9][a-z0-9_-]{0,31}")
			}
			p.Layer = s
		case "description":
			s, _, err := ps.str(path, true)
			if err != nil {
				return nil, err
			}
			if len(s) > MaxDescription {
				return nil, invalid(path, "is "+strconv.Itoa(len(s))+" bytes (at most 1024)")
			}
			p.Description = s
		default:
			return nil, invalid(path, "unknown field")
		}
	}
	if !hasLimits {
		return nil, invalid("limits", "required (1..8 limits)")
	}
	if p.Mode == ModeLeased {
		if p.Lease, err = lease.build(p.Limits); err != nil {
			return nil, err
		}
	} else if lease != nil {
		return nil, invalid("lease", reasonLeaseMode)
	}
	if keyGiven {
		p.Key = keyNames
	} else {
		p.Key = make([]string, len(p.Match))
		for i, d := range p.Match {
			p.Key[i] = d.Name
		}
	}
	return p, nil
}

func (ps *parser) match() ([]Dim, error) {
	null, err := ps.expectDelim("match", '{', "an object of dimension -> value")
	if err != nil || null {
		return nil, err
	}
	var dims []Dim
	for {
		k, ok, err := ps.key("match")
		if err != nil {
			return nil, err
		}
		if !ok {
			break
		}
		if !validDimName(k) {
			return nil, invalid("match", "dimension name "+strconv.Quote(k)+" is not [a-z][a-z0-9_]{0,31}")
		}
		path := "match." + k
		for _, d := range dims {
			if d.Name == k {
				return nil, invalid(path, "duplicate dimension")
			}
		}
		if len(dims) == MaxDims {
			return nil, invalid("match", "has more than 16 entries")
		}
		v, _, err := ps.str(path, false)
		if err != nil {
			return nil, err
		}
		if v != AnyValue {
			if r := valueProblem(v); r != "" {
				return nil, invalid(path, r)
			}
		}
		dims = append(dims, Dim{Name: k, Value: v})
	}
	slices.SortFunc(dims, func(a, b Dim) int {
		if a.Name < b.Name {
			return -1
		}
		return 1 // names are unique
	})
	return dims, nil
}

func (ps *parser) keyDims() (names []string, given bool, err error) {
	null, err := ps.expectDelim("key", '[', "an array of dimension names")
	if err != nil || null {
		return nil, false, err
	}
	names = []string{}
	for i := 0; ps.dec.More(); i++ {
		path := "key[" + strconv.Itoa(i) + "]"
		s, _, err := ps.str(path, false)
		if err != nil {
			return nil, false, err
		}
		if !validDimName(s) {
			return nil, false, invalid(path, strconv.Quote(s)+" is not [a-z][a-z0-9_]{0,31}")
		}
		if slices.Contains(names, s) {
			return nil, false, invalid(path, "duplicate dimension "+strconv.Quote(s))
		}
		if len(names) == MaxDims {
			return nil, false, invalid("key", "has more than 16 dimensions")
		}
		names = append(names, s)
	}
	if _, err := ps.token("key"); err != nil { // ']'
		return nil, false, err
	}
	slices.Sort(names)
	return names, true, nil
}
