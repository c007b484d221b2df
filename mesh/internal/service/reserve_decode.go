package service

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/limitmesh/limitmesh/mesh/internal/fail"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/policies"
)

// Reservation bodies (CONTRACT §10). A reserve body is a decide body (the
// strict decoder's rules, request_strict.go) plus "ttl"; settle, release
// and renew bodies have "reservation", and "cost" (settle) or "ttl"
// (renew). Every body obeys the strict rules for all its values: one JSON
// object, valid UTF-8, no repeated member, exact field names.

const (
	fieldTTL         = "ttl"
	fieldReservation = "reservation"
)

// resBody is a decoded settle, release or renew body.
type resBody struct {
	id    string
	units int64 // settle: micro-units to keep spent; -1: the whole reservation
	ttl   int64 // renew: ns
}

// decodeReserve decodes a reserve body: the decide request and the ttl
// (ns; policies.DefaultReservationTTL when absent or null).
func decodeReserve(b []byte) (request, int64, error) {
	if len(b) > MaxRequestBytes {
		return request{}, 0, fmt.Errorf("%w: body is %d bytes, at most %d", fail.ErrTooLarge, len(b), MaxRequestBytes)
	}
	// The common shape without building a tree (request.go); anything
	// else, every invalid body included, takes the strict path below.
	var text string
	if r, ok := decodeFast(b, &text); ok {
		if text == "" {
			return r, int64(policies.DefaultReservationTTL), nil
		}
		if ttl, err := decodeTTL(jsonValue{kind: jsonString, str: text}); err == nil {
			return r, ttl, nil
		}
	}
	return decodeReserveStrict(b)
}

// decodeReserveStrict is decodeReserve without the fast path: the
// definition of which reserve bodies are accepted.
func decodeReserveStrict(b []byte) (request, int64, error) {
	root, err := parseBody(b)
	if err != nil {
		return request{}, 0, err
	}
	if err := exactNames(root, fieldTTL); err != nil {
		return request{}, 0, err
	}
	req, err := decodeTree(root)
	if err != nil {
		return request{}, 0, err
	}
	ttl := int64(policies.DefaultReservationTTL)
	for _, m := range root.members {
		if m.name.str == fieldTTL {
			if ttl, err = decodeTTL(m.value); err != nil {
				return request{}, 0, err
			}
		}
	}
	return req, ttl, nil
}

// decodeResBody decodes a settle, release or renew body (kind).
func decodeResBody(b []byte, kind resKind) (resBody, error) {
	out := resBody{units: -1, ttl: int64(policies.DefaultReservationTTL)}
	if len(b) > MaxRequestBytes {
		return out, fmt.Errorf("%w: body is %d bytes, at most %d", fail.ErrTooLarge, len(b), MaxRequestBytes)
	}
	root, err := parseBody(b)
	if err != nil {
		return out, err
	}
	known := []string{fieldReservation}
	switch kind {
	case opSettle:
		known = append(known, fieldCost)
	case opRenew:
		known = append(known, fieldTTL)
	}
	if err := exactNames(root, known...); err != nil {
		return out, err
	}
	if name, ok := repeatedName(root.members); ok {
		return out, badRequest(fieldPath(name), "duplicate field")
	}
	seen := false
	for _, m := range root.members {
		v := m.value
		switch {
		case m.name.str == fieldReservation:
			switch {
			case v.kind != jsonString:
				return out, badRequest(fieldReservation, "is "+v.kind.String()+", not a string")
			case v.badUTF8:
				return out, badRequest(fieldReservation, "is not valid UTF-8")
			case v.str == "":
				return out, badRequest(fieldReservation, "is empty")
			case len(v.str) > keyrec.MaxReservationID:
				return out, badRequest(fieldReservation, "is "+strconv.Itoa(len(v.str))+" bytes (at most "+strconv.Itoa(keyrec.MaxReservationID)+")")
			}
			out.id, seen = v.str, true
		case m.name.str == fieldCost && kind == opSettle:
			switch v.kind {
			case jsonNull:
			case jsonNumber, jsonString:
				if v.kind == jsonString && v.badUTF8 {
					return out, badRequest(fieldCost, "is not valid UTF-8")
				}
				u, err := parseSettleCost(v.str)
				if err != nil {
					return out, err
				}
				out.units = u
			default:
				return out, badRequest(fieldCost, "is "+v.kind.String()+", not a number or a decimal string")
			}
		case m.name.str == fieldTTL && kind == opRenew:
			if out.ttl, err = decodeTTL(v); err != nil {
				return out, err
			}
		default:
			if err := checkUnknown(v, label(m.name.str)); err != nil {
				return out, err
			}
		}
	}
	if !seen {
		return out, badRequest(fieldReservation, "required")
	}
	return out, nil
}

// parseBody parses b as one JSON object by the strict rules' syntax.
func parseBody(b []byte) (jsonValue, error) {
	if len(b) == 0 {
		return jsonValue{}, badRequest("body", "is empty")
	}
	if len(b) >= 3 && b[0] == 0xEF && b[1] == 0xBB && b[2] == 0xBF {
		return jsonValue{}, badRequest("body", "starts with a byte order mark")
	}
	root, err := parseJSON(b)
	if err != nil {
		return root, err
	}
	if root.kind != jsonObject {
		return root, badRequest("body", "is "+root.kind.String()+", not a JSON object")
	}
	return root, nil
}

// exactNames checks the body's member names against fields as decodeTree
// does for the decide fields: valid, not escaped, not another case.
func exactNames(root jsonValue, fields ...string) error {
	for _, m := range root.members {
		if err := checkMemberName(m.name, ""); err != nil {
			return err
		}
		for _, f := range fields {
			switch {
			case m.name.str == f && m.name.escaped:
				return badRequest(f, "field name is written with escapes")
			case m.name.str != f && strings.EqualFold(m.name.str, f):
				return badRequest(label(m.name.str), "field names are case-sensitive (write "+strconv.Quote(f)+")")
			}
		}
	}
	return nil
}

// decodeTTL decodes a ttl value: a Go duration string, > 0 and at most
// policies.MaxReservationTTL; null is the default.
func decodeTTL(v jsonValue) (int64, error) {
	switch {
	case v.kind == jsonNull:
		return int64(policies.DefaultReservationTTL), nil
	case v.kind != jsonString:
		return 0, badRequest(fieldTTL, "is "+v.kind.String()+", not a duration string such as \"30s\"")
	case v.badUTF8:
		return 0, badRequest(fieldTTL, "is not valid UTF-8")
	}
	d, err := time.ParseDuration(v.str)
	switch {
	case err != nil:
		return 0, badRequest(fieldTTL, strconv.Quote(v.str)+" is not a Go duration such as \"30s\"")
	case d <= 0:
		return 0, badRequest(fieldTTL, strconv.Quote(v.str)+" must be > 0")
	case d > policies.MaxReservationTTL:
		return 0, badRequest(fieldTTL, strconv.Quote(v.str)+" is above the longest, "+policies.MaxReservationTTL.String())
	}
	return int64(d), nil
}

// parseSettleCost parses a settle's cost: a cost (policies.ParseCost) or
// zero ("0", "0.0", ...).
func parseSettleCost(s string) (int64, error) {
	c, err := policies.ParseUnits(s)
	if err == nil && c == 0 {
		return 0, nil
	}
	if c, err = policies.ParseCost(s); err != nil {
		return 0, fmt.Errorf("%w: %v", fail.ErrBadRequest, err)
	}
	return c, nil
}
