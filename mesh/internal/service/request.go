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
	d := wire.Scanner{Text: string(b)}
	if !d.Consume('{') {
		return r, false
	}
	var (
		dims                                [policies.MaxDims]policies.Dim
		ndims                               int
		seenDesc, seenCost, seenID, seenDry bool
		seenTTL                             bool
	)
	r.cost = kvstate.Unit
	if d.Peek() == '}' {
		return r, false // no descriptor: an error
	}
	for {
		key, ok := d.PlainString()
		if !ok || !d.Consume(':') {
			return r, false
		}
		switch key {
		case "descriptor":
			if seenDesc || !d.Consume('{') {
				return r, false
			}
			seenDesc = true
			if d.Peek() == '}' {
				return r, false // no dimensions: an error
			}
			for {
				name, ok := d.PlainString()
				if !ok || !d.Consume(':') {
					return r, false
				}
				value, ok := d.PlainString()
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
				if d.Consume('}') {
					break
				}
				if !d.Consume(',') {
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
			switch d.Peek() {
			case '"':
				text, ok = d.PlainString()
			case 'n':
				ok, isNull = d.Literal("null"), true
			default:
				var err error
				text, err = d.Number()
				ok = err == nil
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
			if d.Peek() == 'n' {
				if !d.Literal("null") {
					return r, false
				}
				break
			}
			s, ok := d.PlainString()
			if !ok || len(s) > MaxRequestIDBytes {
				return r, false
			}
			r.id = s
		case fieldTTL:
			if ttl == nil || seenTTL {
				return r, false
			}
			seenTTL = true
			v, ok := d.PlainString()
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
			case d.Literal("true"):
				r.dryRun = true
			case d.Literal("false"), d.Literal("null"):
			default:
				return r, false
			}
		default:
			return r, false
		}
		if d.Consume('}') {
			break
		}
		if !d.Consume(',') {
			return r, false
		}
	}
	if d.End() != nil || !seenDesc {
		return r, false
	}
	desc, err := policies.NewDescriptor(append(make([]policies.Dim, 0, ndims), dims[:ndims]...))
	if err != nil {
		return r, false
	}
	r.desc = desc
	return r, true
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
