package service

import (
	"fmt"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/fail"
	"github.com/limitmesh/limitmesh/policies"
)

// The strict decide decoder. decodeRequestStrict is the definition of
// which decide bodies are accepted and what they mean; decodeRequestFast
// is a shortcut for the common shape that must agree with it
// (FuzzDecodeRequestDifferential). It is written for clarity, in two
// passes: parseJSON reads the body into a tree by RFC 8259 and nothing
// more, then decodeTree applies CONTRACT.md §2 and the rules below.
//
// Besides the contract's field rules, a body is refused (400) when two
// JSON parsers could read it differently, since a gateway in front of
// limitmesh that reads a body one way while limitmesh reads it another
// (a tenant checked by one, another tenant spent by the other) is a
// security hole. The rules, for every value in the body, unknown fields
// included:
//
//   - The body is exactly one JSON object: no byte order mark, nothing
//     but white space (space, tab, LF, CR) before or after it. Empty
//     bodies, arrays, strings, numbers, literals and null are refused.
//   - Every string, member names included, is valid UTF-8 after
//     unescaping: no invalid bytes and no unpaired surrogate escape
//     (\ud800 alone). Parsers replace, keep or refuse these.
//   - No object has two members with the same name (after unescaping):
//     parsers keep the first, keep the last or refuse.
//   - No member name has a control character (Unicode Cc, as an escape
//     or raw): parsers on C strings stop at \u0000.
//   - Objects and arrays nest at most MaxRequestDepth levels (the body's
//     object is level 1): parsers' depth limits differ.
//   - The field names descriptor, cost, request_id and dry_run are exact:
//     a member whose name equals one of them only under Unicode case
//     folding ("Cost", "DRY_RUN", "coſt") is refused, since
//     encoding/json and others match names case-insensitively; and
//     one that spells one of them with escapes ("\u0063ost") is refused,
//     since parsers that compare names without unescaping them (some
//     fast ones do) miss it.
//   - Dimension names are written without escapes, for the same reason;
//     a duplicate dimension is refused by the rule on duplicate names.
//
// Null means absent for cost (default 1), request_id and dry_run; a null
// descriptor is a missing one. request_id "" is no request_id. Lengths
// (dimension values, request_id) count bytes after unescaping. A cost is
// a JSON number or string whose text is `(0|[1-9][0-9]*)(\.[0-9]{1,6})?`
// (policies.ParseCost): -0, 01, 1.0e0 and 1e999999999 are refused before
// any arithmetic. Numbers in unknown fields are not evaluated: any RFC
// 8259 number is accepted there.
//
// The first failed check is the error, in this order: the body's size
// (decodeRequest), the JSON syntax and depth, the body's member names
// (format, case and escapes, then repeats), then the fields in body
// order; within the descriptor: its dimension names, repeats, count,
// then values. So an ambiguous body is refused as ambiguous, not for a
// value that one reading of it has.
//
// Error messages name the offending field once: `cost: "-1" must be > 0`,
// `descriptor.tenant: duplicate dimension`, `"Cost": field names are
// case-sensitive (write "cost")`, `malformed JSON at byte 17: ...`.

// MaxRequestDepth is the deepest nesting of objects and arrays in a decide
// body; the body's object is level 1, the descriptor level 2.
const MaxRequestDepth = 32

// decodeRequestStrict is decodeRequest without the fast path and without
// the size check: it applies every rule above to b. Errors wrap
// fail.ErrBadRequest.
func decodeRequestStrict(b []byte) (request, error) {
	if len(b) == 0 {
		return request{}, badRequest("body", "is empty")
	}
	if len(b) >= 3 && b[0] == 0xEF && b[1] == 0xBB && b[2] == 0xBF {
		return request{}, badRequest("body", "starts with a byte order mark")
	}
	root, err := parseJSON(b)
	if err != nil {
		return request{}, err
	}
	return decodeTree(root)
}

// badRequest is a 400 error about the field path: `path: reason`.
func badRequest(path, reason string) error {
	return fmt.Errorf("%w: %s: %s", fail.ErrBadRequest, path, reason)
}

// The request's field names.
const (
	fieldDescriptor = "descriptor"
	fieldCost       = "cost"
	fieldRequestID  = "request_id"
	fieldDryRun     = "dry_run"
)

var requestFields = [...]string{fieldDescriptor, fieldCost, fieldRequestID, fieldDryRun}

// decodeTree applies the contract to a parsed body. Name rules and
// duplicates are checked for every member before any value, so an
// ambiguous body is reported as such rather than by a value error.
func decodeTree(root jsonValue) (request, error) {
	var r request
	if root.kind != jsonObject {
		return r, badRequest("body", "is "+root.kind.String()+", not a JSON object")
	}
	for _, m := range root.members {
		if err := checkMemberName(m.name, ""); err != nil {
			return r, err
		}
		for _, f := range requestFields {
			switch {
			case m.name.str == f && m.name.escaped:
				return r, badRequest(f, "field name is written with escapes")
			case m.name.str != f && strings.EqualFold(m.name.str, f):
				return r, badRequest(label(m.name.str), "field names are case-sensitive (write "+strconv.Quote(f)+")")
			}
		}
	}
	if name, ok := repeatedName(root.members); ok {
		return r, badRequest(fieldPath(name), "duplicate field")
	}
	r.cost = kvstate.Unit
	seenDesc := false
	for _, m := range root.members {
		v := m.value
		switch m.name.str {
		case fieldDescriptor:
			if v.kind == jsonNull {
				continue
			}
			d, err := decodeDescriptor(v)
			if err != nil {
				return r, err
			}
			r.desc, seenDesc = d, true
		case fieldCost:
			switch v.kind {
			case jsonNull:
			case jsonNumber, jsonString:
				if v.kind == jsonString && v.badUTF8 {
					return r, badRequest(fieldCost, "is not valid UTF-8")
				}
				c, err := policies.ParseCost(v.str)
				if err != nil {
					return r, fmt.Errorf("%w: %v", fail.ErrBadRequest, err) // names "cost"
				}
				r.cost = c
			default:
				return r, badRequest(fieldCost, "is "+v.kind.String()+", not a number or a decimal string")
			}
		case fieldRequestID:
			switch {
			case v.kind == jsonNull:
			case v.kind != jsonString:
				return r, badRequest(fieldRequestID, "is "+v.kind.String()+", not a string")
			case v.badUTF8:
				return r, badRequest(fieldRequestID, "is not valid UTF-8")
			case len(v.str) > MaxRequestIDBytes:
				return r, badRequest(fieldRequestID, "is "+strconv.Itoa(len(v.str))+" bytes (at most "+strconv.Itoa(MaxRequestIDBytes)+")")
			default:
				r.id = v.str
			}
		case fieldDryRun:
			switch v.kind {
			case jsonNull:
			case jsonBool:
				r.dryRun = v.boolean
			default:
				return r, badRequest(fieldDryRun, "is "+v.kind.String()+", not true or false")
			}
		default:
			if err := checkUnknown(v, label(m.name.str)); err != nil {
				return r, err
			}
		}
	}
	if !seenDesc {
		return r, badRequest(fieldDescriptor, "required")
	}
	return r, nil
}

// decodeDescriptor decodes the descriptor object v (not null). As in
// decodeTree, names and duplicates come before values.
func decodeDescriptor(v jsonValue) (policies.Descriptor, error) {
	if v.kind != jsonObject {
		return nil, badRequest(fieldDescriptor, "is "+v.kind.String()+", not an object")
	}
	for _, m := range v.members {
		if m.name.escaped {
			return nil, badRequest(fieldDescriptor, "dimension name "+label(m.name.str)+" is written with escapes")
		}
		if !validDimName(m.name.str) {
			return nil, badRequest(fieldDescriptor, "dimension name "+label(m.name.str)+" is not [a-z][a-z0-9_]{0,31}")
		}
	}
	if name, ok := repeatedName(v.members); ok {
		return nil, badRequest(fieldDescriptor+"."+name, "duplicate dimension")
	}
	switch n := len(v.members); {
	case n == 0:
		return nil, badRequest(fieldDescriptor, "has no dimensions (needs 1..16)")
	case n > policies.MaxDims:
		return nil, badRequest(fieldDescriptor, "has "+strconv.Itoa(n)+" dimensions (at most 16)")
	}
	dims := make([]policies.Dim, 0, len(v.members))
	for _, m := range v.members {
		path := fieldDescriptor + "." + m.name.str
		if m.value.kind != jsonString {
			return nil, badRequest(path, "value is "+m.value.kind.String()+", not a string")
		}
		if m.value.badUTF8 {
			return nil, badRequest(path, "value is not valid UTF-8")
		}
		dims = append(dims, policies.Dim{Name: m.name.str, Value: m.value.str})
	}
	d, err := policies.NewDescriptor(dims) // the value rules; names "descriptor.<name>"
	if err != nil {
		return nil, fmt.Errorf("%w: %v", fail.ErrBadRequest, err)
	}
	return d, nil
}

// validDimName reports whether s matches [a-z][a-z0-9_]{0,31}.
func validDimName(s string) bool {
	if len(s) == 0 || len(s) > policies.MaxDimNameLen || s[0] < 'a' || s[0] > 'z' {
		return false
	}
	for i := 1; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_') {
			return false
		}
	}
	return true
}

// checkUnknown checks the value of an unknown field (labelled path) against
// the rules every value obeys: valid UTF-8 strings and member names
// without control characters, each name once per object.
func checkUnknown(v jsonValue, path string) error {
	switch v.kind {
	case jsonString:
		if v.badUTF8 {
			return badRequest(path, "has a string that is not valid UTF-8")
		}
	case jsonArray:
		for _, e := range v.elems {
			if err := checkUnknown(e, path); err != nil {
				return err
			}
		}
	case jsonObject:
		for _, m := range v.members {
			if err := checkMemberName(m.name, path); err != nil {
				return err
			}
		}
		if name, ok := repeatedName(v.members); ok {
			return badRequest(path, "has an object with two members named "+label(name))
		}
		for _, m := range v.members {
			if err := checkUnknown(m.value, path); err != nil {
				return err
			}
		}
	}
	return nil
}

// repeatedName returns the first name in members that an earlier member
// has, and whether there is one.
func repeatedName(members []jsonMember) (string, bool) {
	if len(members) <= 16 {
		for i := range members {
			for _, prev := range members[:i] {
				if prev.name.str == members[i].name.str {
					return members[i].name.str, true
				}
			}
		}
		return "", false
	}
	seen := make(map[string]bool, len(members)) // the quadratic scan is slow for hundreds of members
	for _, m := range members {
		if seen[m.name.str] {
			return m.name.str, true
		}
		seen[m.name.str] = true
	}
	return "", false
}

// checkMemberName checks that a member name is valid UTF-8 without control
// characters. path is the unknown field it is inside, "" for a member of
// the body's object.
func checkMemberName(name jsonValue, path string) error {
	problem := ""
	switch {
	case name.badUTF8:
		problem = "is not valid UTF-8"
	case strings.IndexFunc(name.str, unicode.IsControl) >= 0:
		problem = "has a control character"
	default:
		return nil
	}
	if path == "" {
		return badRequest(label(name.str), "field name "+problem)
	}
	return badRequest(path, "has a member name that "+problem)
}

// fieldPath is how an error message names the body's member name: bare
// for the request's fields (and the reservation endpoints', reserve.go),
// else as label does.
func fieldPath(name string) string {
	for _, f := range requestFields {
		if name == f {
			return f
		}
	}
	if name == fieldTTL || name == fieldReservation {
		return name
	}
	return label(name)
}

// label is a member name as an error message shows it: quoted with Go
// escapes, ASCII only, and cut after 40 bytes.
func label(name string) string {
	const max = 40
	if len(name) <= max {
		return strconv.QuoteToASCII(name)
	}
	cut := max
	for cut > 0 && !utf8.RuneStart(name[cut]) {
		cut--
	}
	return strconv.QuoteToASCII(name[:cut]) + "..."
}
