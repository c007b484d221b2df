package cli

import (
	"fmt"
	"io"
	"math"
	"math/bits"
	"strconv"
	"strings"

	"github.com/limitmesh/limitmesh/kvstate"
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

// benchReport is the result of a run; its JSON form is the --json line.
type benchReport struct {
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
	// Shadow is set with --candidates (bench_shadow.go).
	Shadow *benchShadowReport `json:"shadow,omitempty"`
	// The ledger's lag at the end of the run (bench_usage.go); null when
	// it was not measured.
	UsageLagMs   *float64 `json:"usage_lag_ms"`
	UsagePending *uint64  `json:"usage_pending"`
	usageNote    string
	// The usage stream's bytes per decision in the decide phase and the
	// hours its limits hold at that rate (bench_usage.go); null when not
	// measured.
	UsageBytesPerDecision *float64 `json:"usage_bytes_per_decision"`
	UsageRetentionHours   *float64 `json:"usage_retention_hours"`
	usageCost             *usageStreamCost
	// This process's CPU time per reply in each phase (bench_cpu.go); in
	// the reserve modes per operation and per echo operation (two round
	// trips), with cpu_us_per_pair beside them (bench_reserve.go).
	CPUPerDecisionUs    float64 `json:"cpu_us_per_decision"`
	EchoCPUPerRequestUs float64 `json:"echo_cpu_us_per_request"`
	// This process's peak resident memory when the report was made, MB
	// (bench_mem.go); null where it cannot be read.
	RSSPeakMB *float64 `json:"rss_peak_mb"`
	// Flood is the --flood load's figures (bench_flood.go); absent
	// without one.
	Flood *floodReport `json:"flood,omitempty"`
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
	// The reserve modes' figures (bench_reserve_check.go); nil otherwise.
	*resReport
}

func (r *benchRun) report(echo, decide *phaseResult, tally []keyTally) *benchReport {
	c := r.c
	ms := func(ns int64) float64 { return math.Round(float64(ns)/1e3) / 1e3 }
	rep := &benchReport{
		Mode: c.mode, Keys: c.keys, Zipf: c.zipf, Concurrency: c.concurrency, Conns: c.conns,
		Cost: c.cost, Rate: c.rate, Burst: c.burst,
		DurationS:     math.Round(decide.elapsed.Seconds()*1e3) / 1e3,
		EchoDurationS: math.Round(echo.elapsed.Seconds()*1e3) / 1e3,
		Rounds:        c.rounds,
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

// print writes the human-readable report.
func (rep *benchReport) print(w io.Writer, c *benchConfig, plan *benchPlan) {
	keys := fmt.Sprintf("%d keys (zipf %g)", c.keys, c.zipf)
	switch {
	case c.keys == 1:
		keys = "1 hot key"
	case c.zipf == 0:
		keys = fmt.Sprintf("%d keys (uniform)", c.keys)
	}
	cost := c.cost
	if c.res.randomCost {
		cost = "random up to " + c.cost
	}
	fmt.Fprintf(w, "limitmesh bench: mode %s, %s, %d in flight over %d connections, cost %s\n",
		c.mode, keys, c.concurrency, c.conns, cost)
	// The measured operation, as the table and the ratio name it.
	op, end := "decide", "settle"
	switch c.mode {
	case "reserve":
		op = "reserve+settle"
		fmt.Fprintf(w, "policy %s: token_bucket %s, burst %s per key; reservations of ttl %v, each settled at a random part of its cost\n",
			plan.policyName, c.rate, c.burst, c.res.ttl)
	case "concurrency":
		op, end = "acquire+release", "release"
		fmt.Fprintf(w, "policy %s: concurrency %s per key; slots of ttl %v, each held up to %v\n",
			plan.policyName, c.res.slotsFor(c), c.res.ttl, c.res.hold)
	default:
		fmt.Fprintf(w, "policy %s: token_bucket %s, burst %s per key\n", plan.policyName, c.rate, c.burst)
	}
	if rep.Rounds == 1 {
		fmt.Fprintf(w, "echo %.1fs, then %s %.1fs\n\n", rep.EchoDurationS, op, rep.DurationS)
	} else {
		fmt.Fprintf(w, "echo %.1fs and %s %.1fs, interleaved in %d rounds\n\n", rep.EchoDurationS, op, rep.DurationS, rep.Rounds)
	}
	if rep.resReport != nil {
		fmt.Fprintf(w, "(an operation: a reserve and its %s, or a denied reserve; echo: the same two round trips against raw NATS)\n", end)
	}
	lw := max(14, len(op))
	fmt.Fprintf(w, "%-*s %10s %10s %9s %9s %9s %8s\n", lw, "", "requests", "per sec", "p50 ms", "p99 ms", "p999 ms", "errors")
	fmt.Fprintf(w, "%-*s %10d %10.0f %9.3f %9.3f %9.3f %8d\n", lw, "raw NATS echo",
		rep.EchoRequests, rep.EchoPerS, rep.EchoP50ms, rep.EchoP99ms, rep.EchoP999ms, rep.EchoErrors)
	fmt.Fprintf(w, "%-*s %10d %10.0f %9.3f %9.3f %9.3f %8d\n", lw, op,
		rep.Decisions, rep.DecisionsPerS, rep.P50ms, rep.P99ms, rep.P999ms, rep.Errors)
	p99 := 0.0
	if rep.EchoP99ms > 0 {
		p99 = rep.P99ms / rep.EchoP99ms
	}
	fmt.Fprintf(w, "\n%s/echo: throughput %.3f, p99 %.2fx\n", op, rep.Ratio, p99)
	fmt.Fprintf(w, "admitted %d, denied %d (errors: %d timeouts, %d unavailable, %d unmatched, %d other)\n",
		rep.Admitted, rep.Denied, rep.Timeouts, rep.Unavailable, rep.Unmatched,
		rep.Errors-rep.Timeouts-rep.Unavailable-rep.Unmatched)
	switch c.mode {
	case "reserve":
		fmt.Fprintf(w, "overshoot: %s units on %d of %d keys with admissions (allowed: burst + rate x span per key, of the settled units)\n",
			formatUnits(rep.OvershootMicro), rep.OvershootKeys, rep.KeysAdmitted)
	case "concurrency":
		fmt.Fprintf(w, "overshoot: %s units on %d of %d keys with admissions (allowed: %s units held at once per key)\n",
			formatUnits(rep.OvershootMicro), rep.OvershootKeys, rep.KeysAdmitted, c.res.slotsFor(c))
	default:
		fmt.Fprintf(w, "overshoot: %s units on %d of %d keys with admissions (allowed: burst + rate x span per key)\n",
			formatUnits(rep.OvershootMicro), rep.OvershootKeys, rep.KeysAdmitted)
	}
	rep.printUsageLag(w)
	rep.printUsageBytes(w, c)
	if rep.resReport != nil {
		rep.printReserve(w, c)
	} else {
		rep.printCPU(w, c)
	}
	rep.printMemory(w, c)
}

// formatUnits formats micro-units as a decimal number of units.
func formatUnits(micro int64) string {
	s := strconv.FormatInt(micro/kvstate.Unit, 10)
	if f := micro % kvstate.Unit; f != 0 {
		s += strings.TrimRight(fmt.Sprintf(".%06d", f), "0")
	}
	return s
}
