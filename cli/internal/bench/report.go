package bench

import (
	"math"
	"math/bits"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/policies"
)

// latencyHist is a log-linear histogram of durations in ns: values below
// 256 have a bucket each; above, every power of two is split into 128
// buckets, so a bucket's width is under 1/128 (0.8%) of its values. It is
// not safe for concurrent use: each worker records into its own, and the
// phase merges them.
type latencyHist struct {
	counts [histBuckets]uint64
	n      uint64
	max    int64
}

const (
	histExact   = 256 // values 0..255 are exact
	histSub     = 128 // buckets per power of two above
	histBuckets = histExact + (63-8)*histSub
)

// histIndex is the bucket of v (negative values count as 0).
func histIndex(v int64) int {
	if v < histExact {
		return int(max(v, 0))
	}
	shift := bits.Len64(uint64(v)) - 8 // >= 1
	m := int(uint64(v) >> shift)       // 128..255
	return histExact + (shift-1)*histSub + m - histSub
}

// histUpper is the largest value in bucket i.
func histUpper(i int) int64 {
	if i < histExact {
		return int64(i)
	}
	shift := (i-histExact)/histSub + 1
	m := uint64((i-histExact)%histSub + histSub)
	return int64((m+1)<<shift - 1)
}

func (h *latencyHist) record(v int64) {
	h.counts[histIndex(v)]++
	h.n++
	h.max = max(h.max, v)
}

func (h *latencyHist) merge(o *latencyHist) {
	for i, c := range o.counts {
		h.counts[i] += c
	}
	h.n += o.n
	h.max = max(h.max, o.max)
}

// quantile returns the value at quantile q (0 < q <= 1): the upper edge of
// the bucket holding the ceil(q*n)-th smallest value, at most the largest
// value recorded; 0 when empty. It is never below the true value and
// exceeds it by under 0.8%.
func (h *latencyHist) quantile(q float64) int64 {
	if h.n == 0 {
		return 0
	}
	rank := uint64(math.Ceil(q * float64(h.n)))
	rank = min(max(rank, 1), h.n)
	var cum uint64
	for i, c := range h.counts {
		cum += c
		if cum >= rank {
			return min(histUpper(i), h.max)
		}
	}
	return h.max
}

// overshoot returns the cost admitted beyond burst + rate*span summed over
// keys (micro-units) and the number of keys with any.
func overshoot(l kvstate.Limit, tally []keyTally) (micro int64, keys int) {
	for i := range tally {
		t := &tally[i]
		a := t.admitted.Load()
		if a == 0 {
			continue
		}
		if over := a - allowance(l, t.last.Load()-t.first.Load()); over > 0 {
			micro += over
			keys++
		}
	}
	return micro, keys
}

// allowance is burst + rate*span for a token_bucket limit (micro-units,
// span in ns), the product rounded up, saturating at MaxInt64. A rate is
// l.Rate micro-units per l.RatePer ns (0: per second).
func allowance(l kvstate.Limit, span int64) int64 {
	span = max(span, 0)
	per := uint64(l.RatePer)
	if per == 0 {
		per = uint64(kvstate.Second)
	}
	hi, lo := bits.Mul64(uint64(l.Rate), uint64(span))
	if hi >= per {
		return math.MaxInt64
	}
	q, r := bits.Div64(hi, lo, per)
	if r > 0 {
		q++
	}
	if q > math.MaxInt64-uint64(l.Burst) {
		return math.MaxInt64
	}
	return l.Burst + int64(q)
}

// Report is the result of a run; its JSON form is the --json line.
type Report struct {
	Mode           string  `json:"mode"`
	Keys           int     `json:"keys"`
	Zipf           float64 `json:"zipf"`
	Concurrency    int     `json:"concurrency"`
	Conns          int     `json:"conns"`
	Cost           string  `json:"cost"`
	Rate           string  `json:"rate"`
	Burst          string  `json:"burst"`
	DurationS      float64 `json:"duration_s"`
	EchoDurationS  float64 `json:"echo_duration_s"`
	Rounds         int     `json:"rounds"`
	Decisions      int64   `json:"decisions"`
	DecisionsPerS  float64 `json:"decisions_per_sec"`
	EchoRequests   int64   `json:"echo_requests"`
	EchoPerS       float64 `json:"echo_per_sec"`
	Ratio          float64 `json:"ratio"`
	P50ms          float64 `json:"p50_ms"`
	P99ms          float64 `json:"p99_ms"`
	P999ms         float64 `json:"p999_ms"`
	EchoP50ms      float64 `json:"echo_p50_ms"`
	EchoP99ms      float64 `json:"echo_p99_ms"`
	EchoP999ms     float64 `json:"echo_p999_ms"`
	Admitted       int64   `json:"admitted"`
	Denied         int64   `json:"denied"`
	Errors         int64   `json:"errors"`
	Timeouts       int64   `json:"timeouts"`
	Unavailable    int64   `json:"unavailable"`
	Unmatched      int64   `json:"unmatched"`
	EchoErrors     int64   `json:"echo_errors"`
	KeysAdmitted   int     `json:"keys_admitted"`
	Overshoot      float64 `json:"overshoot"`
	OvershootKeys  int     `json:"overshoot_keys"`
	OvershootMicro int64   `json:"-"`
	// Policy is the run's policy (bench-<mode>-<run>).
	Policy string `json:"-"`
	// Shadow is set with --candidates (shadow.go).
	Shadow *ShadowReport `json:"shadow,omitempty"`
	// The ledger's lag at the end of the run (usage.go); null when
	// it was not measured.
	UsageLagMs   *float64 `json:"usage_lag_ms"`
	UsagePending *uint64  `json:"usage_pending"`
	UsageNote    string   `json:"-"` // why UsageLagMs is null, if it is
	// The usage stream's bytes per decision in the decide phase and the
	// hours its limits hold at that rate (usage.go); null when not
	// measured.
	UsageBytesPerDecision *float64         `json:"usage_bytes_per_decision"`
	UsageRetentionHours   *float64         `json:"usage_retention_hours"`
	UsageCost             *UsageStreamCost `json:"-"`
	// This process's CPU time per reply in each phase (cpu.go); in
	// the reserve modes per operation and per echo operation (two round
	// trips), with cpu_us_per_pair beside them (reserve.go).
	CPUPerDecisionUs    float64 `json:"cpu_us_per_decision"`
	EchoCPUPerRequestUs float64 `json:"echo_cpu_us_per_request"`
	// This process's peak resident memory when the report was made, MB
	// (mem.go); null where it cannot be read.
	RSSPeakMB *float64 `json:"rss_peak_mb"`
	// Flood is the --flood load's figures (flood.go); absent
	// without one.
	Flood *FloodReport `json:"flood,omitempty"`
	// Leased mode (CONTRACT §8): the summed overshoot bound of the keys
	// with admissions (max_outstanding each), admitted / the contract's
	// capacity over the run (burst + rate × span of those keys), and the
	// fraction of decisions the holders made locally; the holders,
	// regions and shift of the run.
	Bound         *float64 `json:"bound,omitempty"`
	Utilization   *float64 `json:"utilization,omitempty"`
	LocalFraction *float64 `json:"local_fraction,omitempty"`
	Holders       int      `json:"holders,omitempty"`
	Regions       int      `json:"regions,omitempty"`
	ShiftS        float64  `json:"shift_s,omitempty"`
	// Lease is the leased policy's grant parameters, and KeysOverBound the
	// keys whose overshoot exceeds max_outstanding (a bug).
	Lease         policies.Lease `json:"-"`
	KeysOverBound int            `json:"-"`
	// The reserve modes' figures (reserve_check.go); nil otherwise.
	*ResReport
}

func (r *benchRun) report(echo, decide *phaseResult, tally []keyTally) *Report {
	c := r.c
	ms := func(ns int64) float64 { return math.Round(float64(ns)/1e3) / 1e3 }
	rep := &Report{
		Policy: r.plan.policyName,
		Mode:   string(c.Mode), Keys: c.Keys, Zipf: c.Zipf, Concurrency: c.Concurrency, Conns: c.Conns,
		Cost: c.Cost, Rate: c.Rate, Burst: c.Burst,
		DurationS:     math.Round(decide.elapsed.Seconds()*1e3) / 1e3,
		EchoDurationS: math.Round(echo.elapsed.Seconds()*1e3) / 1e3,
		Rounds:        c.Rounds,
		Decisions:     decide.replies,
		DecisionsPerS: math.Round(decide.perSec()),
		EchoRequests:  echo.replies,
		EchoPerS:      math.Round(echo.perSec()),
		P50ms:         ms(decide.hist.quantile(0.5)),
		P99ms:         ms(decide.hist.quantile(0.99)),
		P999ms:        ms(decide.hist.quantile(0.999)),
		EchoP50ms:     ms(echo.hist.quantile(0.5)),
		EchoP99ms:     ms(echo.hist.quantile(0.99)),
		EchoP999ms:    ms(echo.hist.quantile(0.999)),
		Admitted:      decide.admitted,
		Denied:        decide.denied,
		Errors:        decide.errors,
		Timeouts:      decide.timeouts,
		Unavailable:   decide.unavail,
		Unmatched:     decide.unmatch,
		EchoErrors:    echo.errors,
	}
	if echo.perSec() > 0 {
		rep.Ratio = math.Round(decide.perSec()/echo.perSec()*1e4) / 1e4
	}
	for i := range tally {
		if tally[i].admitted.Load() > 0 {
			rep.KeysAdmitted++
		}
	}
	rep.OvershootMicro, rep.OvershootKeys = overshoot(r.plan.limit, tally)
	rep.Overshoot = float64(rep.OvershootMicro) / float64(kvstate.Unit)
	return rep
}

// units formats micro-units as a decimal number of units.
func units(micro int64) string { return string(kvstate.AppendUnits(nil, micro)) }
