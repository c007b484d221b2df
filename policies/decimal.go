package policies

import (
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/cockroachdb/apd/v3"
	"github.com/limitmesh/limitmesh/internal/wire"
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

// parseCount parses a positive whole number (digits, no sign, no leading
// zero) that fits int64. On failure it returns a reason to print after the
// offending text.
func parseCount(s string) (int64, string) {
	if s == "" {
		return 0, reasonEmpty
	}
	body := s
	if s[0] == '-' {
		body = s[1:]
	}
	i := 0
	for i < len(body) && isDigit(body[i]) {
		i++
	}
	if i == 0 || (i > 1 && body[0] == '0') {
		return 0, reasonNotNumber
	}
	if i < len(body) {
		switch body[i] {
		case '.':
			return 0, "is not a whole number"
		case 'e', 'E':
			return 0, reasonExponent
		}
		return 0, reasonNotNumber
	}
	if len(body) != len(s) || allZero(body) {
		return 0, reasonNotPos
	}
	n, err := strconv.ParseInt(body, 10, 64)
	if err != nil {
		return 0, "is too large (at most " + strconv.FormatInt(math.MaxInt64, 10) + ")"
	}
	return n, ""
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

// Rate periods: the span, in ns, that "N/s", "N/m", "N/h" and "N/d" count
// over.
const (
	perSecond = kvstate.Second
	perMinute = 60 * perSecond
	perHour   = 60 * perMinute
	perDay    = 24 * perHour
)

// parseRate parses "N/s", "N/m", "N/h" or "N/d" (N a decimal as above) into
// an exact kvstate rate: Rate micro-units per RatePer ns. A rate that is a
// whole number of micro-units per second is kept per second (RatePer 0,
// Rate = N*1e6/seconds): "600/m" is Rate 10,000,000, RatePer 0. Any other
// rate is kept over its own period, with nothing rounded: "1000/d" is Rate
// 1,000,000,000 micro-units per RatePer 86400 s, "2.5/h" is Rate 2,500,000
// per RatePer 3600 s.
func parseRate(s string) (rate, per int64, reason string) {
	q := strconv.Quote(s)
	if len(s) < 3 || s[len(s)-2] != '/' {
		return 0, 0, q + " " + reasonRate
	}
	switch s[len(s)-1] {
	case 's':
		per = perSecond
	case 'm':
		per = perMinute
	case 'h':
		per = perHour
	case 'd':
		per = perDay
	default:
		return 0, 0, q + " " + reasonRate
	}
	n, reason := parseMicro(s[:len(s)-2], math.MaxInt64)
	switch reason {
	case "":
	case reasonNotNumber, reasonEmpty:
		return 0, 0, q + " " + reasonRate
	default:
		return 0, 0, q + ": N " + reason
	}
	if secs := per / perSecond; n%secs == 0 {
		return n / secs, 0, ""
	}
	return n, per, ""
}

// reasonRate is the rejection of a rate that is not N/s, N/m, N/h or N/d.
const reasonRate = "is not N/s, N/m, N/h or N/d"

// FormatRate writes a bucket limit's rate as a policy document does: "N/s"
// when RatePer is 0, "N/m", "N/h" or "N/d" for a rate kept over a minute,
// an hour or a day, with N the exact decimal number of units (Rate in
// micro-units): Rate 10,000,000 is "10/s", Rate 1e9 per day is "1000/d". A
// RatePer that no policy produces is written "N per <duration>".
func FormatRate(l kvstate.Limit) string {
	return string(appendRate(nil, l))
}

func appendRate(b []byte, l kvstate.Limit) []byte {
	b = appendMicro(b, l.Rate)
	switch l.RatePer {
	case 0, perSecond:
		return append(b, "/s"...)
	case perMinute:
		return append(b, "/m"...)
	case perHour:
		return append(b, "/h"...)
	case perDay:
		return append(b, "/d"...)
	}
	return append(append(b, " per "...), time.Duration(l.RatePer).String()...)
}

// formatMicro writes micro-units as a decimal with the fractional digits
// that are needed: 1500000 -> "1.5", 10000000 -> "10".
func formatMicro(v int64) string { return wire.FormatUnits(v) }

func appendMicro(b []byte, v int64) []byte { return wire.AppendUnits(b, v) }

func isDigit(c byte) bool { return c >= '0' && c <= '9' }

func allZero(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] != '0' {
			return false
		}
	}
	return true
}

// ParseUnits parses a non-negative decimal number of units (the decimal
// syntax above; 0 allowed, no upper bound below int64) into micro-units:
// what replies carry ("remaining", "settled").
func ParseUnits(s string) (int64, error) {
	if z, ok := strings.CutPrefix(s, "0"); ok && (z == "" || len(z) >= 2 && len(z) <= 7 && z[0] == '.' && strings.Trim(z[1:], "0") == "") {
		return 0, nil
	}
	v, reason := parseMicro(s, math.MaxInt64)
	if reason != "" {
		return 0, invalid("units", strconv.Quote(s)+" "+reason)
	}
	return v, nil
}
