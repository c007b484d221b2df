package cli

import (
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/limitmesh/limitmesh/cli/internal/bench"
	"github.com/limitmesh/limitmesh/kvstate"
)

// The output of `limitmesh bench`: the human-readable report of a run,
// and the verdict its figures give (the exit code). The --json line is the
// report itself (bench.Report, bench.RLSReport).

// printReport writes the human-readable report of a run over NATS.
func printReport(w io.Writer, c *bench.Config, rep *bench.Report, external bool) {
	keys := fmt.Sprintf("%d keys (zipf %g)", c.Keys, c.Zipf)
	switch {
	case c.Keys == 1:
		keys = "1 hot key"
	case c.Zipf == 0:
		keys = fmt.Sprintf("%d keys (uniform)", c.Keys)
	}
	cost := c.Cost
	if c.Reserve.RandomCost {
		cost = "random up to " + c.Cost
	}
	fmt.Fprintf(w, "limitmesh bench: mode %s, %s, %d in flight over %d connections, cost %s\n",
		c.Mode, keys, c.Concurrency, c.Conns, cost)
	// The measured operation, as the table and the ratio name it.
	op, end := "decide", "settle"
	switch c.Mode {
	case bench.Reserve:
		op = "reserve+settle"
		fmt.Fprintf(w, "policy %s: token_bucket %s, burst %s per key; reservations of ttl %v, each settled at a random part of its cost\n",
			rep.Policy, c.Rate, c.Burst, c.Reserve.TTL)
	case bench.Concurrency:
		op, end = "acquire+release", "release"
		fmt.Fprintf(w, "policy %s: concurrency %s per key; slots of ttl %v, each held up to %v\n",
			rep.Policy, c.Slots(), c.Reserve.TTL, c.Reserve.Hold)
	default:
		fmt.Fprintf(w, "policy %s: token_bucket %s, burst %s per key\n", rep.Policy, c.Rate, c.Burst)
	}
	if rep.Rounds == 1 {
		fmt.Fprintf(w, "echo %.1fs, then %s %.1fs\n\n", rep.EchoDurationS, op, rep.DurationS)
	} else {
		fmt.Fprintf(w, "echo %.1fs and %s %.1fs, interleaved in %d rounds\n\n", rep.EchoDurationS, op, rep.DurationS, rep.Rounds)
	}
	if rep.ResReport != nil {
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
	switch c.Mode {
	case bench.Reserve:
		fmt.Fprintf(w, "overshoot: %s units on %d of %d keys with admissions (allowed: burst + rate x span per key, of the settled units)\n",
			formatUnits(rep.OvershootMicro), rep.OvershootKeys, rep.KeysAdmitted)
	case bench.Concurrency:
		fmt.Fprintf(w, "overshoot: %s units on %d of %d keys with admissions (allowed: %s units held at once per key)\n",
			formatUnits(rep.OvershootMicro), rep.OvershootKeys, rep.KeysAdmitted, c.Slots())
	default:
		fmt.Fprintf(w, "overshoot: %s units on %d of %d keys with admissions (allowed: burst + rate x span per key)\n",
			formatUnits(rep.OvershootMicro), rep.OvershootKeys, rep.KeysAdmitted)
	}
	printUsageLag(w, rep)
	printUsageBytes(w, rep)
	if rep.ResReport != nil {
		printReserve(w, c, rep, external)
	} else {
		printCPU(w, rep, external)
	}
	printMemory(w, rep, external)
	if c.Mode == bench.Leased {
		fmt.Fprintf(w, "leased: %d holders, %d region(s), shift %v: utilization %.4f, local fraction %.4f, bound %s units (max_outstanding %s × %d keys)\n",
			c.Holders, rep.Regions, c.Shift, *rep.Utilization, *rep.LocalFraction, formatUnits(int64(*rep.Bound*float64(kvstate.Unit))),
			formatUnits(rep.Lease.MaxOutstanding), rep.KeysAdmitted)
	}
	printShadow(w, rep.Shadow)
	printFlood(w, rep.Flood)
}

// formatUnits formats micro-units as a decimal number of units.
func formatUnits(micro int64) string { return string(kvstate.AppendUnits(nil, micro)) }

// printCPU writes the report's CPU line.
func printCPU(w io.Writer, rep *bench.Report, external bool) {
	if rep.CPUPerDecisionUs == 0 && rep.EchoCPUPerRequestUs == 0 {
		return // not measured (leased mode)
	}
	who := "bench's load and the embedded node with its NATS server"
	if external {
		who = "bench's load only"
	}
	fmt.Fprintf(w, "cpu: %.2f µs per decision, %.2f µs per echo (this process: %s)\n",
		rep.CPUPerDecisionUs, rep.EchoCPUPerRequestUs, who)
}

// printMemory writes the report's memory line.
func printMemory(w io.Writer, rep *bench.Report, external bool) {
	if rep.RSSPeakMB == nil {
		return
	}
	who := "bench's load and the embedded node with its NATS server"
	if external {
		who = "bench's load only"
	}
	fmt.Fprintf(w, "memory: peak resident %.1f MB (this process: %s)\n", *rep.RSSPeakMB, who)
}

// printUsageLag writes the report's usage lag line.
func printUsageLag(w io.Writer, rep *bench.Report) {
	if rep.UsageLagMs == nil {
		if rep.UsageNote == "" {
			return // not measured (leased mode)
		}
		fmt.Fprintf(w, "usage lag: %s\n", rep.UsageNote)
		return
	}
	fmt.Fprintf(w, "usage lag: %.3f s (%d usage batches not yet in the ledger at the end of the run)\n",
		*rep.UsageLagMs/1e3, *rep.UsagePending)
}

// printUsageBytes writes the report's usage stream line.
func printUsageBytes(w io.Writer, rep *bench.Report) {
	u := rep.UsageCost
	if u == nil {
		return
	}
	if u.BytesPerDecision == nil {
		if u.Note != "" {
			fmt.Fprintf(w, "usage stream: %s\n", u.Note)
		}
		return
	}
	est := ""
	if u.Estimated {
		est = " (estimated: the stream was full and discarded its oldest messages)"
	}
	fmt.Fprintf(w, "usage stream: %.1f bytes per decision%s\n", *u.BytesPerDecision, est)
	limits := fmt.Sprintf("max bytes %s, max age %s", formatBytes(u.MaxBytes), formatAge(u.MaxAge))
	if u.RetentionHours == nil {
		fmt.Fprintf(w, "usage retention: unbounded (%s)\n", limits)
		return
	}
	fmt.Fprintf(w, "usage retention: %.3f h at %.0f decisions/s (%.1f MB/s; %s)\n",
		*u.RetentionHours, rep.DecisionsPerS, *u.BytesPerDecision*rep.DecisionsPerS/1e6, limits)
}

// formatBytes formats a stream's byte limit (<= 0: none).
func formatBytes(n int64) string {
	switch {
	case n <= 0:
		return "none"
	case n%(1<<30) == 0:
		return fmt.Sprintf("%d GiB", n>>30)
	case n%(1<<20) == 0:
		return fmt.Sprintf("%d MiB", n>>20)
	}
	return fmt.Sprintf("%d bytes", n)
}

// formatAge formats a stream's age limit (0: none).
func formatAge(d time.Duration) string {
	if d <= 0 {
		return "none"
	}
	return d.String()
}

// verdict is the run's error when its figures show a bug: overshoot
// beyond the contract (strict mode; leased mode: beyond max_outstanding),
// or, in the reserve modes, units missing from keys or reservations left
// open.
func verdict(c *bench.Config, rep *bench.Report) error {
	switch {
	case rep.ResReport != nil:
		return reserveVerdict(c, rep)
	case rep.KeysOverBound > 0:
		return fmt.Errorf("leased mode admitted more than the contract plus max_outstanding on %d keys: this is a bug", rep.KeysOverBound)
	case c.Mode == bench.Strict && rep.OvershootMicro > 0:
		return fmt.Errorf("strict mode admitted %s units beyond the contract on %d keys: this is a bug",
			formatUnits(rep.OvershootMicro), rep.OvershootKeys)
	}
	return nil
}

// rlsVerdict is verdict for an RLS run.
func rlsVerdict(c *bench.Config, rep *bench.RLSReport) error {
	if c.Mode == bench.Strict && rep.OvershootMicro > 0 {
		return fmt.Errorf("strict mode admitted %s units beyond the contract on %d keys: this is a bug",
			formatUnits(rep.OvershootMicro), rep.OvershootKeys)
	}
	return nil
}

// reserveVerdict is the run's error when the reservations misbehaved:
// overshoot, units missing from keys, or reservations left open.
func reserveVerdict(c *bench.Config, rep *bench.Report) error {
	rr := rep.ResReport
	switch {
	case rep.OvershootMicro > 0 && c.Mode == bench.Concurrency:
		return fmt.Errorf("concurrency mode: clients held %s units beyond --slots on %d keys: this is a bug", formatUnits(rep.OvershootMicro), rep.OvershootKeys)
	case rep.OvershootMicro > 0:
		return fmt.Errorf("reserve mode: %s settled units beyond the contract on %d keys: this is a bug", formatUnits(rep.OvershootMicro), rep.OvershootKeys)
	}
	var leaks []string
	if rr.LeakedKeys > 0 {
		leaks = append(leaks, fmt.Sprintf("%d keys not back to full (%s units missing)", rr.LeakedKeys, formatUnits(rr.LeakedMicro)))
	}
	if rr.OpenReservations != nil && *rr.OpenReservations > 0 {
		leaks = append(leaks, fmt.Sprintf("%g reservations still open", *rr.OpenReservations))
	}
	if len(leaks) > 0 {
		return fmt.Errorf("%s %.3fs after the run (--ttl %v, --leak-wait %v)", strings.Join(leaks, " and "), rr.LeakWaitS, c.Reserve.TTL, rr.LeakWait)
	}
	if rr.MetricsErr != nil {
		return fmt.Errorf("open reservations not measured: %v", rr.MetricsErr)
	}
	return nil
}

// printReserve writes the reserve modes' lines of the report.
func printReserve(w io.Writer, c *bench.Config, rep *bench.Report, external bool) {
	rr := rep.ResReport
	if rr.Abandoned > 0 || rr.ExpiredBeforeEnd > 0 || rr.EndUnknown > 0 {
		fmt.Fprintf(w, "reservations: %d abandoned, %d expired before their end, %d ends without a known outcome\n",
			rr.Abandoned, rr.ExpiredBeforeEnd, rr.EndUnknown)
	}
	open := "not measured (--metrics-url)"
	switch {
	case rr.MetricsErr != nil:
		open = "not measured: " + rr.MetricsErr.Error()
	case rr.OpenReservations != nil:
		open = fmt.Sprintf("%g", *rr.OpenReservations)
	}
	fmt.Fprintf(w, "leaks: %d of %d keys not full (%s units missing), open reservations %s, after %.3fs\n",
		rr.LeakedKeys, rr.KeysChecked, formatUnits(rr.LeakedMicro), open, rr.LeakWaitS)
	if rr.ReservationsEnded != nil {
		fmt.Fprintf(w, "node: reservations settled %g, released %g, expired %g\n",
			rr.ReservationsEnded["settled"], rr.ReservationsEnded["released"], rr.ReservationsEnded["expired"])
	}
	who := "bench's load and the embedded node with its NATS server"
	if external {
		who = "bench's load only"
	}
	pair := "reserve+settle"
	if c.Mode == bench.Concurrency {
		pair = "acquire+release"
	}
	fmt.Fprintf(w, "cpu: %.2f µs per %s pair (%.2f per request), %.2f per operation, %.2f per echo operation (this process: %s)\n",
		rr.CPUPerPairUs, pair, rr.CPUPerRequestUs, rep.CPUPerDecisionUs, rep.EchoCPUPerRequestUs, who)
}

// printRLSReport writes the human-readable report of an RLS run.
func printRLSReport(w io.Writer, rep *bench.RLSReport, external bool) {
	fmt.Fprintf(w, "limitmesh bench --rls %s: %d keys (zipf %g), %d in flight over %d connections, hits_addend %s\n",
		rep.Target, rep.Keys, rep.Zipf, rep.Concurrency, rep.Conns, rep.Cost)
	fmt.Fprintf(w, "%-22s %10s %10s %9s %9s %10s %10s %8s\n", "", "decisions", "per sec", "p50 ms", "p99 ms", "admitted", "denied", "errors")
	if rep.NATSPerS != nil {
		fmt.Fprintf(w, "%-22s %10s %10.0f %9.3f %9.3f %10d %10d %8d\n", "decide over NATS", "",
			*rep.NATSPerS, *rep.NATSP50ms, *rep.NATSP99ms, *rep.NATSAdmitted, *rep.NATSDenied, *rep.NATSErrors)
	}
	fmt.Fprintf(w, "%-22s %10d %10.0f %9.3f %9.3f %10d %10d %8d\n", "ShouldRateLimit (gRPC)", rep.Decisions,
		rep.DecisionsPerS, rep.P50ms, rep.P99ms, rep.Admitted, rep.Denied, rep.Errors)
	if rep.Ratio != nil {
		fmt.Fprintf(w, "ratio rls/nats: %.3f\n", *rep.Ratio)
	}
	who := "bench's load and the embedded node with its NATS server"
	if external {
		who = "bench's load only"
	}
	if rep.NATSCPUPerDec != nil {
		fmt.Fprintf(w, "cpu: %.2f µs per rls decision, %.2f µs per nats decision (this process: %s)\n", rep.CPUPerDecUs, *rep.NATSCPUPerDec, who)
	}
	if rep.Timeouts+rep.Unavailable+rep.Unmatched > 0 {
		fmt.Fprintf(w, "rls errors: %d timeouts, %d unavailable, %d without a limit\n", rep.Timeouts, rep.Unavailable, rep.Unmatched)
	}
	fmt.Fprintf(w, "overshoot: %s units on %d keys\n", formatUnits(rep.OvershootMicro), rep.OvershootKeys)
}

// printShadow writes the shadow lines of the human-readable report.
func printShadow(w io.Writer, r *bench.ShadowReport) {
	if r == nil {
		return
	}
	catchUp := "not within a minute"
	if r.CatchUpS >= 0 {
		catchUp = strconv.FormatFloat(r.CatchUpS, 'f', 3, 64) + "s after the run"
	}
	fmt.Fprintf(w, "shadow: %d candidates; evaluation lag (summary write - newest record evaluated) p50 %.3fs, max %.3fs over %d writes; "+
		"every decision evaluated %s (%d records)\n", r.Candidates, r.LagP50S, r.LagMaxS, r.LagSamples, catchUp, r.Evaluated)
}

// printFlood writes the flood's line of the human-readable report.
func printFlood(w io.Writer, r *bench.FloodReport) {
	if r == nil {
		return
	}
	fmt.Fprintf(w, "flood: %g x %s offered %.0f/s: sent %d, %.0f replies/s, admitted %d, denied %d, errors %d, skipped %d, unanswered %d\n",
		r.Factor, r.Rate, r.OfferedPS, r.Sent, r.RepliesPS, r.Admitted, r.Denied, r.Errors, r.Skipped, r.Unanswered)
}
