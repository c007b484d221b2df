package policies

import (
	"math"
	"strconv"

	"github.com/cockroachdb/apd/v3"
	"github.com/limitmesh/limitmesh/kvstate"
)

// Decimal syntax. A quantity a human writes (a cost, a burst, a window
// limit, the N of a rate) is the text of a JSON number without exponent or
// sign: `(0|[1-9][0-9]*)(\.[0-9]{1,6})?`, given either as a JSON number or
// as a string holding the same text. It becomes fixed point exactly once:
// value * 1e6 micro-units, exact because at most 6 fractional digits are
// allowed. Anything else is rejected, never rounded.

// MaxCost is the largest request cost in micro-units (1,000,000,000 units).
const MaxCost int64 = 1_000_000_000 * kvstate.Unit

// maxFracDigits is the most fractional digits a decimal may have: one
// micro-unit.
const maxFracDigits = 6

// decimalCtx converts validated decimals to micro-units. Its precision is far
// above what can fit int64, so a too-large value shows up as an Int64 error
// rather than a rounded result.
var decimalCtx = apd.Context{
	Precision:   64,
	MaxExponent: apd.MaxExponent,
	MinExponent: apd.MinExponent,
	Traps:       apd.DefaultTraps,
}

// Reasons a decimal is rejected; the caller puts the offending text first.
const (
	reasonEmpty     = "is empty"
	reasonNotNumber = "is not a decimal number"
	reasonExponent  = "has an exponent (write the digits out)"
	reasonFrac      = "has more than 6 fractional digits"
	reasonNotPos    = "must be > 0"
)

// parseMicro parses a decimal (see the syntax above) into micro-units,
// accepting values in (0, max]. On failure it returns a reason to print
// after the offending text.
func parseMicro(s string, max int64) (int64, string) {
	if s == "" {
		return 0, reasonEmpty
	}
	neg := s[0] == '-'
	body := s
	if neg {
		body = s[1:]
	}
	// Integer part.
	i := 0
	for i < len(body) && isDigit(body[i]) {
		i++
	}
	intPart := body[:i]
	if intPart == "" || (len(intPart) > 1 && intPart[0] == '0') {
		return 0, reasonNotNumber
	}
	fracPart := ""
	if i < len(body) && body[i] == '.' {
		j := i + 1
		for j < len(body) && isDigit(body[j]) {
			j++
		}
		fracPart = body[i+1 : j]
		if fracPart == "" {
			return 0, reasonNotNumber
		}
		i = j
	}
	if i < len(body) {
		if body[i] == 'e' || body[i] == 'E' {
			return 0, reasonExponent
		}
		return 0, reasonNotNumber
	}
	if len(fracPart) > maxFracDigits {
		return 0, reasonFrac
	}
	if neg || allZero(intPart) && allZero(fracPart) {
		return 0, reasonNotPos
	}
	if len(intPart) > 19 {
		return 0, tooLarge(max)
	}
	// Fast path: a plain integer of at most 12 digits times 1e6 fits int64.
	if fracPart == "" && len(intPart) <= 12 {
		var n int64
		for k := 0; k < len(intPart); k++ {
			n = n*10 + int64(intPart[k]-'0')
		}
		if n > max/kvstate.Unit {
			return 0, tooLarge(max)
		}
		return n * kvstate.Unit, ""
	}
	d, _, err := apd.NewFromString(body)
	if err != nil {
		return 0, reasonNotNumber
	}
	d.Exponent += maxFracDigits // scale to micro-units
	var r apd.Decimal
	if _, err := decimalCtx.Quantize(&r, d, 0); err != nil {
		return 0, tooLarge(max)
	}
	v, err := r.Int64()
	if err != nil || v > max {
		return 0, tooLarge(max)
	}
	return v, ""
}

func tooLarge(max int64) string { return "is too large (at most " + formatMicro(max) + ")" }

// ParseCost parses a request cost (CONTRACT.md §2): JSON number text or the
// contents of a decimal string, no exponent, no sign, > 0 and <= 1e9, at
// most 6 fractional digits. It returns micro-units (1 unit = 1,000,000). A
// plain integer is parsed without allocating. Errors are [*Error] with Path
// "cost" and match [ErrInvalid].
func ParseCost(s string) (int64, error) {
	// Fast path: 1..10 digits, no leading zero.
	if n := len(s); n > 0 && n <= 10 && s[0] != '0' {
		var v int64
		ok := true
		for i := 0; i < n; i++ {
			c := s[i]
			if !isDigit(c) {
				ok = false
				break
			}
			v = v*10 + int64(c-'0')
		}
		if ok && v <= MaxCost/kvstate.Unit {
			return v * kvstate.Unit, nil
		}
	}
	v, reason := parseMicro(s, MaxCost)
	if reason != "" {
		return 0, invalid("cost", strconv.Quote(s)+" "+reason)
	}
	return v, nil
}

// parseRate parses "N/s", "N/m" or "N/h" (N a decimal as above) into
// micro-units per second. A rate that is not a whole number of micro-units
// per second is rounded DOWN (conservative: the limit never admits more
// than written): "2.5/h" is 694 micro-units/s, not 694.44. A rate that
// rounds down to zero is rejected.
func parseRate(s string) (int64, string) {
	q := strconv.Quote(s)
	if len(s) < 3 || s[len(s)-2] != '/' {
		return 0, q + " is not N/s, N/m or N/h"
	}
	var secs int64
	switch s[len(s)-1] {
	case 's':
		secs = 1
	case 'm':
		secs = 60
	case 'h':
		secs = 3600
	default:
		return 0, q + " is not N/s, N/m or N/h"
	}
	n, reason := parseMicro(s[:len(s)-2], math.MaxInt64)
	switch reason {
	case "":
	case reasonNotNumber, reasonEmpty:
		return 0, q + " is not N/s, N/m or N/h"
	default:
		return 0, q + ": N " + reason
	}
	r := n / secs
	if r == 0 {
		return 0, q + " rounds down to 0 micro-units per second"
	}
	return r, ""
}

// formatMicro writes micro-units as a decimal with the fractional digits
// that are needed: 1500000 -> "1.5", 10000000 -> "10".
func formatMicro(v int64) string {
	return string(appendMicro(nil, v))
}

func appendMicro(b []byte, v int64) []byte {
	if v < 0 {
		b = append(b, '-')
		// Not reached for valid quantities; avoid overflow on MinInt64.
		u := uint64(-(v + 1)) + 1
		return appendMicroU(b, u)
	}
	return appendMicroU(b, uint64(v))
}

func appendMicroU(b []byte, u uint64) []byte {
	unit := uint64(kvstate.Unit)
	b = strconv.AppendUint(b, u/unit, 10)
	frac := u % unit
	if frac == 0 {
		return b
	}
	var digits [maxFracDigits]byte
	for i := maxFracDigits - 1; i >= 0; i-- {
		digits[i] = byte('0' + frac%10)
		frac /= 10
	}
	n := maxFracDigits
	for digits[n-1] == '0' {
		n--
	}
	b = append(b, '.')
	return append(b, digits[:n]...)
}

func isDigit(c byte) bool { return c >= '0' && c <= '9' }

func allZero(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] != '0' {
			return false
		}
	}
	return true
}
