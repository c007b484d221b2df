package policies

import (
	"strconv"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
)

// Policy limits (CONTRACT.md §3, §8, §9).
const (
	MaxLimits      = 8                                // most limits in one policy
	MaxNameLen     = 64                               // most bytes in a policy or limit name
	MaxSlidingLog  = 10_000 * kvstate.Unit            // largest sliding_log limit, micro-units
	MaxQuota       = 1_000_000_000_000 * kvstate.Unit // largest quota limit, micro-units (1e12 units)
	MinWindow      = 1_000_000                        // shortest window or hold, ns (1 ms)
	MaxDescription = maxDescriptionLn                 // most bytes in a description

	DefaultMaxKeys  int64 = 1_000_000              // distinct live limit keys of a policy without max_keys
	MinLeaseTTL           = 100 * time.Millisecond // shortest lease ttl
	DefaultLeaseTTL       = 2 * time.Second        // lease ttl when the lease object has none
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
	// MaxKeys is the most distinct live limit keys the policy keeps
	// (CONTRACT.md §9): a new key beyond them is decided against the
	// policy's [Policy.OverflowKey]. At least 1; Parse sets DefaultMaxKeys
	// when the document has no max_keys.
	MaxKeys int64
	// Lease is the grant parameters of a leased policy (CONTRACT.md §8),
	// with every default filled in; the zero Lease for the other modes.
	Lease Lease
	// Layer is the budget layer the policy belongs to (CONTRACT.md §11,
	// [a-z0-9][a-z0-9_-]{0,31}; "" by default): a request is decided by
	// the best matching policy of each layer.
	Layer string
}

// MaxLayerLen is the most bytes in a layer name.
const MaxLayerLen = 32

// ValidLayer reports whether s is a layer name: "" or
// [a-z0-9][a-z0-9_-]{0,31}.
func ValidLayer(s string) bool {
	if len(s) > MaxLayerLen {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9':
		case (c == '_' || c == '-') && i > 0:
		default:
			return false
		}
	}
	return true
}

// Lease is the grant parameters of a leased policy (CONTRACT.md §8).
type Lease struct {
	// Size is the micro-units in one grant (> 0, at most MaxOutstanding).
	// Default: a tenth of the smallest limit's capacity, at least 1 unit,
	// at most MaxOutstanding.
	Size int64
	// TTL is how long a grant may be spent, at least MinLeaseTTL. Default
	// DefaultLeaseTTL.
	TTL time.Duration
	// MaxOutstanding is the most micro-units, per limit key, granted and
	// neither spent, returned nor expired at any instant (> 0): the
	// overshoot bound of a leased key. Default: the smallest limit's
	// capacity.
	MaxOutstanding int64
}

// DefaultLease returns the lease parameters of a leased policy with limits
// whose document has no lease object: ttl DefaultLeaseTTL, max_outstanding
// the smallest limit's capacity ([kvstate.Limit.Capacity]) and size a tenth
// of it (rounded down to a micro-unit), at least 1 unit and at most
// max_outstanding.
func DefaultLease(limits []NamedLimit) Lease {
	return leaseDefaults(Lease{}, limits)
}

// leaseDefaults fills the zero fields of l with the defaults for limits.
func leaseDefaults(l Lease, limits []NamedLimit) Lease {
	var capacity int64
	for i, nl := range limits {
		if c := nl.Capacity(); i == 0 || c < capacity {
			capacity = c
		}
	}
	if l.TTL == 0 {
		l.TTL = DefaultLeaseTTL
	}
	if l.MaxOutstanding == 0 {
		l.MaxOutstanding = max(capacity, 1)
	}
	if l.Size == 0 {
		l.Size = min(max(capacity/10, kvstate.Unit), l.MaxOutstanding)
	}
	return l
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
// with unique valid names and valid parameters, a known mode, a bounded
// description, MaxKeys >= 1 and, for a leased policy, a complete Lease (the
// zero Lease otherwise). Errors are [*Error] and match [ErrInvalid].
func (p *Policy) Validate() error {
	if err := ValidateName(p.Name); err != nil {
		return err
	}
	if len(p.Match) > MaxDims {
		return invalid("match", "has "+strconv.Itoa(len(p.Match))+" entries (at most 16)")
	}
	if !ValidLayer(p.Layer) {
		return invalid("layer", strconv.Quote(p.Layer)+" is not [a-z0-9][a-z0-9_-]{0,31}")
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
	if p.MaxKeys < 1 {
		return invalid("max_keys", strconv.FormatInt(p.MaxKeys, 10)+" "+reasonNotPos)
	}
	if p.Mode != ModeLeased {
		if p.Lease != (Lease{}) {
			return invalid("lease", reasonLeaseMode)
		}
		return nil
	}
	return validateLease(p.Lease)
}

// reasonLeaseMode rejects a lease on a policy that is not leased.
const reasonLeaseMode = `is only for "mode":"leased"`

// validateLease checks a leased policy's complete Lease.
func validateLease(l Lease) error {
	switch {
	case l.Size <= 0:
		return invalid("lease.size", formatMicro(l.Size)+" "+reasonNotPos)
	case l.MaxOutstanding <= 0:
		return invalid("lease.max_outstanding", formatMicro(l.MaxOutstanding)+" "+reasonNotPos)
	case l.TTL < MinLeaseTTL:
		return invalid("lease.ttl", strconv.Quote(l.TTL.String())+" is under 100ms")
	case l.Size > l.MaxOutstanding:
		return invalid("lease.size", formatMicro(l.Size)+" is above max_outstanding "+formatMicro(l.MaxOutstanding))
	}
	return nil
}

// validateLimit checks a limit's fixed-point parameters: the fields its
// algorithm uses are positive (windows at least 1 ms, sliding_log limits
// at most 10000 units, quota limits at most 1e12 units and a known
// period; a rate per second, or per minute, hour or day when it is not a
// whole number of micro-units per second, as Parse makes it) and the
// others are zero.
func validateLimit(path string, l kvstate.Limit) error {
	switch l.Algorithm {
	case kvstate.TokenBucket, kvstate.GCRA:
		if l.Rate <= 0 {
			return invalid(path+".rate", "must be > 0")
		}
		switch l.RatePer {
		case 0:
		case perMinute, perHour, perDay:
			if l.Rate%(l.RatePer/perSecond) == 0 {
				return invalid(path+".rate", "a whole number of micro-units per second is kept per second")
			}
		default:
			return invalid(path+".rate", "is not per second, minute, hour or day")
		}
		if l.Burst <= 0 {
			return invalid(path+".burst", "must be > 0")
		}
		if l.Limit != 0 || l.Window != 0 || l.Period != 0 {
			return invalid(path, "a bucket limit has no limit, window or period")
		}
	case kvstate.Quota:
		if l.Limit <= 0 {
			return invalid(path+".limit", "must be > 0")
		}
		if l.Limit > MaxQuota {
			return invalid(path+".limit", formatMicro(l.Limit)+" is above 1000000000000, the most a quota allows")
		}
		if l.Period < kvstate.Hour || l.Period > kvstate.Month {
			return invalid(path+".period", "is not hour, day, week or month")
		}
		if l.Rate != 0 || l.Burst != 0 || l.Window != 0 || l.RatePer != 0 {
			return invalid(path, "a quota limit has no rate, burst or window")
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
		if l.Rate != 0 || l.Burst != 0 || l.RatePer != 0 || l.Period != 0 {
			return invalid(path, "a "+l.Algorithm.String()+" limit has no rate, burst or period")
		}
	default:
		return invalid(path+".algorithm", "unknown algorithm "+strconv.Itoa(int(l.Algorithm)))
	}
	return nil
}
