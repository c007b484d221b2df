package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"math/bits"
	"math/rand/v2"
	"os"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

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
// is deleted.
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
	candidates   int         // shadow candidates on the run's descriptors (bench_shadow.go)
	usage        bool        // the embedded node publishes usage records (NoUsage when false)
	maxKeys      int64       // the policy's max_keys; 0: none (the default)
	flood        floodConfig // bench_flood.go
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
	fs.StringVar(&c.mode, "mode", "strict", "policy mode: strict, async, local or leased")
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
	fs.StringVar(&c.cpuProfile, "cpuprofile", "", "write a CPU profile of the decide phase (this process: the embedded node too) to `file`; "+
		"pprof cannot pause, so with --rounds > 1 it also covers the echo slices between the first and the last decide slice")
	fs.BoolVar(&c.usage, "usage", true, "the embedded node publishes usage records and keeps the ledger (false: usage off, to compare)")
	fs.Usage = func() {
		fmt.Fprintln(s.err, "usage: limitmesh bench [--nats-url URL] [--duration 10s] [--concurrency 64] [--keys 10000] [--zipf 1.1] [--mode strict] [--json]")
		fmt.Fprintln(s.err, "       limitmesh bench --mode leased [--holders 6] [--regions 1] [--shift 2s] [...]")
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
	switch c.mode {
	case "strict", "async", "local", "leased":
	default:
		return fmt.Errorf("--mode %q: want strict, async, local or leased", c.mode)
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
	return c.flood.validate()
}

// benchPlan is one run's policy and request shape.
type benchPlan struct {
	run        string // the bench_run value
	policyName string
	policyDoc  []byte
	limit      kvstate.Limit // the policy's limit, in micro-units
	cost       int64         // micro-units per request
	decideSubj string
	echoSubj   string
	// A request body is bodyPre + key number + bodyPost.
	bodyPre, bodyPost []byte
	quotedPolicy      []byte // `"<policyName>"`, to recognise replies
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
	p.policyDoc = fmt.Appendf(nil, `{"match":{"bench_run":%q},"key":["bench_run","key"],`+
		`"limits":[{"name":"rate","algorithm":"token_bucket","rate":%s,"burst":%s}],`+
		`"mode":%q%s,"description":"limitmesh bench run %s"}`, run, rate, burstJSON(c.burst), c.mode, maxKeysJSON(c.maxKeys), run)
	pol, err := policies.Parse(p.policyName, p.policyDoc)
	if err != nil {
		return nil, fmt.Errorf("--rate %q / --burst %q: %v", c.rate, c.burst, err)
	}
	p.limit = pol.Limits[0].Limit
	p.bodyPre = fmt.Appendf(nil, `{"descriptor":{"bench_run":%q,"key":"k`, run)
	p.bodyPost = fmt.Appendf(nil, `"},"cost":%s}`, strconv.Quote(c.cost))
	p.quotedPolicy = strconv.AppendQuote(nil, p.policyName)
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

	var (
		connect func(name string) (*nats.Conn, error)
		cleanup []func()
	)
	defer func() {
		for i := len(cleanup) - 1; i >= 0; i-- {
			cleanup[i]()
		}
	}()
	if c.external {
		connect = func(name string) (*nats.Conn, error) { return c.cf.dial(name) }
		logf(progress, "bench: the limitmesh deployment at %s", redactURL(c.cf.natsURL))
	} else {
		// The embedded node must accept the mode, or no decision will ever
		// use the policy: say so now rather than after a wait.
		if _, err := mesh.ParsePolicy(plan.policyName, plan.policyDoc); err != nil {
			return fmt.Errorf("the embedded node does not implement --mode %s: %v", c.mode, err)
		}
		emb, stop, err := startBenchNode(ctx, c, s.err)
		if err != nil {
			return err
		}
		cleanup = append(cleanup, stop)
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

	// The echo responder: on a connection of its own, in a queue group,
	// answering with a payload as large as a decision reply.
	echoConn, err := connect("limitmesh-bench-echo")
	if err != nil {
		return err
	}
	cleanup = append(cleanup, echoConn.Close)
	echoSub, err := echoConn.QueueSubscribe(plan.echoSubj, "limitmesh-bench-echo", func(m *nats.Msg) {
		_ = m.Respond(sample)
	})
	if err != nil {
		return err
	}
	_ = echoSub.SetPendingLimits(-1, -1)
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

	logf(progress, "bench: policy %s (revision %d): token_bucket %s burst %s per key, mode %s",
		plan.policyName, rev, c.rate, c.burst, c.mode)
	r := &benchRun{c: c, plan: plan, dist: dist, load: load, progress: progress}
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
	if err := r.runRounds(ctx, echo, decide); err != nil {
		return err
	}
	rep := r.report(echo.result(), decide.result(), tally)
	rep.Shadow = sh.finish(ctx, rep.Decisions, progress)
	rep.UsageLagMs, rep.UsagePending, rep.usageNote = measureUsageLag(ctx, js, c)
	rep.CPUPerDecisionUs, rep.EchoCPUPerRequestUs = cpuPer(decide.cpu, rep.Decisions), cpuPer(echo.cpu, rep.EchoRequests)
	rep.Flood = fl.report()
	rep.print(s.out, c, plan)
	rep.Shadow.print(s.out)
	rep.Flood.print(s.out)
	if c.jsonOut {
		b, _ := json.Marshal(rep)
		fmt.Fprintln(s.out, string(b))
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

// startBenchNode starts an embedded NATS server and a node on it; stop
// undoes both.
func startBenchNode(ctx context.Context, c *benchConfig, logw io.Writer) (*mesh.Embedded, func(), error) {
	var undo []func()
	stop := func() {
		for i := len(undo) - 1; i >= 0; i-- {
			undo[i]()
		}
	}
	dir, err := os.MkdirTemp("", "limitmesh-bench-")
	if err != nil {
		return nil, nil, err
	}
	undo = append(undo, func() { os.RemoveAll(dir) })
	level := new(slog.LevelVar)
	level.Set(slog.LevelWarn)
	if c.verbose {
		level.Set(slog.LevelInfo)
	}
	log := slog.New(slog.NewTextHandler(logw, &slog.HandlerOptions{Level: level}))
	emb, err := mesh.StartEmbedded(mesh.EmbeddedConfig{DataDir: dir, ServerName: "limitmesh-bench", Logger: log})
	if err != nil {
		stop()
		return nil, nil, fmt.Errorf("embedded NATS: %v", err)
	}
	undo = append(undo, emb.Shutdown)
	nodeConn, err := emb.Connect(nats.Name("limitmesh-node"))
	if err != nil {
		stop()
		return nil, nil, err
	}
	undo = append(undo, nodeConn.Close)
	node, err := mesh.NewNode(nodeConn, mesh.NodeConfig{Prefix: c.cf.prefix, Logger: log, NoUsage: !c.usage})
	if err != nil {
		stop()
		return nil, nil, err
	}
	startCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	err = node.Start(startCtx)
	cancel()
	if err != nil {
		stop()
		return nil, nil, fmt.Errorf("start node: %v", err)
	}
	undo = append(undo, func() {
		if !c.verbose {
			// The node and its data are thrown away: what its stop cannot
			// finish in time (checkpoints after a run over many keys, a
			// watch ended by the shutdown) is no warning to the user.
			level.Set(slog.LevelError)
		}
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = node.Stop(sctx)
	})
	return emb, stop, nil
}

// waitForBenchPolicy polls with dry runs until the node decides with the
// plan's policy at revision rev or later, and returns that reply (its size
// is the echo payload's).
func waitForBenchPolicy(ctx context.Context, nc *nats.Conn, plan *benchPlan, rev uint64, timeout time.Duration) ([]byte, error) {
	body := fmt.Appendf(nil, `{"descriptor":{"bench_run":%q,"key":"k0"},"dry_run":true}`, plan.run)
	deadline := time.Now().Add(5 * time.Second)
	for {
		msg, err := nc.Request(plan.decideSubj, body, timeout)
		switch {
		case errors.Is(err, nats.ErrNoResponders):
			return nil, fmt.Errorf("no limitmesh node answers on %s", plan.decideSubj)
		case err == nil:
			var r decideReply
			if json.Unmarshal(msg.Data, &r) == nil && r.Policy == plan.policyName && r.Revision >= rev {
				return bytes.Clone(msg.Data), nil
			}
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("no node applied policy %s within 5s", plan.policyName)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// logf prints one progress line to w unless w is nil.
func logf(w io.Writer, format string, args ...any) {
	if w != nil {
		fmt.Fprintf(w, format+"\n", args...)
	}
}

// benchRun is one run's shared parts.
type benchRun struct {
	c        *benchConfig
	plan     *benchPlan
	dist     *keyDist
	load     []*inboxConn
	progress io.Writer
	// base is the instant the tallies' times count from: one for the whole
	// run, taken before the first slice, so that a key's span may cross
	// slices.
	base time.Time
}

// keyTally is what bench saw of one key in the decide phase, over all its
// slices: admitted cost (micro-units), the send time of the first admitted
// request and the receive time of the last (ns since benchRun.base,
// bench's monotonic clock). Workers update it with atomics.
type keyTally struct {
	admitted atomic.Int64
	first    atomic.Int64 // math.MaxInt64 until the first admission
	last     atomic.Int64
}

func (k *keyTally) add(cost, sent, received int64) {
	k.admitted.Add(cost)
	for {
		f := k.first.Load()
		if sent >= f || k.first.CompareAndSwap(f, sent) {
			break
		}
	}
	for {
		l := k.last.Load()
		if received <= l || k.last.CompareAndSwap(l, received) {
			break
		}
	}
}

// worker is one request in flight: it sends, waits for the reply and sends
// the next. Only done and errs are read while it runs; a phase's slices run
// it one after the other (each on a goroutine of its own, started after the
// previous one ended), so the other fields need no synchronisation.
type worker struct {
	done, errs atomic.Int64 // replies, errors so far

	slot *inboxSlot
	pick *keyPicker
	body []byte
	hist *latencyHist

	admitted, denied int64
	timeouts         int64 // no reply within --timeout
	unavailable      int64 // 503 replies
	failed           int64 // other error replies and send errors
	unmatched        int64 // decisions not made with the bench policy
}

// phaseResult is one phase's merged figures.
type phaseResult struct {
	elapsed  time.Duration // the phase's slices' time, summed
	replies  int64         // successful replies (decisions: admitted + denied)
	hist     latencyHist
	admitted int64
	denied   int64
	errors   int64
	timeouts int64
	unavail  int64
	failed   int64
	unmatch  int64
}

func (p *phaseResult) perSec() float64 {
	if p.elapsed <= 0 {
		return 0
	}
	return float64(p.replies) / p.elapsed.Seconds()
}

// phase is the echo or the decide phase. Its workers outlive its slices:
// each keeps its reply slot, key picker, histogram and counters, so the
// slices together measure what one phase would, without the gaps.
type phase struct {
	name    string
	subject string
	tally   []keyTally // nil: the echo phase (replies are not parsed)
	workers []*worker
	elapsed time.Duration // summed over the slices run so far
	cpu     time.Duration // CPU time of this process during the slices (bench_cpu.go)
}

// newPhase makes --concurrency workers against subject, spread over the
// load connections; worker i draws keys from stream i of --seed in either
// phase, so both phases send the same key sequence. With tally nil it is
// the echo phase; otherwise every reply is a decision, counted and, when
// admitted, added to its key's tally.
func (r *benchRun) newPhase(name, subject string, tally []keyTally) *phase {
	c := r.c
	p := &phase{name: name, subject: subject, tally: tally, workers: make([]*worker, c.concurrency)}
	next := make([]int, len(r.load))
	for i := range p.workers {
		conn := i % len(r.load)
		p.workers[i] = &worker{
			slot: r.load[conn].slots[next[conn]],
			pick: r.dist.picker(c.seed, uint64(i)),
			hist: new(latencyHist),
		}
		next[conn]++
	}
	return p
}

// sum is the phase's replies and errors so far (safe while workers run).
func (p *phase) sum() (done, errs int64) {
	for _, w := range p.workers {
		done += w.done.Load()
		errs += w.errs.Load()
	}
	return done, errs
}

// runSlice runs the phase's workers for sl.d, then stops them and waits for
// their requests in flight; the slice's time, to that end, is added to the
// phase's. The other phase's workers are idle meanwhile, so the two never
// share the reply slots.
func (r *benchRun) runSlice(ctx context.Context, p *phase, sl benchSlice) error {
	var stop atomic.Bool
	var wg sync.WaitGroup
	start, cpu0 := time.Now(), processCPU()
	for _, w := range p.workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.work(w, p.subject, &stop, p.tally)
		}()
	}
	finished := make(chan struct{})
	go func() { wg.Wait(); close(finished) }()

	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	end := time.NewTimer(sl.d)
	defer end.Stop()
	lastDone, _ := p.sum()
	interrupted := false
wait:
	for {
		select {
		case <-tick.C:
			done, errs := p.sum()
			el := p.elapsed + time.Since(start)
			logf(r.progress, "  %-6s %d/%d %5.1fs  %9.0f/s (last second %9d/s)  errors %d",
				p.name, sl.round, r.c.rounds, el.Seconds(), float64(done)/el.Seconds(), done-lastDone, errs)
			lastDone = done
		case <-end.C:
			stop.Store(true)
		case <-ctx.Done():
			stop.Store(true)
			interrupted = true
		case <-finished:
			break wait
		}
	}
	p.elapsed += time.Since(start)
	p.cpu += processCPU() - cpu0
	if interrupted {
		return ctx.Err()
	}
	return nil
}

// result merges the workers' figures; call it once no slice runs.
func (p *phase) result() *phaseResult {
	res := &phaseResult{elapsed: p.elapsed}
	for _, w := range p.workers {
		res.replies += w.done.Load()
		res.errors += w.errs.Load()
		res.hist.merge(w.hist)
		res.admitted += w.admitted
		res.denied += w.denied
		res.timeouts += w.timeouts
		res.unavail += w.unavailable
		res.failed += w.failed
		res.unmatch += w.unmatched
	}
	return res
}

// work is one worker's loop until stop (one slice).
func (r *benchRun) work(w *worker, subject string, stop *atomic.Bool, tally []keyTally) {
	timeout, base := r.c.cf.timeout, r.base
	for !stop.Load() {
		k := w.pick.next()
		w.body = r.plan.appendBody(w.body[:0], k)
		t0 := time.Now()
		msg, err := w.slot.request(subject, w.body, timeout)
		t1 := time.Now()
		if err != nil {
			w.errs.Add(1)
			if errors.Is(err, nats.ErrTimeout) {
				w.timeouts++
				continue
			}
			// No responders or a broken connection fail at once: pause
			// rather than spin.
			w.failed++
			time.Sleep(10 * time.Millisecond)
			continue
		}
		if code := msg.Header.Get("Nats-Service-Error-Code"); code != "" {
			if code == "503" {
				w.unavailable++
			} else {
				w.failed++
			}
			w.errs.Add(1)
			continue
		}
		if tally != nil {
			allowed, ok := r.plan.scanReply(msg.Data)
			if !ok {
				w.unmatched++
				w.errs.Add(1)
				continue
			}
			if allowed {
				w.admitted++
				// Wall-clock spans, as nodes decide on the wall clock (a
				// monotonic span differs when the wall clock is slewed).
				tally[k].add(r.plan.cost, t0.UnixNano()-base.UnixNano(), t1.UnixNano()-base.UnixNano())
			} else {
				w.denied++
			}
		}
		w.hist.record(int64(t1.Sub(t0)))
		w.done.Add(1)
	}
}

// scanReply reads "allowed" from a decide reply and checks that the bench
// policy made the decision; ok is false for any other reply (a node that has
// not applied the policy yet answers unmatched descriptors with policy "").
// It looks for the fields as the node writes them and falls back to
// encoding/json for any other layout and for replies of other policies.
func (p *benchPlan) scanReply(b []byte) (allowed, ok bool) {
	const af, pf = `"allowed":`, `"policy":`
	i := bytes.Index(b, []byte(af))
	j := bytes.Index(b, []byte(pf))
	if i >= 0 && j >= 0 {
		a := b[i+len(af):]
		pol := b[j+len(pf):]
		if bytes.HasPrefix(pol, p.quotedPolicy) {
			switch {
			case bytes.HasPrefix(a, []byte("true")):
				return true, true
			case bytes.HasPrefix(a, []byte("false")):
				return false, true
			}
		}
	}
	var r decideReply
	if json.Unmarshal(b, &r) != nil || r.Policy != p.policyName {
		return false, false
	}
	return r.Allowed, true
}

// inboxConn is a load connection: one wildcard subscription on an inbox of
// its own, and one reply subject per slot (a worker) under it, so a request
// is a publish plus a delivery.
type inboxConn struct {
	nc     *nats.Conn
	prefix string // "<inbox>."
	slots  []*inboxSlot
}

// inboxSlot is one worker's reply subject <inbox>.<slot>.<generation>; the
// generation changes after a timeout so that a late reply is never taken for
// the next request's.
type inboxSlot struct {
	c     *inboxConn
	idx   int
	gen   atomic.Uint32
	reply string
	ch    chan *nats.Msg
	timer *time.Timer
}

func newInboxConn(nc *nats.Conn, slots int) (*inboxConn, error) {
	c := &inboxConn{nc: nc, prefix: nc.NewInbox() + "."}
	for i := range slots {
		s := &inboxSlot{c: c, idx: i, ch: make(chan *nats.Msg, 4), timer: time.NewTimer(time.Hour)}
		s.timer.Stop()
		s.reply = c.prefix + strconv.Itoa(i) + ".0"
		c.slots = append(c.slots, s)
	}
	sub, err := nc.Subscribe(c.prefix+"*.*", c.dispatch)
	if err != nil {
		return nil, err
	}
	if err := sub.SetPendingLimits(-1, -1); err != nil {
		return nil, err
	}
	return c, nc.Flush()
}

// dispatch hands a reply to its slot (on the connection's delivery
// goroutine). Replies of an old generation are dropped.
func (c *inboxConn) dispatch(m *nats.Msg) {
	rest := m.Subject[min(len(c.prefix), len(m.Subject)):]
	dot := strings.IndexByte(rest, '.')
	if dot < 0 {
		return
	}
	idx, err1 := strconv.Atoi(rest[:dot])
	gen, err2 := strconv.ParseUint(rest[dot+1:], 10, 32)
	if err1 != nil || err2 != nil || idx < 0 || idx >= len(c.slots) {
		return
	}
	s := c.slots[idx]
	if uint32(gen) != s.gen.Load() {
		return
	}
	select {
	case s.ch <- m:
	default:
	}
}

// request publishes body to subject and waits up to timeout for the reply.
// Only the slot's worker calls it.
func (s *inboxSlot) request(subject string, body []byte, timeout time.Duration) (*nats.Msg, error) {
	if err := s.c.nc.PublishRequest(subject, s.reply, body); err != nil {
		return nil, err
	}
	s.timer.Reset(timeout)
	for {
		select {
		case m := <-s.ch:
			if m.Subject != s.reply {
				continue // a late reply to an earlier generation
			}
			s.timer.Stop()
			if len(m.Data) == 0 && m.Header.Get("Status") == "503" {
				return nil, nats.ErrNoResponders
			}
			return m, nil
		case <-s.timer.C:
			g := s.gen.Add(1)
			s.reply = s.c.prefix + strconv.Itoa(s.idx) + "." + strconv.FormatUint(uint64(g), 10)
			return nil, nats.ErrTimeout
		}
	}
}

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
	// This process's CPU time per reply in each phase (bench_cpu.go).
	CPUPerDecisionUs    float64 `json:"cpu_us_per_decision"`
	EchoCPUPerRequestUs float64 `json:"echo_cpu_us_per_request"`
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
	fmt.Fprintf(w, "limitmesh bench: mode %s, %s, %d in flight over %d connections, cost %s\n",
		c.mode, keys, c.concurrency, c.conns, c.cost)
	fmt.Fprintf(w, "policy %s: token_bucket %s, burst %s per key\n", plan.policyName, c.rate, c.burst)
	if rep.Rounds == 1 {
		fmt.Fprintf(w, "echo %.1fs, then decide %.1fs\n\n", rep.EchoDurationS, rep.DurationS)
	} else {
		fmt.Fprintf(w, "echo %.1fs and decide %.1fs, interleaved in %d rounds\n\n", rep.EchoDurationS, rep.DurationS, rep.Rounds)
	}
	fmt.Fprintf(w, "%-14s %10s %10s %9s %9s %9s %8s\n", "", "requests", "per sec", "p50 ms", "p99 ms", "p999 ms", "errors")
	fmt.Fprintf(w, "%-14s %10d %10.0f %9.3f %9.3f %9.3f %8d\n", "raw NATS echo",
		rep.EchoRequests, rep.EchoPerS, rep.EchoP50ms, rep.EchoP99ms, rep.EchoP999ms, rep.EchoErrors)
	fmt.Fprintf(w, "%-14s %10d %10.0f %9.3f %9.3f %9.3f %8d\n", "decide",
		rep.Decisions, rep.DecisionsPerS, rep.P50ms, rep.P99ms, rep.P999ms, rep.Errors)
	p99 := 0.0
	if rep.EchoP99ms > 0 {
		p99 = rep.P99ms / rep.EchoP99ms
	}
	fmt.Fprintf(w, "\ndecide/echo: throughput %.3f, p99 %.2fx\n", rep.Ratio, p99)
	fmt.Fprintf(w, "admitted %d, denied %d (errors: %d timeouts, %d unavailable, %d unmatched, %d other)\n",
		rep.Admitted, rep.Denied, rep.Timeouts, rep.Unavailable, rep.Unmatched,
		rep.Errors-rep.Timeouts-rep.Unavailable-rep.Unmatched)
	fmt.Fprintf(w, "overshoot: %s units on %d of %d keys with admissions (allowed: burst + rate x span per key)\n",
		formatUnits(rep.OvershootMicro), rep.OvershootKeys, rep.KeysAdmitted)
	rep.printUsageLag(w)
	rep.printCPU(w, c)
}

// formatUnits formats micro-units as a decimal number of units.
func formatUnits(micro int64) string {
	s := strconv.FormatInt(micro/kvstate.Unit, 10)
	if f := micro % kvstate.Unit; f != 0 {
		s += strings.TrimRight(fmt.Sprintf(".%06d", f), "0")
	}
	return s
}

// putBenchPolicy puts the run's policy into the policy bucket over admin;
// undo deletes it again.
func putBenchPolicy(ctx context.Context, admin *nats.Conn, c *benchConfig, plan *benchPlan) (js jetstream.JetStream, kv jetstream.KeyValue, rev uint64, undo func(), err error) {
	if js, err = jetstream.New(admin); err != nil {
		return nil, nil, 0, nil, err
	}
	if kv, err = js.KeyValue(ctx, c.cf.prefix+"_policies"); err != nil {
		return nil, nil, 0, nil, fmt.Errorf("open %s_policies: %v (is a node running?)", c.cf.prefix, err)
	}
	if rev, err = kv.Put(ctx, plan.policyName, plan.policyDoc); err != nil {
		return nil, nil, 0, nil, fmt.Errorf("put policy %s: %v", plan.policyName, err)
	}
	return js, kv, rev, func() {
		dctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = kv.Delete(dctx, plan.policyName)
	}, nil
}
