package cli

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"math/rand/v2"
	"os"
	"runtime/pprof"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh"
	"github.com/limitmesh/limitmesh/policies"
)

// `limitmesh bench` drives a node (or a cluster) with decide requests and
// measures it against raw NATS request-reply in the same run.
//
// The run. bench installs a policy of its own, bench-<mode>-<run>, matching
// only the dimension bench_run=<run> (a random id), keyed by
// [bench_run, key], with one token_bucket limit (--rate, --burst) in --mode,
// and waits until a node decides with it. Then two phases run over the same
// load connections, with the same concurrency and the same key sequence:
// the echo phase against a trivial responder bench starts on a connection
// of its own (queue group, reply of the size of a real decision reply, the
// request body of a real decision), and the decide phase against
// <prefix>.v1.decide. The echo phase is the baseline: what the same client
// gets from NATS alone; ratio = decisions/s / echo/s. At the end the policy
// is deleted. --mode reserve and --mode concurrency run the same way with
// reservations (a reserve and its settle, an acquire and its release) in
// place of decisions, and check for leaks at the end (bench_reserve.go).
//
// Rounds. The phases do not run one after the other but in --rounds
// alternating slices, echo first: echo, decide, echo, decide, ..., each
// phase's --echo-duration or --duration split into --rounds equal parts.
// On a shared VM the machine's speed drifts over seconds (the echo
// baseline alone varied by ±20% between runs), and two phases that sample
// the same stretch of time in alternation see the same drift, so their
// ratio is steadier than that of two phases measured back to back. A phase
// keeps its workers across its slices (their connections' reply slots, key
// pickers, histograms and counters), so its key sequence continues where
// the previous slice left it and its figures are those of one phase with
// the gaps cut out: a slice ends as a phase did (stop, then wait for the
// requests in flight), and a phase's time is the sum of its slices'.
// --rounds 1 is the two phases back to back.
//
// Load. --concurrency requests are in flight at any time, spread over
// --conns connections: each of --concurrency workers sends one request and
// waits for its reply before the next. A worker's replies come to a reply
// subject of its own under one wildcard inbox subscription per connection,
// so a request costs one publish and one delivery, with no per-request
// map entry, channel or timer. On the 2-core development machine, echo at
// 64 in flight over 4 in-process connections ran at 167k/s this way against
// 120k/s with nc.Request and 107k/s with nc.RequestWithContext from the same
// 64 goroutines (the same run order, a quiet moment; the decide phase, bound
// by the node, did not change measurably).
//
// Latency is measured from just before the publish to the delivery of the
// reply, per successful request (errors are counted, not timed), into a
// log-linear histogram with under 1% relative error; percentiles are the
// upper edge of the bucket holding the rank.
//
// Overshoot. For every key bench adds up the cost admitted and notes the
// send time of the first admitted request and the receive time of the last
// one, both as time since one base instant taken before the first slice
// on the wall clock (nodes decide on theirs; a monotonic span differs from
// a wall-clock one while the wall clock is slewed), so a key's span is
// right when it crosses slices. The node decides each of them at an
// instant of its own clock between that send and that receive, so on a
// clock that runs at the bench's rate (the same machine; across machines,
// up to the clocks' rate
// difference) the node's interval [t1, t2] lies inside the bench's, and the
// contract admitted(t1, t2) <= burst + rate*(t2-t1) (CONTRACT.md §3; the
// key is fresh, so it starts full; echo requests never reach the node)
// implies admitted <= burst + rate*span with the bench's span. The echo
// slices inside a span are idle time for the key, in which its bucket
// refills; the contract counts them like any other time, so they belong
// in the span. The check is therefore sound (a correct node never shows
// overshoot) but lenient by rate times the first request's and the last
// reply's latency. overshoot = sum over keys of max(0, admitted -
// (burst + rate*span)), in units, computed exactly in micro-units (the
// allowance rounded up by less than one micro-unit); no other slack.

// benchConfig is everything `limitmesh bench` takes from flags.
type benchConfig struct {
	cf           clientFlags
	external     bool
	duration     time.Duration
	echoDuration time.Duration
	rounds       int
	concurrency  int
	conns        int
	keys         int
	zipf         float64
	seed         uint64
	cost         string
	mode         string
	rate         string
	burst        string
	jsonOut      bool
	quiet        bool
	verbose      bool
	cpuProfile   string
	memProfile   string       // bench_mem.go
	candidates   int          // shadow candidates on the run's descriptors (bench_shadow.go)
	usage        bool         // the embedded node publishes usage records (NoUsage when false)
	roles        string       // roles of the embedded node (serve --roles)
	maxKeys      int64        // the policy's max_keys; 0: none (the default)
	flood        floodConfig  // bench_flood.go
	res          reserveFlags // --mode reserve and concurrency (bench_reserve.go)
	rls          rlsConfig    // --rls (bench_rls.go)
	// onNode is called by startBenchNode once its node runs (--rls
	// embedded: the node's bridge); the function it returns undoes it.
	onNode func(*mesh.Embedded, *mesh.Node, *slog.Logger) (func(), error)
	// Leased mode (bench_leased.go).
	holders int
	regions int
	shift   time.Duration
}

func benchFlags(s stdio) (*benchConfig, func([]string) error) {
	c := &benchConfig{}
	fs := newFlags("bench", s)
	c.cf.register(fs)
	fs.DurationVar(&c.duration, "duration", 10*time.Second, "length of the decide phase")
	fs.DurationVar(&c.echoDuration, "echo-duration", 0, "length of the raw NATS echo phase (default: --duration)")
	fs.IntVar(&c.rounds, "rounds", 5, "alternating slices each phase is split into, echo first (1: echo, then decide)")
	fs.IntVar(&c.concurrency, "concurrency", 64, "requests in flight")
	fs.IntVar(&c.conns, "conns", 4, "NATS connections the requests are spread over")
	fs.IntVar(&c.keys, "keys", 10000, "distinct limit keys (1: a single hot key)")
	fs.Float64Var(&c.zipf, "zipf", 1.1, "Zipf exponent of the key popularity (0: uniform)")
	fs.Uint64Var(&c.seed, "seed", 1, "seed of the key sequence")
	fs.StringVar(&c.cost, "cost", "1", "cost of each request (decimal)")
	fs.StringVar(&c.mode, "mode", "strict", "policy mode: strict, async, local or leased; or reserve (reserve and settle) or concurrency (acquire and release)")
	fs.IntVar(&c.holders, "holders", 6, "leased: SDK holders (gateways) in this process")
	fs.IntVar(&c.regions, "regions", 1, "leased: regions of the embedded supercluster the holders are spread over (without --nats-url)")
	fs.DurationVar(&c.shift, "shift", 2*time.Second, "leased: demand moves between the holders every D (0: every holder busy all along)")
	fs.StringVar(&c.rate, "rate", "1000/s", "token_bucket rate of each key (N/s, N/m, N/h or N/d)")
	fs.StringVar(&c.burst, "burst", "100", "token_bucket burst of each key")
	fs.BoolVar(&c.jsonOut, "json", false, "print the results as one JSON object on the last line")
	fs.IntVar(&c.candidates, "candidates", 0, "shadow candidates to put on the run's descriptors; the shadow evaluation's lag is reported")
	fs.BoolVar(&c.quiet, "quiet", false, "no progress lines on stderr")
	fs.BoolVar(&c.verbose, "v", false, "log what the embedded node does")
	fs.Int64Var(&c.maxKeys, "max-keys", 0, "max_keys of the bench policy: live keys per node beyond which new keys share one overflow key (0: the default)")
	c.flood.register(fs)
	c.res.register(fs)
	c.rls.register(fs)
	fs.StringVar(&c.cpuProfile, "cpuprofile", "", "write a CPU profile of the decide phase (this process: the embedded node too) to `file`; "+
		"pprof cannot pause, so with --rounds > 1 it also covers the echo slices between the first and the last decide slice")
	fs.StringVar(&c.memProfile, "memprofile", "", "write a heap profile (this process: the embedded node too) to `file` at the end of the decide phase")
	fs.BoolVar(&c.usage, "usage", true, "the embedded node publishes usage records and keeps the ledger (false: usage off, to compare)")
	fs.StringVar(&c.roles, "roles", "decide,ledger,shadow", "roles of the embedded node (serve --roles); decide alone measures what deciding and publishing usage cost without the ledger")
	fs.Usage = func() {
		fmt.Fprintln(s.err, "usage: limitmesh bench [--nats-url URL] [--duration 10s] [--concurrency 64] [--keys 10000] [--zipf 1.1] [--mode strict] [--json]")
		fmt.Fprintln(s.err, "       limitmesh bench --mode leased [--holders 6] [--regions 1] [--shift 2s] [...]")
		fmt.Fprintln(s.err, "       limitmesh bench --mode reserve|concurrency [--ttl 2s] [--random-cost] [--slots N] [--hold 2ms] [...]")
		fmt.Fprintln(s.err, "Without --nats-url, bench starts an embedded node in this process.")
		fs.PrintDefaults()
	}
	return c, func(args []string) error {
		if err := parseFlags(fs, args, s); err != nil {
			return err
		}
		if fs.NArg() > 0 {
			fs.Usage()
			return errUsage
		}
		// parseFlags sets flags from their variables with fs.Set, so Visit
		// sees LIMITMESH_NATS_URL too.
		set := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
		c.external = set["nats-url"]
		if c.mode == "leased" {
			// Leased mode measures utilization under demand above
			// capacity on a contiguous decide phase: one key and one
			// round unless asked otherwise.
			if !set["keys"] {
				c.keys = 1
			}
			if !set["rounds"] {
				c.rounds = 1
			}
		} else if set["holders"] || set["regions"] || set["shift"] {
			fmt.Fprintln(s.err, "limitmesh bench: --holders, --regions and --shift are for --mode leased")
			return errUsage
		}
		if !isReserveMode(c.mode) {
			for _, name := range reserveFlagNames {
				if set[name] {
					fmt.Fprintf(s.err, "limitmesh bench: --%s is for --mode reserve and concurrency\n", name)
					return errUsage
				}
			}
		}
		if c.echoDuration == 0 {
			c.echoDuration = c.duration
		}
		if err := c.validate(); err != nil {
			fmt.Fprintf(s.err, "limitmesh bench: %v\n", err)
			return errUsage
		}
		return nil
	}
}

func (c *benchConfig) validate() error {
	switch {
	case !prefixRE.MatchString(c.cf.prefix):
		return fmt.Errorf("--prefix %q: must match %s", c.cf.prefix, prefixRE)
	case c.duration <= 0 || c.echoDuration <= 0:
		return errors.New("--duration and --echo-duration must be positive")
	case c.rounds < 1 || c.rounds > 1000:
		return fmt.Errorf("--rounds %d: must be 1..1000", c.rounds)
	case min(c.duration, c.echoDuration) < time.Duration(c.rounds)*time.Millisecond:
		// A shorter slice would measure mostly its own start and stop.
		return fmt.Errorf("--duration %v and --echo-duration %v: must give each of the %d rounds at least 1ms",
			c.duration, c.echoDuration, c.rounds)
	case c.concurrency < 1 || c.concurrency > 100_000:
		return fmt.Errorf("--concurrency %d: must be 1..100000", c.concurrency)
	case c.conns < 1 || c.conns > 1024:
		return fmt.Errorf("--conns %d: must be 1..1024", c.conns)
	case c.keys < 1 || c.keys > 100_000_000:
		return fmt.Errorf("--keys %d: must be 1..100000000", c.keys)
	case c.cf.timeout <= 0:
		return errors.New("--timeout must be positive")
	case c.candidates < 0 || c.candidates > maxBenchCandidates:
		return fmt.Errorf("--candidates %d: must be 0..%d", c.candidates, maxBenchCandidates)
	case c.external && !c.usage:
		return errors.New("--usage=false configures the embedded node; a deployment at --nats-url has its own --usage")
	}
	if r, err := mesh.ParseRoles(c.roles); err != nil || r&mesh.RoleDecide == 0 {
		return fmt.Errorf("--roles %q: the embedded node's roles, decide among them (%v)", c.roles, err)
	}
	switch c.mode {
	case "strict", "async", "local", "leased":
	case "reserve", "concurrency":
		if err := c.res.validate(c); err != nil {
			return err
		}
	default:
		return fmt.Errorf("--mode %q: want strict, async, local, leased, reserve or concurrency", c.mode)
	}
	switch {
	case c.holders < 1 || c.holders > 1024:
		return fmt.Errorf("--holders %d: must be 1..1024", c.holders)
	case c.regions < 1 || c.regions > len(regionNames):
		return fmt.Errorf("--regions %d: must be 1..%d", c.regions, len(regionNames))
	case c.shift < 0:
		return fmt.Errorf("--shift %v: must not be negative", c.shift)
	}
	if _, err := policies.ParseCost(c.cost); err != nil {
		return fmt.Errorf("--cost %q: %v", c.cost, err)
	}
	if _, err := newKeyDist(1, c.zipf); err != nil {
		return fmt.Errorf("--zipf: %v", err)
	}
	if c.maxKeys < 0 {
		return fmt.Errorf("--max-keys %d: must be positive (0: the default)", c.maxKeys)
	}
	if err := c.rls.validate(c); err != nil {
		return err
	}
	return c.flood.validate()
}

// benchPlan is one run's policy and request shape.
type benchPlan struct {
	run        string // the bench_run value
	policyName string
	policyDoc  []byte
	limit      kvstate.Limit // the policy's limit, in micro-units
	cost       int64         // micro-units per request
	decideSubj string        // the measured phase's subject (reserve modes: reserve)
	echoSubj   string
	// A request body is bodyPre + key number + bodyPost.
	bodyPre, bodyPost []byte
	quotedPolicy      []byte   // `"<policyName>"`, to recognise replies
	res               *resPlan // the reserve modes (bench_reserve.go); nil otherwise
}

func newBenchPlan(c *benchConfig, run string) (*benchPlan, error) {
	p := &benchPlan{
		run:        run,
		policyName: "bench-" + c.mode + "-" + run,
		decideSubj: c.cf.prefix + ".v1.decide",
		echoSubj:   c.cf.prefix + ".bench." + run + ".echo",
	}
	var err error
	if p.cost, err = policies.ParseCost(c.cost); err != nil {
		return nil, fmt.Errorf("--cost %q: %v", c.cost, err)
	}
	rate, _ := json.Marshal(c.rate)
	limits, from := fmt.Sprintf(`[{"name":"rate","algorithm":"token_bucket","rate":%s,"burst":%s}]`, rate, burstJSON(c.burst)),
		fmt.Sprintf("--rate %q / --burst %q", c.rate, c.burst)
	mode := c.mode
	if isReserveMode(c.mode) {
		limits, from = reserveLimits(c)
		mode = "strict"
	}
	p.policyDoc = fmt.Appendf(nil, `{"match":{"bench_run":%q},"key":["bench_run","key"],`+
		`"limits":%s,"mode":%q%s,"description":"limitmesh bench run %s"}`, run, limits, mode, maxKeysJSON(c.maxKeys), run)
	pol, err := policies.Parse(p.policyName, p.policyDoc)
	if err != nil {
		return nil, fmt.Errorf("%s: %v", from, err)
	}
	p.limit = pol.Limits[0].Limit
	p.bodyPre = fmt.Appendf(nil, `{"descriptor":{"bench_run":%q,"key":"k`, run)
	p.bodyPost = fmt.Appendf(nil, `"},"cost":%s}`, strconv.Quote(c.cost))
	p.quotedPolicy = strconv.AppendQuote(nil, p.policyName)
	if isReserveMode(c.mode) {
		if err := p.planReservations(c); err != nil {
			return nil, err
		}
	}
	return p, nil
}

// burstJSON returns the burst as a JSON number when it is one, else as a
// string (which policies.Parse then rejects with a clear path).
func burstJSON(s string) string {
	if plainNumber.MatchString(s) {
		return s
	}
	b, _ := json.Marshal(s)
	return string(b)
}

// appendBody appends the decide request body for key k.
func (p *benchPlan) appendBody(dst []byte, k int) []byte {
	dst = append(dst, p.bodyPre...)
	dst = strconv.AppendInt(dst, int64(k), 10)
	return append(dst, p.bodyPost...)
}

func runBench(ctx context.Context, args []string, s stdio) error {
	c, parse := benchFlags(s)
	if err := parse(args); err != nil {
		return err
	}
	dist, err := newKeyDist(c.keys, c.zipf)
	if err != nil {
		return err
	}
	plan, err := newBenchPlan(c, fmt.Sprintf("%08x", rand.Uint32()))
	if err != nil {
		return err
	}
	progress := s.err
	if c.quiet {
		progress = nil
	}
	if c.mode == "leased" {
		return runLeasedBench(ctx, c, plan, dist, s, progress)
	}
	if c.rls.addr != "" {
		return runRLSBench(ctx, c, plan, dist, s, progress)
	}

	var (
		connect     func(name string) (*nats.Conn, error)
		cleanup     []func()
		metricsURLs []string // the reserve modes' leak check reads them
	)
	defer func() {
		for i := len(cleanup) - 1; i >= 0; i-- {
			cleanup[i]()
		}
	}()
	if c.external {
		connect = func(name string) (*nats.Conn, error) { return c.cf.dial(name) }
		metricsURLs = c.res.urls()
		logf(progress, "bench: the limitmesh deployment at %s", redactURL(c.cf.natsURL))
	} else {
		// The embedded node must accept the mode, or no decision will ever
		// use the policy: say so now rather than after a wait.
		if _, err := mesh.ParsePolicy(plan.policyName, plan.policyDoc); err != nil {
			return fmt.Errorf("the embedded node does not implement --mode %s: %v", c.mode, err)
		}
		emb, metricsURL, stop, err := startBenchNode(ctx, c, s.err)
		if err != nil {
			return err
		}
		cleanup = append(cleanup, stop)
		if metricsURL != "" {
			metricsURLs = []string{metricsURL}
		}
		connect = func(name string) (*nats.Conn, error) { return emb.Connect(nats.Name(name)) }
		logf(progress, "bench: started an embedded node (NATS + JetStream in this process)")
	}

	admin, err := connect("limitmesh-bench-admin")
	if err != nil {
		return err
	}
	cleanup = append(cleanup, admin.Close)
	js, kv, rev, undo, err := putBenchPolicy(ctx, admin, c, plan)
	if err != nil {
		return err
	}
	cleanup = append(cleanup, undo)
	sample, err := waitForBenchPolicy(ctx, admin, plan, rev, c.cf.timeout)
	if err != nil {
		if c.mode != "strict" {
			return fmt.Errorf("%v: the node does not seem to implement --mode %s (a node rejects a policy whose mode it does not implement; see its log)", err, c.mode)
		}
		return err
	}

	sh, err := startBenchShadow(ctx, js, c.cf.prefix, kv, c.candidates, plan, progress)
	if err != nil {
		return err
	}
	cleanup = append(cleanup, sh.remove)

	r := &benchRun{c: c, plan: plan, dist: dist, progress: progress}
	echoReplies := map[string][]byte{plan.echoSubj: sample}
	var rb *resBench
	if plan.res != nil {
		if rb, err = newResBench(ctx, admin, r); err != nil {
			return err
		}
		echoReplies = rb.echoReplies
	}
	// The echo responder: on a connection of its own, in a queue group,
	// answering with a payload as large as a decision reply (reserve
	// modes: a reserve's, and a settle's or release's on a second
	// subject).
	echoConn, err := connect("limitmesh-bench-echo")
	if err != nil {
		return err
	}
	cleanup = append(cleanup, echoConn.Close)
	for subject, reply := range echoReplies {
		echoSub, err := echoConn.QueueSubscribe(subject, "limitmesh-bench-echo", func(m *nats.Msg) {
			_ = m.Respond(reply)
		})
		if err != nil {
			return err
		}
		_ = echoSub.SetPendingLimits(-1, -1)
	}
	if err := echoConn.Flush(); err != nil {
		return err
	}

	load := make([]*inboxConn, c.conns)
	for i := range load {
		nc, err := connect(fmt.Sprintf("limitmesh-bench-%d", i))
		if err != nil {
			return err
		}
		cleanup = append(cleanup, nc.Close)
		perConn := (c.concurrency + c.conns - 1 - i) / c.conns
		if load[i], err = newInboxConn(nc, perConn); err != nil {
			return err
		}
	}

	if c.mode == "concurrency" {
		logf(progress, "bench: policy %s (revision %d): concurrency %s per key, mode concurrency",
			plan.policyName, rev, c.res.slotsFor(c))
	} else {
		logf(progress, "bench: policy %s (revision %d): token_bucket %s burst %s per key, mode %s",
			plan.policyName, rev, c.rate, c.burst, c.mode)
	}
	r.load = load
	tally := make([]keyTally, c.keys)
	for i := range tally {
		tally[i].first.Store(math.MaxInt64)
	}
	fl, stopFlood, err := startFlood(ctx, c, plan, kv, connect, progress)
	if err != nil {
		return err
	}
	cleanup = append(cleanup, stopFlood)
	echo := r.newPhase("echo", plan.echoSubj, nil)
	decide := r.newPhase("decide", plan.decideSubj, tally)
	if rb != nil {
		rb.attach(echo, decide, tally)
	}
	usageBefore, usageOK := markUsageStream(ctx, js, c)
	if err := r.runRounds(ctx, echo, decide); err != nil {
		return err
	}
	if err := writeHeapProfile(c.memProfile); err != nil {
		return err
	}
	rep := r.report(echo.result(), decide.result(), tally)
	rep.Shadow = sh.finish(ctx, rep.Decisions, progress)
	rep.UsageLagMs, rep.UsagePending, rep.usageNote = measureUsageLag(ctx, js, c)
	rep.measureUsageCost(ctx, js, c, usageBefore, usageOK)
	rep.CPUPerDecisionUs, rep.EchoCPUPerRequestUs = cpuPer(decide.cpu, rep.Decisions), cpuPer(echo.cpu, rep.EchoRequests)
	if rb != nil {
		rb.reserveReport(ctx, rep, echo, decide, metricsURLs, progress)
	}
	rep.Flood = fl.report()
	rep.RSSPeakMB = peakRSSMB()
	rep.print(s.out, c, plan)
	rep.Shadow.print(s.out)
	rep.Flood.print(s.out)
	if c.jsonOut {
		b, _ := json.Marshal(rep)
		fmt.Fprintln(s.out, string(b))
	}
	if rep.resReport != nil {
		return rep.reserveVerdict(c)
	}
	if c.mode == "strict" && rep.OvershootMicro > 0 {
		return fmt.Errorf("strict mode admitted %s units beyond the contract on %d keys: this is a bug",
			formatUnits(rep.OvershootMicro), rep.OvershootKeys)
	}
	return nil
}

// runRounds runs the slices of interleave in order. The CPU profile starts
// with the first decide slice and stops after the last, which is the run's
// last slice: pprof cannot pause, so the echo slices between are in it too.
func (r *benchRun) runRounds(ctx context.Context, echo, decide *phase) (err error) {
	stopProfile := func() error { return nil }
	defer func() {
		if perr := stopProfile(); err == nil {
			err = perr
		}
	}()
	r.base = time.Now()
	for _, sl := range interleave(r.c.echoDuration, r.c.duration, r.c.rounds) {
		p := echo
		if sl.decide {
			p = decide
			if sl.round == 1 {
				stop, err := startCPUProfile(r.c.cpuProfile)
				if err != nil {
					return err
				}
				stopProfile = stop
			}
		}
		if err := r.runSlice(ctx, p, sl); err != nil {
			return err
		}
	}
	return nil
}

// benchSlice is one slice of a run: which phase, which of its rounds
// (1-based), and for how long.
type benchSlice struct {
	decide bool
	round  int
	d      time.Duration
}

// interleave splits the echo and the decide phase's durations into rounds
// slices each and orders them echo, decide, echo, decide, ...
func interleave(echo, decide time.Duration, rounds int) []benchSlice {
	e, d := splitDuration(echo, rounds), splitDuration(decide, rounds)
	out := make([]benchSlice, 0, 2*rounds)
	for i := range rounds {
		out = append(out, benchSlice{round: i + 1, d: e[i]}, benchSlice{decide: true, round: i + 1, d: d[i]})
	}
	return out
}

// splitDuration splits d into n parts that differ by at most 1ns and add up
// to d exactly (the first d mod n parts take the extra nanosecond), so a
// phase's planned time does not depend on --rounds.
func splitDuration(d time.Duration, n int) []time.Duration {
	q, rem := d/time.Duration(n), int(d%time.Duration(n))
	out := make([]time.Duration, n)
	for i := range out {
		out[i] = q
		if i < rem {
			out[i]++
		}
	}
	return out
}

// startCPUProfile starts a CPU profile into path (none when path is empty);
// the returned function stops it and closes the file.
func startCPUProfile(path string) (func() error, error) {
	if path == "" {
		return func() error { return nil }, nil
	}
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("--cpuprofile: %v", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("--cpuprofile: %v", err)
	}
	return func() error {
		pprof.StopCPUProfile()
		return f.Close()
	}, nil
}

// logf prints one progress line to w unless w is nil.
func logf(w io.Writer, format string, args ...any) {
	if w != nil {
		fmt.Fprintf(w, format+"\n", args...)
	}
}
