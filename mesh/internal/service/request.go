package service

import (
	"encoding/json"
	"fmt"
	"strconv"

	"github.com/limitmesh/limitmesh/internal/wire"
	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/fail"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/policies"
)

// MaxRequestBytes is the largest decide request body (CONTRACT.md §2); a
// larger one is a 413, checked before parsing.
const MaxRequestBytes = 4096

// MaxRequestIDBytes is the longest request_id.
const MaxRequestIDBytes = 128

// request is a decoded, validated decide request.
type request struct {
	desc   policies.Descriptor
	cost   int64 // micro-units, > 0
	id     string
	dryRun bool
}

// decodeRequest validates and decodes a decide request body by the rules
// of request_strict.go (CONTRACT.md §2, and refusing what parsers could
// read differently). Errors wrap fail.ErrTooLarge (over MaxRequestBytes)
// or fail.ErrBadRequest, with a message fit for the client that names the
// offending field once. It never panics.
func decodeRequest(b []byte) (request, error) {
	if len(b) > MaxRequestBytes {
		return request{}, fmt.Errorf("%w: body is %d bytes, at most %d", fail.ErrTooLarge, len(b), MaxRequestBytes)
	}
	if r, ok := decodeRequestFast(b); ok {
		return r, nil
	}
	return decodeRequestStrict(b)
}

// decodeRequestFast decodes the common shape of a valid decide request
// without building a tree: exactly the lower-case field names, each at
// most once, strings without escapes, control characters or non-ASCII
// bytes, a cost that is a plain decimal number or string, no unknown
// fields. It reports false for anything else (including every invalid
// request), and decodeRequest then takes decodeRequestStrict, which gives
// the same request for every input this one accepts
// (FuzzDecodeRequestDifferential) and the error messages for the rest.
// All strings of the result share one allocation (a copy of b).
func decodeRequestFast(b []byte) (request, bool) { return decodeFast(b, nil) }

// decodeFast is decodeRequestFast; with ttl not nil it also takes a
// "ttl" string (a reserve body), stored in *ttl ("" when absent).
func decodeFast(b []byte, ttl *string) (request, bool) {
	var r request
	d := fastDecoder{s: string(b)}
	if !d.byte('{') {
		return r, false
	}
	var (
		dims                                [policies.MaxDims]policies.Dim
		ndims                               int
		seenDesc, seenCost, seenID, seenDry bool
		seenTTL                             bool
	)
	r.cost = kvstate.Unit
	if d.peek() == '}' {
		return r, false // no descriptor: an error
	}
	for {
		key, ok := d.str()
		if !ok || !d.byte(':') {
			return r, false
		}
		switch key {
		case "descriptor":
			if seenDesc || !d.byte('{') {
				return r, false
			}
			seenDesc = true
			if d.peek() == '}' {
				return r, false // no dimensions: an error
			}
			for {
				name, ok := d.str()
				if !ok || !d.byte(':') {
					return r, false
				}
				value, ok := d.str()
				if !ok || ndims == len(dims) {
					return r, false
				}
				for i := range ndims {
					if dims[i].Name == name {
						return r, false // a duplicate dimension: an error
					}
				}
				dims[ndims] = policies.Dim{Name: name, Value: value}
				ndims++
				if d.byte('}') {
					break
				}
				if !d.byte(',') {
					return r, false
				}
			}
		case "cost":
			if seenCost {
				return r, false
			}
			seenCost = true
			var (
				text       string
				ok, isNull bool
			)
			switch d.peek() {
			case '"':
				text, ok = d.str()
			case 'n':
				ok, isNull = d.lit("null"), true
			default:
				text, ok = d.number()
			}
			if !ok {
				return r, false
			}
			if !isNull {
				c, err := policies.ParseCost(text)
				if err != nil {
					return r, false
				}
				r.cost = c
			}
		case "request_id":
			if seenID {
				return r, false
			}
			seenID = true
			if d.peek() == 'n' {
				if !d.lit("null") {
					return r, false
				}
				break
			}
			s, ok := d.str()
			if !ok || len(s) > MaxRequestIDBytes {
				return r, false
			}
			r.id = s
		case fieldTTL:
			if ttl == nil || seenTTL {
				return r, false
			}
			seenTTL = true
			v, ok := d.str()
			if !ok {
				return r, false
			}
			*ttl = v
		case "dry_run":
			if seenDry {
				return r, false
			}
			seenDry = true
			switch {
			case d.lit("true"):
				r.dryRun = true
			case d.lit("false"), d.lit("null"):
			default:
				return r, false
			}
		default:
			return r, false
		}
		if d.byte('}') {
			break
		}
		if !d.byte(',') {
			return r, false
		}
	}
	d.space()
	if d.i != len(d.s) || !seenDesc {
		return r, false
	}
	desc, err := policies.NewDescriptor(append(make([]policies.Dim, 0, ndims), dims[:ndims]...))
	if err != nil {
		return r, false
	}
	r.desc = desc
	return r, true
}

// fastDecoder is decodeRequestFast's cursor.
type fastDecoder struct {
	s string
	i int
}

func (d *fastDecoder) space() {
	for d.i < len(d.s) {
		switch d.s[d.i] {
		case ' ', '\t', '\n', '\r':
			d.i++
		default:
			return
		}
	}
}

// peek returns the next byte after white space (0 at the end).
func (d *fastDecoder) peek() byte {
	d.space()
	if d.i < len(d.s) {
		return d.s[d.i]
	}
	return 0
}

// byte consumes c (after white space) if it is next.
func (d *fastDecoder) byte(c byte) bool {
	if d.peek() == c {
		d.i++
		return true
	}
	return false
}

// lit consumes the literal w if it is next.
func (d *fastDecoder) lit(w string) bool {
	d.space()
	if len(d.s)-d.i >= len(w) && d.s[d.i:d.i+len(w)] == w {
		d.i += len(w)
		return true
	}
	return false
}

// str consumes a string of printable ASCII without escapes.
func (d *fastDecoder) str() (string, bool) {
	if !d.byte('"') {
		return "", false
	}
	start := d.i
	for d.i < len(d.s) {
		c := d.s[d.i]
		switch {
		case c == '"':
			d.i++
			return d.s[start : d.i-1], true
		case c < 0x20 || c > 0x7e || c == '\\':
			return "", false
		}
		d.i++
	}
	return "", false
}

// number consumes a JSON number without sign or exponent: 0 or [1-9][0-9]*,
// then optionally '.' and at least one digit.
func (d *fastDecoder) number() (string, bool) {
	d.space()
	start := d.i
	digits := func() int {
		n := 0
		for d.i < len(d.s) && d.s[d.i] >= '0' && d.s[d.i] <= '9' {
			d.i++
			n++
		}
		return n
	}
	n := digits()
	if n == 0 || (n > 1 && d.s[start] == '0') {
		return "", false
	}
	if d.i < len(d.s) && d.s[d.i] == '.' {
		d.i++
		if digits() == 0 {
			return "", false
		}
	}
	if d.i < len(d.s) {
		switch d.s[d.i] {
		case 'e', 'E', '-', '+', '.':
			return "", false
		}
	}
	return d.s[start:d.i], true
}

// appendReply appends the JSON reply body for d (CONTRACT.md §2) with,
// when part >= 0, the optional field "partition" (docs/protocol.md: the
// limit key's partition, the client's direct-to-owner hint).
func appendReply(b []byte, d keyrec.Decision, part int) []byte {
	b = append(b, `{"allowed":`...)
	b = strconv.AppendBool(b, d.Allowed)
	b = append(b, `,"policy":`...)
	b = wire.AppendString(b, d.Policy)
	b = append(b, `,"revision":`...)
	b = strconv.AppendUint(b, d.Revision, 10)
	b = append(b, `,"remaining":`...)
	b = AppendMicro(b, max(d.Remaining, 0))
	b = append(b, `,"retry_after_ms":`...)
	b = strconv.AppendInt(b, durationMillis(d.RetryAfter), 10)
	b = append(b, `,"reset_after_ms":`...)
	b = strconv.AppendInt(b, durationMillis(d.ResetAfter), 10)
	if part >= 0 {
		b = append(b, `,"partition":`...)
		b = strconv.AppendInt(b, int64(part), 10)
	}
	return append(b, '}')
}

// durationMillis converts ns to ms rounded up; Never stays -1 and negative
// values are 0.
func durationMillis(ns int64) int64 {
	if ns == kvstate.Never {
		return -1
	}
	if ns <= 0 {
		return 0
	}
	return ns/1_000_000 + min(ns%1_000_000, 1)
}

// AppendMicro appends v micro-units as a JSON decimal number (v >= 0).
func AppendMicro(b []byte, v int64) []byte { return kvstate.AppendUnits(b, v) }

// errorBody is the JSON body of an error reply.
func errorBody(symbol, message string) []byte {
	b, _ := json.Marshal(struct {
		Error   string `json:"error"`
		Message string `json:"message"`
	}{symbol, message})
	return b
}
