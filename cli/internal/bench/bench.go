package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"math/rand/v2"
	"net"
	"os"
	"runtime/pprof"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/limitmesh/limitmesh/cli/internal/clitext"
	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh"
	"github.com/limitmesh/limitmesh/policies"
)

// Mode is the kind of load a run offers: decisions under a policy mode
// (Strict, Async, Local), leased grants spent by SDK holders (Leased), or
// reservations (Reserve, Concurrency).
type Mode string

// The modes of a run.
const (
	Strict      Mode = "strict"
	Async       Mode = "async"
	Local       Mode = "local"
	Leased      Mode = "leased"
	Reserve     Mode = "reserve"     // reserve and settle (reserve.go)
	Concurrency Mode = "concurrency" // acquire and release (reserve.go)
)

// Reserves reports whether m is one of the reservation modes.
func (m Mode) Reserves() bool { return m == Reserve || m == Concurrency }

// Config is one run's settings; the zero value is not valid (see
// Validate). The flag each field comes from in `limitmesh bench` is the
// name errors give it.
type Config struct {
	Prefix  string        // --prefix: the installation's subject and bucket prefix
	Timeout time.Duration // --timeout: of each request
	// Dial connects to the deployment under test (--nats-url); nil: Run
	// starts an embedded node in this process. Target names the deployment
	// in progress lines (its URL, without a password).
	Dial   func(name string) (*nats.Conn, error)
	Target string

	Duration     time.Duration // of the measured phase
	EchoDuration time.Duration // of the raw NATS echo phase
	Rounds       int           // alternating slices each phase is split into, echo first
	Concurrency  int           // requests in flight
	Conns        int           // NATS connections the requests are spread over
	Keys         int           // distinct limit keys
	Zipf         float64       // Zipf exponent of the key popularity (0: uniform)
	Seed         uint64        // of the key sequence
	Cost         string        // of each request (decimal)
	Mode         Mode
	Rate, Burst  string // token_bucket rate and burst of each key
	MaxKeys      int64  // the policy's max_keys; 0: none (the default)
	Candidates   int    // shadow candidates on the run's descriptors (shadow.go)
	Flood        FloodConfig
	Reserve      ReserveConfig // Reserve and Concurrency (reserve.go)
	RLS          RLSConfig     // RunRLS (rls.go)

	// The embedded node (without Dial).
	Usage   bool   // it publishes usage records and keeps the ledger
	Roles   string // its roles (serve --roles)
	Verbose bool   // its log at level info, not warn
	// Leased mode (leased.go).
	Holders int
	Regions int
	Shift   time.Duration

	CPUProfile string // file of a CPU profile of the measured phase ("": none)
	MemProfile string // file of a heap profile at its end (mem.go; "": none)

	// Progress receives progress lines (nil: none); Log the embedded
	// nodes' log (nil: none).
	Progress io.Writer
	Log      io.Writer

	// StartRegions starts an embedded supercluster of n regions, one
	// server and node each (Leased mode without Dial): connect dials
	// region r, stop undoes everything.
	StartRegions func(ctx context.Context, n int, prefix string, log *slog.Logger) (regions Regions, err error)
	// StartBridge serves Envoy's rate limit API on l for the embedded
	// node (RunRLS with RLS.Addr "embedded"); stop stops it.
	StartBridge func(l net.Listener, emb *mesh.Embedded, node *mesh.Node, prefix string, log *slog.Logger) (stop func(context.Context), err error)

	// onNode is called by startBenchNode once its node runs (the RLS
	// run's embedded bridge); the function it returns undoes it.
	onNode func(*mesh.Embedded, *mesh.Node, *slog.Logger) (func(), error)
}

// Regions is an embedded supercluster Config.StartRegions started.
type Regions struct {
	Names   []string
	Connect func(region int, name string) (*nats.Conn, error)
	Stop    func()
}

// external reports whether the run is against a deployment.
func (c *Config) external() bool { return c.Dial != nil }

// logWriter is where the embedded nodes log: Log, or nowhere.
func (c *Config) logWriter() io.Writer {
	if c.Log == nil {
		return io.Discard
	}
	return c.Log
}

// Validate checks the settings a run needs, naming a bad one by its flag.
// The prefix, the regions' count and the RLS address are the flag
// parser's to check.
func (c *Config) Validate() error {
	switch {
	case c.Duration <= 0 || c.EchoDuration <= 0:
		return errors.New("--duration and --echo-duration must be positive")
	case c.Rounds < 1 || c.Rounds > 1000:
		return fmt.Errorf("--rounds %d: must be 1..1000", c.Rounds)
	case min(c.Duration, c.EchoDuration) < time.Duration(c.Rounds)*time.Millisecond:
		// A shorter slice would measure mostly its own start and stop.
		return fmt.Errorf("--duration %v and --echo-duration %v: must give each of the %d rounds at least 1ms",
			c.Duration, c.EchoDuration, c.Rounds)
	case c.Concurrency < 1 || c.Concurrency > 100_000:
		return fmt.Errorf("--concurrency %d: must be 1..100000", c.Concurrency)
	case c.Conns < 1 || c.Conns > 1024:
		return fmt.Errorf("--conns %d: must be 1..1024", c.Conns)
	case c.Keys < 1 || c.Keys > 100_000_000:
		return fmt.Errorf("--keys %d: must be 1..100000000", c.Keys)
	case c.Timeout <= 0:
		return errors.New("--timeout must be positive")
	case c.Candidates < 0 || c.Candidates > maxBenchCandidates:
		return fmt.Errorf("--candidates %d: must be 0..%d", c.Candidates, maxBenchCandidates)
	case c.external() && !c.Usage:
		return errors.New("--usage=false configures the embedded node; a deployment at --nats-url has its own --usage")
	}
	if r, err := mesh.ParseRoles(c.Roles); err != nil || r&mesh.RoleDecide == 0 {
		return fmt.Errorf("--roles %q: the embedded node's roles, decide among them (%v)", c.Roles, err)
	}
	switch c.Mode {
	case Strict, Async, Local, Leased:
	case Reserve, Concurrency:
		if err := c.Reserve.validate(c); err != nil {
			return err
		}
	default:
		return fmt.Errorf("--mode %q: want strict, async, local, leased, reserve or concurrency", c.Mode)
	}
	switch {
	case c.Holders < 1 || c.Holders > 1024:
		return fmt.Errorf("--holders %d: must be 1..1024", c.Holders)
	case c.Shift < 0:
		return fmt.Errorf("--shift %v: must not be negative", c.Shift)
	}
	if _, err := policies.ParseCost(c.Cost); err != nil {
		return fmt.Errorf("--cost %q: %v", c.Cost, err)
	}
	if _, err := newKeyDist(1, c.Zipf); err != nil {
		return fmt.Errorf("--zipf: %v", err)
	}
	if c.MaxKeys < 0 {
		return fmt.Errorf("--max-keys %d: must be positive (0: the default)", c.MaxKeys)
	}
	if err := c.RLS.validate(c); err != nil {
		return err
	}
	return c.Flood.validate()
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
	res               *resPlan // the reserve modes (reserve.go); nil otherwise
}

func newBenchPlan(c *Config, run string) (*benchPlan, error) {
	p := &benchPlan{
		run:        run,
		policyName: "bench-" + string(c.Mode) + "-" + run,
		decideSubj: c.Prefix + ".v1.decide",
		echoSubj:   c.Prefix + ".bench." + run + ".echo",
	}
	var err error
	if p.cost, err = policies.ParseCost(c.Cost); err != nil {
		return nil, fmt.Errorf("--cost %q: %v", c.Cost, err)
	}
	rate, _ := json.Marshal(c.Rate)
	limits, from := fmt.Sprintf(`[{"name":"rate","algorithm":"token_bucket","rate":%s,"burst":%s}]`, rate, clitext.NumberJSON(c.Burst)),
		fmt.Sprintf("--rate %q / --burst %q", c.Rate, c.Burst)
	mode := c.Mode
	if c.Mode.Reserves() {
		limits, from = reserveLimits(c)
		mode = "strict"
	}
	p.policyDoc = fmt.Appendf(nil, `{"match":{"bench_run":%q},"key":["bench_run","key"],`+
		`"limits":%s,"mode":%q%s,"description":"limitmesh bench run %s"}`, run, limits, mode, maxKeysJSON(c.MaxKeys), run)
	pol, err := policies.Parse(p.policyName, p.policyDoc)
	if err != nil {
		return nil, fmt.Errorf("%s: %v", from, err)
	}
	p.limit = pol.Limits[0].Limit
	p.bodyPre = fmt.Appendf(nil, `{"descriptor":{"bench_run":%q,"key":"k`, run)
	p.bodyPost = fmt.Appendf(nil, `"},"cost":%s}`, strconv.Quote(c.Cost))
	p.quotedPolicy = strconv.AppendQuote(nil, p.policyName)
	if c.Mode.Reserves() {
		if err := p.planReservations(c); err != nil {
			return nil, err
		}
	}
	return p, nil
}

// appendBody appends the decide request body for key k.
func (p *benchPlan) appendBody(dst []byte, k int) []byte {
	dst = append(dst, p.bodyPre...)
	dst = strconv.AppendInt(dst, int64(k), 10)
	return append(dst, p.bodyPost...)
}

// Run runs the load cfg describes over NATS, against the deployment
// cfg.Dial reaches or an embedded node, and returns its figures. Its
// error is for a run that could not be made; what the figures show (an
// overshoot, a leak) is the caller's to judge. Run validates nothing:
// call cfg.Validate first.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	c := &cfg
	dist, plan, err := prepare(c)
	if err != nil {
		return nil, err
	}
	progress := c.Progress
	if c.Mode == Leased {
		return runLeased(ctx, c, plan, dist, progress)
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
	if c.external() {
		connect = func(name string) (*nats.Conn, error) { return c.Dial(name) }
		metricsURLs = c.Reserve.MetricsURLs
		logf(progress, "bench: the limitmesh deployment at %s", c.Target)
	} else {
		// The embedded node must accept the mode, or no decision will ever
		// use the policy: say so now rather than after a wait.
		if _, err := mesh.ParsePolicy(plan.policyName, plan.policyDoc); err != nil {
			return nil, fmt.Errorf("the embedded node does not implement --mode %s: %v", c.Mode, err)
		}
		emb, metricsURL, stop, err := startBenchNode(ctx, c)
		if err != nil {
			return nil, err
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
		return nil, err
	}
	cleanup = append(cleanup, admin.Close)
	js, kv, rev, undo, err := putBenchPolicy(ctx, admin, c, plan)
	if err != nil {
		return nil, err
	}
	cleanup = append(cleanup, undo)
	sample, err := waitForBenchPolicy(ctx, admin, plan, rev, c.Timeout)
	if err != nil {
		if c.Mode != "strict" {
			return nil, fmt.Errorf("%v: the node does not seem to implement --mode %s (a node rejects a policy whose mode it does not implement; see its log)", err, c.Mode)
		}
		return nil, err
	}

	sh, err := startBenchShadow(ctx, js, c.Prefix, kv, c.Candidates, plan, progress)
	if err != nil {
		return nil, err
	}
	cleanup = append(cleanup, sh.remove)

	r := &benchRun{c: c, plan: plan, dist: dist, progress: progress}
	echoReplies := map[string][]byte{plan.echoSubj: sample}
	var rb *resBench
	if plan.res != nil {
		if rb, err = newResBench(ctx, admin, r); err != nil {
			return nil, err
		}
		echoReplies = rb.echoReplies
	}
	// The echo responder: on a connection of its own, in a queue group,
	// answering with a payload as large as a decision reply (reserve
	// modes: a reserve's, and a settle's or release's on a second
	// subject).
	echoConn, err := connect("limitmesh-bench-echo")
	if err != nil {
		return nil, err
	}
	cleanup = append(cleanup, echoConn.Close)
	for subject, reply := range echoReplies {
		echoSub, err := echoConn.QueueSubscribe(subject, "limitmesh-bench-echo", func(m *nats.Msg) {
			_ = m.Respond(reply)
		})
		if err != nil {
			return nil, err
		}
		_ = echoSub.SetPendingLimits(-1, -1)
	}
	if err := echoConn.Flush(); err != nil {
		return nil, err
	}

	load := make([]*inboxConn, c.Conns)
	for i := range load {
		nc, err := connect(fmt.Sprintf("limitmesh-bench-%d", i))
		if err != nil {
			return nil, err
		}
		cleanup = append(cleanup, nc.Close)
		perConn := (c.Concurrency + c.Conns - 1 - i) / c.Conns
		if load[i], err = newInboxConn(nc, perConn); err != nil {
			return nil, err
		}
	}

	if c.Mode == "concurrency" {
		logf(progress, "bench: policy %s (revision %d): concurrency %s per key, mode concurrency",
			plan.policyName, rev, c.Slots())
	} else {
		logf(progress, "bench: policy %s (revision %d): token_bucket %s burst %s per key, mode %s",
			plan.policyName, rev, c.Rate, c.Burst, c.Mode)
	}
	r.load = load
	tally := make([]keyTally, c.Keys)
	for i := range tally {
		tally[i].first.Store(math.MaxInt64)
	}
	fl, stopFlood, err := startFlood(ctx, c, plan, kv, connect, progress)
	if err != nil {
		return nil, err
	}
	cleanup = append(cleanup, stopFlood)
	echo := r.newPhase("echo", plan.echoSubj, nil)
	decide := r.newPhase("decide", plan.decideSubj, tally)
	if rb != nil {
		rb.attach(echo, decide, tally)
	}
	usageBefore, usageOK := markUsageStream(ctx, js, c)
	if err := r.runRounds(ctx, echo, decide); err != nil {
		return nil, err
	}
	if err := writeHeapProfile(c.MemProfile); err != nil {
		return nil, err
	}
	rep := r.report(echo.result(), decide.result(), tally)
	rep.Shadow = sh.finish(ctx, rep.Decisions, progress)
	rep.UsageLagMs, rep.UsagePending, rep.UsageNote = measureUsageLag(ctx, js, c)
	rep.measureUsageCost(ctx, js, c, usageBefore, usageOK)
	rep.CPUPerDecisionUs, rep.EchoCPUPerRequestUs = cpuPer(decide.cpu, rep.Decisions), cpuPer(echo.cpu, rep.EchoRequests)
	if rb != nil {
		rb.reserveReport(ctx, rep, echo, decide, metricsURLs, progress)
	}
	rep.Flood = fl.report()
	rep.RSSPeakMB = peakRSSMB()
	return rep, nil
}

// prepare makes a run's key distribution and plan (a fresh run id).
func prepare(c *Config) (*keyDist, *benchPlan, error) {
	dist, err := newKeyDist(c.Keys, c.Zipf)
	if err != nil {
		return nil, nil, err
	}
	plan, err := newBenchPlan(c, fmt.Sprintf("%08x", rand.Uint32()))
	if err != nil {
		return nil, nil, err
	}
	return dist, plan, nil
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
	for _, sl := range interleave(r.c.EchoDuration, r.c.Duration, r.c.Rounds) {
		p := echo
		if sl.decide {
			p = decide
			if sl.round == 1 {
				stop, err := startCPUProfile(r.c.CPUProfile)
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
