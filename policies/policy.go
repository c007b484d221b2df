package policies

import (
	"strconv"

	"github.com/limitmesh/limitmesh/kvstate"
)

// Policy limits (CONTRACT.md §3).
const (
	MaxLimits      = 8                     // most limits in one policy
	MaxNameLen     = 64                    // most bytes in a policy or limit name
	MaxSlidingLog  = 10_000 * kvstate.Unit // largest sliding_log limit, micro-units
	MinWindow      = 1_000_000             // shortest window or hold, ns (1 ms)
	MaxDescription = maxDescriptionLn      // most bytes in a description
)

// Mode is how a node enforces a policy (DESIGN.md's modes). The zero value
// is ModeStrict. Parse accepts every mode; a node rejects the modes it does
// not implement.
type Mode uint8

// The modes.
const (
	ModeStrict Mode = iota // exact and global; state written before the reply (default)
	ModeAsync              // the key's owner decides; state written behind
	ModeLocal              // each node decides alone
	ModeLeased             // nodes spend leased slices of the budget
)

var modeNames = [...]string{ModeStrict: "strict", ModeAsync: "async", ModeLocal: "local", ModeLeased: "leased"}

// String returns the mode's JSON word, such as "strict".
func (m Mode) String() string {
	if int(m) < len(modeNames) {
		return modeNames[m]
	}
	return "mode(" + strconv.Itoa(int(m)) + ")"
}

// ParseMode returns the mode with the given JSON word.
func ParseMode(s string) (Mode, bool) {
	for m, n := range modeNames {
		if n == s {
			return Mode(m), true
		}
	}
	return 0, false
}

// NamedLimit is one limit of a policy: its name, unique in the policy
// ([a-z0-9_-]{1,64}; by default the algorithm's name), and its parameters in
// fixed point.
type NamedLimit struct {
	Name string
	kvstate.Limit
}

// Policy is one validated policy (CONTRACT.md §3). A Policy is immutable
// once it is built: Parse returns a fresh one and a [Snapshot] shares it
// between goroutines, so never modify a Policy after handing it out.
type Policy struct {
	Name        string       // the KV key, [a-z0-9][a-z0-9_-]{0,63}
	Revision    uint64       // KV revision of the policy entry (set by the caller/watcher)
	Match       []Dim        // sorted by Name; Value "*" means present with any value
	Key         []string     // key dimensions, sorted; default: the Match names
	Limits      []NamedLimit // 1..8, in document order
	Mode        Mode
	Shadow      bool
	Description string
}

// ValidateName checks a policy name: [a-z0-9][a-z0-9_-]{0,63}. Errors are
// [*Error] with Path "name" and match [ErrInvalid].
func ValidateName(name string) error {
	if !validPolicyName(name) {
		return invalid("name", strconv.Quote(name)+" is not [a-z0-9][a-z0-9_-]{0,63}")
	}
	return nil
}

func validPolicyName(s string) bool {
	if len(s) == 0 || len(s) > MaxNameLen {
		return false
	}
	if c := s[0]; !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9') {
		return false
	}
	return validLimitName(s)
}

// validLimitName reports whether s matches [a-z0-9_-]{1,64}.
func validLimitName(s string) bool {
	if len(s) == 0 || len(s) > MaxNameLen {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}

// Validate checks every rule Parse enforces on a Policy built in code (or
// modified): the name, a sorted match of valid, unique dimensions with valid
// values or "*", a sorted key of valid unique dimension names, 1..8 limits
// with unique valid names and valid parameters, a known mode and a bounded
// description. Errors are [*Error] and match [ErrInvalid].
func (p *Policy) Validate() error {
	if err := ValidateName(p.Name); err != nil {
		return err
	}
	if len(p.Match) > MaxDims {
		return invalid("match", "has "+strconv.Itoa(len(p.Match))+" entries (at most 16)")
	}
	for i, d := range p.Match {
		if !validDimName(d.Name) {
			return invalid("match", "dimension name "+strconv.Quote(d.Name)+" is not [a-z][a-z0-9_]{0,31}")
		}
		if d.Value != AnyValue {
			if r := valueProblem(d.Value); r != "" {
				return invalid("match."+d.Name, r)
			}
		}
		if i > 0 && p.Match[i-1].Name >= d.Name {
			return invalid("match."+d.Name, "not sorted by name or duplicate")
		}
	}
	if len(p.Key) > MaxDims {
		return invalid("key", "has "+strconv.Itoa(len(p.Key))+" entries (at most 16)")
	}
	for i, k := range p.Key {
		path := "key[" + strconv.Itoa(i) + "]"
		if !validDimName(k) {
			return invalid(path, strconv.Quote(k)+" is not [a-z][a-z0-9_]{0,31}")
		}
		if i > 0 && p.Key[i-1] >= k {
			return invalid(path, "not sorted or duplicate")
		}
	}
	if len(p.Limits) == 0 || len(p.Limits) > MaxLimits {
		return invalid("limits", "has "+strconv.Itoa(len(p.Limits))+" limits (needs 1..8)")
	}
	for i, l := range p.Limits {
		path := "limits[" + strconv.Itoa(i) + "]"
		if !validLimitName(l.Name) {
			return invalid(path+".name", strconv.Quote(l.Name)+" is not [a-z0-9_-]{1,64}")
		}
		for j := 0; j < i; j++ {
			if p.Limits[j].Name == l.Name {
				return invalid(path+".name", "duplicate limit name "+strconv.Quote(l.Name)+" (also limits["+strconv.Itoa(j)+"])")
			}
		}
		if err := validateLimit(path, l.Limit); err != nil {
			return err
		}
	}
	if int(p.Mode) >= len(modeNames) {
		return invalid("mode", p.Mode.String()+" is not strict, async, local or leased")
	}
	if len(p.Description) > MaxDescription {
		return invalid("description", "is "+strconv.Itoa(len(p.Description))+" bytes (at most 1024)")
	}
	return nil
}

// validateLimit checks a limit's fixed-point parameters: the fields its
// algorithm uses are positive (windows at least 1 ms, sliding_log limits
// at most 10000 units) and the others are zero.
func validateLimit(path string, l kvstate.Limit) error {
	switch l.Algorithm {
	case kvstate.TokenBucket, kvstate.GCRA:
		if l.Rate <= 0 {
			return invalid(path+".rate", "must be > 0")
		}
		if l.Burst <= 0 {
			return invalid(path+".burst", "must be > 0")
		}
		if l.Limit != 0 || l.Window != 0 {
			return invalid(path, "a bucket limit has no limit or window")
		}
	case kvstate.FixedWindow, kvstate.SlidingWindow, kvstate.SlidingLog, kvstate.Concurrency:
		if l.Limit <= 0 {
			return invalid(path+".limit", "must be > 0")
		}
		if l.Algorithm == kvstate.SlidingLog && l.Limit > MaxSlidingLog {
			return invalid(path+".limit", formatMicro(l.Limit)+" is above 10000, the most a sliding_log allows")
		}
		if l.Window < MinWindow {
			return invalid(path+".window", "must be at least 1ms")
		}
		if l.Rate != 0 || l.Burst != 0 {
			return invalid(path, "a "+l.Algorithm.String()+" limit has no rate or burst")
		}
	default:
		return invalid(path+".algorithm", "unknown algorithm "+strconv.Itoa(int(l.Algorithm)))
	}
	return nil
}
