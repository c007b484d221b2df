package shadow

import (
	"errors"

	"github.com/limitmesh/limitmesh/kvstate"
)

// Summary is what the evaluator knows about one candidate revision, stored
// as JSON in the KV bucket <prefix>_shadow under the candidate's name
// (CONTRACT.md §7). The first twelve fields are the contract's, in its
// order; the others are compatible extensions.
//
// Counts cover the records evaluated for this revision since SinceUs (they
// start at 0 for each revision). A record is evaluated when the candidate's
// match covers its descriptor and the descriptor has every dimension of the
// candidate's key; then exactly one of WouldAllow and WouldDeny counts it,
// and LiveDenied counts it when the live decision (the record's result)
// was a denial. BothDenied + OnlyCandidateDenied = WouldDeny and BothDenied
// + OnlyLiveDenied = LiveDenied.
type Summary struct {
	Policy              string   `json:"policy"`
	Revision            uint64   `json:"revision"`
	SinceUs             int64    `json:"since_us"` // t_us of the first record evaluated; 0 before
	Evaluated           uint64   `json:"evaluated"`
	WouldAllow          uint64   `json:"would_allow"`
	WouldDeny           uint64   `json:"would_deny"`
	WouldDenyUnits      Units    `json:"would_deny_units"` // summed cost of the would-be denials
	LiveDenied          uint64   `json:"live_denied"`
	BothDenied          uint64   `json:"both_denied"`
	OnlyCandidateDenied uint64   `json:"only_candidate_denied"`
	OnlyLiveDenied      uint64   `json:"only_live_denied"`
	TopDenied           []TopKey `json:"top_denied"` // at most TopN, most denied first

	// Skipped counts the matching records whose descriptor lacks a
	// dimension of the candidate's key (a live decision would be a 400);
	// they are not evaluated.
	Skipped uint64 `json:"skipped"`
	// Overflow counts the evaluated records of keys that found the
	// candidate holding MaxKeys keys: they were decided against the
	// candidate's one shared overflow state (OverflowKey).
	Overflow uint64 `json:"overflow"`
	// Keys is the number of limit keys holding state.
	Keys int `json:"keys"`
	// LastUs is the t_us of the last record evaluated (0 before).
	LastUs int64 `json:"last_us"`
	// Series is the recent history of the counts in buckets of
	// SeriesStepUs of record time, oldest first, at most SeriesLen: what
	// the dashboard draws the would-deny rate over time from.
	Series []Point `json:"series"`
	// UpdatedUs is the wall-clock time the evaluator wrote the summary,
	// Unix microseconds (0 in a backtest).
	UpdatedUs int64 `json:"updated_us,omitempty"`
}

// TopKey is a limit key the candidate would have denied, with the number
// of its would-be denials.
type TopKey struct {
	Key       string `json:"key"`
	WouldDeny uint64 `json:"would_deny"`
}

// Point is one bucket of a [Summary]'s series: the records evaluated in
// the SeriesStepUs of record time starting at TimeUs (Unix microseconds),
// how many of them the candidate would have denied and how many the live
// policy denied.
type Point struct {
	TimeUs     int64  `json:"t_us"`
	Evaluated  uint64 `json:"evaluated"`
	WouldDeny  uint64 `json:"would_deny"`
	LiveDenied uint64 `json:"live_denied"`
}

// Units is a quantity in micro-units (1 unit = 1,000,000) that reads and
// writes itself in JSON as a decimal number of units with the fractional
// digits it needs: 1800 for 1,800,000,000 micro-units, 2.5 for 2,500,000.
type Units int64

// MarshalJSON writes u as a decimal JSON number.
func (u Units) MarshalJSON() ([]byte, error) { return appendUnits(nil, int64(u)), nil }

// UnmarshalJSON reads a JSON number (or a string holding one) without an
// exponent and with at most 6 fractional digits.
func (u *Units) UnmarshalJSON(b []byte) error {
	s := string(b)
	if len(s) >= 2 && s[0] == '"' && s[len(s)-1] == '"' {
		s = s[1 : len(s)-1]
	}
	v, err := parseUnits(s)
	if err != nil {
		return err
	}
	*u = Units(v)
	return nil
}

// String returns u as a decimal ("2.5").
func (u Units) String() string { return string(appendUnits(nil, int64(u))) }

// appendUnits appends micro-units v as a decimal with the fractional digits
// it needs: 1500000 -> 1.5, 3000000 -> 3.
func appendUnits(dst []byte, v int64) []byte { return kvstate.AppendUnits(dst, v) }

var errUnits = errors.New("shadow: units must be a decimal number with at most 6 fractional digits")

// parseUnits reads a decimal ("-"? digits ("." 1..6 digits)?) as
// micro-units.
func parseUnits(s string) (int64, error) {
	neg := false
	if len(s) > 0 && s[0] == '-' {
		neg, s = true, s[1:]
	}
	whole, frac, hasFrac := s, "", false
	for i := 0; i < len(s); i++ {
		if s[i] == '.' {
			whole, frac, hasFrac = s[:i], s[i+1:], true
			break
		}
	}
	if whole == "" || len(whole) > 12 || hasFrac && (frac == "" || len(frac) > 6) {
		return 0, errUnits
	}
	var v int64
	for i := 0; i < len(whole); i++ {
		if whole[i] < '0' || whole[i] > '9' {
			return 0, errUnits
		}
		v = v*10 + int64(whole[i]-'0')
	}
	v *= 1_000_000
	scale := int64(100_000)
	for i := 0; i < len(frac); i++ {
		if frac[i] < '0' || frac[i] > '9' {
			return 0, errUnits
		}
		v += int64(frac[i]-'0') * scale
		scale /= 10
	}
	if neg {
		v = -v
	}
	return v, nil
}
