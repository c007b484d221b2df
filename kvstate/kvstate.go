// Package kvstate is the pure core of limitmesh: every limit algorithm as a
// deterministic function of (limit, state, now, cost), fixed-point units, and
// the binary codec for the state a limit key keeps in JetStream KV.
//
// Units. Quantities (tokens, costs, counts) are int64 micro-units: 1 unit is
// [Unit] = 1,000,000 micro-units. Rates are micro-units per second, or per
// [Limit.RatePer] ns when that is set, so that a rate such as 1000 units a
// day is exact. Times and durations are int64 nanoseconds (Unix nanoseconds
// for instants); calendar periods are UTC. No floating point is used in a
// decision.
//
// Purity. Nothing in the decision functions reads a clock, allocates on the
// token-bucket and GCRA paths, logs or does I/O, and no function mutates the
// state it is given: deciding returns a new state, which is exactly what a
// compare-and-swap write needs.
//
// Time. The caller supplies now (the serialization point's clock). Elapsed time
// is clamped to [0, time-to-full]: an instant equal to or before the state's
// last update never creates capacity, and very long idle periods, huge rates
// and huge bursts never overflow (intermediate products use 128-bit integers
// and saturate).
//
// This package imports nothing of the project.
package kvstate

import (
	"fmt"
	"math"

	"github.com/limitmesh/limitmesh/internal/wire"
)

// Unit is the number of micro-units in one unit of cost or capacity.
const Unit int64 = 1_000_000

// Second is one second in nanoseconds, the time base of rates.
const Second int64 = 1_000_000_000

// Never is the RetryAfter of a decision whose cost can never be admitted
// because it exceeds the limit's capacity.
const Never int64 = -1

// MaxLogEntries is the most entries a sliding_log state holds (§6). A log
// that is full denies until its oldest entry expires.
const MaxLogEntries = 10_000

// MaxHolds is the most holders a concurrency state tracks.
const MaxHolds = 10_000

// Algorithm names a limit algorithm. The zero value is invalid.
type Algorithm uint8

// The algorithms. Their numeric values are part of the state codec: never
// renumber them.
const (
	TokenBucket   Algorithm = 1 // tokens refilled at Rate up to Burst
	GCRA          Algorithm = 2 // the token-bucket envelope as a theoretical arrival time
	FixedWindow   Algorithm = 3 // at most Limit per aligned Window
	SlidingWindow Algorithm = 4 // two-window weighted estimate
	SlidingLog    Algorithm = 5 // exact trailing Window, at most MaxLogEntries entries
	Concurrency   Algorithm = 6 // at most Limit held at once; holds expire after Window
	Quota         Algorithm = 7 // at most Limit per UTC calendar Period
)

var algorithmNames = [...]string{
	TokenBucket:   "token_bucket",
	GCRA:          "gcra",
	FixedWindow:   "fixed_window",
	SlidingWindow: "sliding_window",
	SlidingLog:    "sliding_log",
	Concurrency:   "concurrency",
	Quota:         "quota",
}

// String returns the algorithm's policy name, such as "token_bucket".
func (a Algorithm) String() string {
	if int(a) < len(algorithmNames) && algorithmNames[a] != "" {
		return algorithmNames[a]
	}
	return "unknown"
}

// ParseAlgorithm returns the algorithm with the given policy name.
func ParseAlgorithm(name string) (Algorithm, bool) {
	for a, n := range algorithmNames {
		if n != "" && n == name {
			return Algorithm(a), true
		}
	}
	return 0, false
}

// Bucket reports whether the algorithm is a bucket (rate and burst) rather
// than a window or concurrency limit.
func (a Algorithm) Bucket() bool { return a == TokenBucket || a == GCRA }

// Limit is the parameters of one limit, in fixed point. Which fields apply
// depends on Algorithm:
//
//	token_bucket, gcra:          Rate (micro-units per RatePer ns, by default
//	                             per second), Burst (micro-units)
//	fixed_window, sliding_window,
//	sliding_log:                 Limit (micro-units per Window), Window (ns)
//	concurrency:                 Limit (micro-units held at once), Window (hold expiry, ns)
//	quota:                       Limit (micro-units per Period), Period
//
// A valid Limit has positive values in the fields its algorithm uses; see
// [Limit.Validate]. Limit is comparable with ==.
type Limit struct {
	Algorithm Algorithm
	Rate      int64
	Burst     int64
	Limit     int64
	Window    int64
	// RatePer is the span, in ns, that a bucket's Rate is counted over:
	// Rate micro-units refill every RatePer ns, exactly. 0 means [Second].
	// A rate such as 1000 units a day is Rate 1e9, RatePer 86400*Second,
	// with no rounding to micro-units per second.
	RatePer int64
	// Period is a quota's calendar period; 0 is invalid for quota and
	// unused by the other algorithms.
	Period Period
}

// Period is a UTC calendar period of a quota limit. The zero value is
// invalid.
type Period uint8

// The calendar periods. Periods start at 00 minutes of the hour (Hour), at
// 00:00 UTC (Day), on Monday 00:00 UTC (Week) and on the first of the
// month 00:00 UTC (Month).
const (
	Hour  Period = 1
	Day   Period = 2
	Week  Period = 3
	Month Period = 4
)

var periodNames = [...]string{Hour: "hour", Day: "day", Week: "week", Month: "month"}

// String returns the period's policy name, such as "month".
func (p Period) String() string {
	if p.valid() {
		return periodNames[p]
	}
	return "unknown"
}

// ParsePeriod returns the period with the given policy name ("hour", "day",
// "week" or "month").
func ParsePeriod(name string) (Period, bool) {
	for p, n := range periodNames {
		if n != "" && n == name {
			return Period(p), true
		}
	}
	return 0, false
}

func (p Period) valid() bool { return p >= Hour && p <= Month }

// MaxGCRASpan is the longest time to fill a gcra limit from empty
// (Burst*RatePer/Rate ns, about 146 years) that [Limit.Validate] accepts. A gcra
// state keeps its theoretical arrival time as int64 Unix nanoseconds, so the
// span must fit beside now; token_bucket has no such bound.
const MaxGCRASpan int64 = 1 << 62

// Validate reports whether the limit can be enforced: a known algorithm and
// positive values in the fields it uses (see [Limit]; RatePer may be 0); a
// known Period for quota; for gcra, a time to fill of at most
// [MaxGCRASpan]. Errors wrap [ErrInvalidLimit].
//
// The decision functions never panic on an invalid limit: they deny with
// RetryAfter [Never] (fail closed) and return the state unchanged.
func (l Limit) Validate() error {
	switch l.Algorithm {
	case TokenBucket, GCRA:
		if l.Rate <= 0 {
			return fmt.Errorf("%w: %s rate %d must be positive", ErrInvalidLimit, l.Algorithm, l.Rate)
		}
		if l.Burst <= 0 {
			return fmt.Errorf("%w: %s burst %d must be positive", ErrInvalidLimit, l.Algorithm, l.Burst)
		}
		if l.RatePer < 0 {
			return fmt.Errorf("%w: %s rate span %d must not be negative", ErrInvalidLimit, l.Algorithm, l.RatePer)
		}
		if l.Algorithm == GCRA {
			fill := bucketFull(&l).divCeil(uint64(l.Rate))
			if from64(uint64(MaxGCRASpan)).less(fill) {
				return fmt.Errorf("%w: gcra burst/rate fills in more than %d ns; use token_bucket", ErrInvalidLimit, MaxGCRASpan)
			}
		}
	case FixedWindow, SlidingWindow, SlidingLog, Concurrency:
		if l.Limit <= 0 {
			return fmt.Errorf("%w: %s limit %d must be positive", ErrInvalidLimit, l.Algorithm, l.Limit)
		}
		if l.Window <= 0 {
			return fmt.Errorf("%w: %s window %d must be positive", ErrInvalidLimit, l.Algorithm, l.Window)
		}
	case Quota:
		if l.Limit <= 0 {
			return fmt.Errorf("%w: quota limit %d must be positive", ErrInvalidLimit, l.Limit)
		}
		if !l.Period.valid() {
			return fmt.Errorf("%w: quota period %d is not hour, day, week or month", ErrInvalidLimit, l.Period)
		}
	default:
		return fmt.Errorf("%w: unknown algorithm %d", ErrInvalidLimit, l.Algorithm)
	}
	return nil
}

// usable is the cheap part of Validate that the decision paths check.
func (l Limit) usable() bool {
	switch {
	case l.Algorithm.Bucket():
		return l.Rate > 0 && l.Burst > 0 && l.RatePer >= 0
	case l.Algorithm == Quota:
		return l.Limit > 0 && l.Period.valid()
	}
	return l.Limit > 0 && l.Window > 0
}

// Capacity is the most a single request may cost and ever be admitted:
// Burst for buckets, Limit otherwise.
func (l Limit) Capacity() int64 {
	if l.Algorithm.Bucket() {
		return l.Burst
	}
	return l.Limit
}

// State is the state of one limit for one key. It is a value: decisions
// return a new State and never modify the one they are given (the slices are
// copied on write). The zero State is "never seen": buckets start full and
// windows empty.
type State struct {
	// Algorithm is the algorithm the state belongs to; 0 means never seen.
	Algorithm Algorithm

	// token_bucket: Tokens micro-units plus Frac/RatePer of a micro-unit
	// (Frac/1e9 when RatePer is 0) were available at Last.
	// 0 <= Frac < RatePer.
	Tokens int64
	Frac   int64
	Last   int64

	// gcra: the theoretical arrival time is TAT + TATFrac/Rate ns,
	// 0 <= TATFrac < Rate. GCRA also keeps Last, the latest instant it has
	// seen, so that a clock stepping backwards never changes its credit.
	TAT     int64
	TATFrac int64

	// fixed_window, sliding_window: the current window starts at
	// WindowStart and holds Count micro-units; Prev is the previous window's
	// count (sliding_window only). quota: the current period starts at
	// WindowStart and Count micro-units have been spent in it.
	WindowStart int64
	Count       int64
	Prev        int64

	// sliding_log: admitted entries, oldest first.
	Log []LogEntry

	// concurrency: current holds.
	Holds []Hold
}

// LogEntry is one admitted request in a sliding log: its instant (ns) and
// cost (micro-units).
type LogEntry struct {
	At   int64
	Cost int64
}

// Hold is one holder of concurrency slots: Cost micro-units held by ID until
// it is released or Expires (ns), so a crashed holder's slots come back.
type Hold struct {
	ID      string
	Cost    int64
	Expires int64
}

// Decision is the outcome of deciding one request against one limit, or
// against every limit of a key.
type Decision struct {
	// Allowed is the decision. A denial spends nothing.
	Allowed bool
	// Remaining is the micro-units left after this decision (in the limit
	// with the least left, for several limits).
	Remaining int64
	// RetryAfter is 0 when allowed; when denied, the nanoseconds until this
	// cost could be admitted with no other traffic (rounded up), or Never.
	RetryAfter int64
	// ResetAfter is the nanoseconds until the limit is full again (buckets)
	// or its current window or period ends (windows, quota).
	ResetAfter int64
}

// satAdd returns a+b saturated to the int64 range.
func satAdd(a, b int64) int64 {
	s := a + b
	if (s > a) == (b > 0) {
		return s
	}
	if b > 0 {
		return math.MaxInt64
	}
	return math.MinInt64
}

// AppendUnits appends v micro-units as a decimal number of units: the
// integer part, then '.' and the fraction without trailing zeros when there
// is one ("2.5", "3", "0.000001", "-1.5"). It is [wire.AppendUnits], the
// one formatter of micro-units, named here for the packages that think in
// kvstate's units.
func AppendUnits(b []byte, v int64) []byte { return wire.AppendUnits(b, v) }
