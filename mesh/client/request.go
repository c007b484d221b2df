package client

import (
	"fmt"
	"strconv"

	"github.com/limitmesh/limitmesh/internal/wire"
)

// MaxCost is the largest cost the contract accepts, in whole units.
const MaxCost = 1_000_000_000

// decideOptions collects the per-call options of Decide.
type decideOptions struct {
	cost      string // decimal cost from Cost(); "" = use the int64 argument
	requestID string
	dryRun    bool
}

// A DecideOption changes one Decide call.
type DecideOption func(*decideOptions)

// Cost sets a decimal cost such as "2.5" (no sign, no exponent, at most 6
// fractional digits, > 0 and <= [MaxCost]); it replaces Decide's int64 cost
// argument and is sent as a JSON string. An invalid decimal makes Decide
// return an error wrapping [ErrInvalidRequest] without a network call.
func Cost(decimal string) DecideOption {
	return func(o *decideOptions) { o.cost = decimal }
}

// RequestID sets the request id (at most 128 bytes): a retry carrying the
// same id for the same limit key within 60 s gets the first decision and
// spends once (CONTRACT.md §2).
func RequestID(id string) DecideOption {
	return func(o *decideOptions) { o.requestID = id }
}

func setDryRun(o *decideOptions) { o.dryRun = true }

// DryRun asks for the decision a real request would get now, spending nothing.
func DryRun() DecideOption { return setDryRun }

// ParseCost parses a decimal cost as [Cost] accepts it and returns it in
// micro-units (1e-6 of a unit). Errors wrap [ErrInvalidRequest].
func ParseCost(s string) (int64, error) {
	return parseCost(s, false)
}

// parseCost is ParseCost that also accepts zero when zero is true (the
// cost of a settle, CONTRACT.md §10).
func parseCost(s string, zero bool) (int64, error) {
	if s == "" {
		return 0, fmt.Errorf("%w: empty cost", ErrInvalidRequest)
	}
	var whole, frac int64
	fracDigits := 0
	i := 0
	for ; i < len(s) && s[i] >= '0' && s[i] <= '9'; i++ {
		if whole > MaxCost {
			return 0, fmt.Errorf("%w: cost %q above %d", ErrInvalidRequest, s, MaxCost)
		}
		whole = whole*10 + int64(s[i]-'0')
	}
	if i == 0 {
		return 0, fmt.Errorf("%w: cost %q is not a decimal", ErrInvalidRequest, s)
	}
	if i < len(s) {
		if s[i] != '.' || i+1 == len(s) {
			return 0, fmt.Errorf("%w: cost %q is not a decimal", ErrInvalidRequest, s)
		}
		for i++; i < len(s); i++ {
			if s[i] < '0' || s[i] > '9' {
				return 0, fmt.Errorf("%w: cost %q is not a decimal", ErrInvalidRequest, s)
			}
			if fracDigits == 6 {
				return 0, fmt.Errorf("%w: cost %q has more than 6 fractional digits", ErrInvalidRequest, s)
			}
			frac = frac*10 + int64(s[i]-'0')
			fracDigits++
		}
	}
	for ; fracDigits < 6; fracDigits++ {
		frac *= 10
	}
	if whole > MaxCost {
		return 0, fmt.Errorf("%w: cost %q above %d", ErrInvalidRequest, s, MaxCost)
	}
	micro := whole*1_000_000 + frac
	if zero && micro == 0 {
		return 0, nil
	}
	if micro <= 0 || micro > MaxCost*1_000_000 {
		return 0, fmt.Errorf("%w: cost %q not in (0, %d]", ErrInvalidRequest, s, MaxCost)
	}
	return micro, nil
}

// appendRequest appends the JSON decide request (CONTRACT.md §2) to dst.
// The cost is the decimal o.cost when set, else the whole number cost.
// It writes the JSON by hand: this runs on every request.
func appendRequest(dst []byte, d map[string]string, cost int64, o *decideOptions) []byte {
	dst = append(dst, `{"descriptor":{`...)
	first := true
	for k, v := range d {
		if !first {
			dst = append(dst, ',')
		}
		first = false
		dst = wire.AppendString(dst, k)
		dst = append(dst, ':')
		dst = wire.AppendString(dst, v)
	}
	dst = append(dst, `},"cost":`...)
	if o.cost != "" {
		dst = wire.AppendString(dst, o.cost)
	} else {
		dst = strconv.AppendInt(dst, cost, 10)
	}
	if o.requestID != "" {
		dst = append(dst, `,"request_id":`...)
		dst = wire.AppendString(dst, o.requestID)
	}
	if o.dryRun {
		dst = append(dst, `,"dry_run":true`...)
	}
	return append(dst, '}')
}
