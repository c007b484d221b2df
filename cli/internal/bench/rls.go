package bench

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"strconv"
	"sync/atomic"
	"time"

	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/nats-io/nats.go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh"
	"github.com/limitmesh/limitmesh/policies"
)

// `limitmesh bench --rls ADDR` runs the same closed-loop load over Envoy's
// rate limit API (gRPC ShouldRateLimit) against any server that speaks it:
// limitmesh's bridge (serve --envoy-listen) or envoyproxy/ratelimit. With
// --rls embedded the target is the embedded node's own bridge, on a free
// loopback port.
//
// Each request carries the domain "limitmesh-bench" and one descriptor
// (bench_run=<run>, key=r<n>), the key drawn as the decide phase draws
// k<n>, and --cost as its hits_addend (a whole number). On limitmesh the
// bench policy (bench_run=<run>, keyed by bench_run and key) decides it;
// envoyproxy/ratelimit needs a config for it, such as
//
//	domain: limitmesh-bench
//	descriptors:
//	  - key: bench_run
//	    descriptors:
//	      - key: key
//	        rate_limit: {unit: second, requests_per_unit: 1000}
//
// Unless --rls-compare=false, the run has a node (the embedded one, or the
// deployment at --nats-url) and its slices alternate, NATS first: the
// decide phase over NATS against the node (as `bench` without --rls, keys
// k<n>) and the RLS phase (keys r<n>, so that neither phase spends the
// other's keys), and ratio = RLS decisions/s / NATS decisions/s: what the
// gRPC hop costs against the same node in the same run (against an
// external RLS server, that server against limitmesh over NATS). A
// response is admitted when its overall code is OK and denied when it is
// OVER_LIMIT; one whose status has no current_limit (no limit matched) is
// counted as unmatched, an error. Overshoot is checked for the NATS phase
// and for the embedded bridge, whose decisions are the bench policy's.

// RLSEmbedded is the --rls value that names the embedded node's bridge.
const RLSEmbedded = "embedded"

// rlsDomain is the domain of the RLS phase's requests.
const rlsDomain = "limitmesh-bench"

// RLSConfig is where RunRLS sends its load (--rls, --rls-compare).
type RLSConfig struct {
	Addr    string // host:port of a server of Envoy's rate limit API, or RLSEmbedded
	Compare bool   // alternate with the decide phase over NATS and report rls/nats
}

func (r *RLSConfig) validate(c *Config) error {
	if r.Addr == "" {
		return nil
	}
	switch {
	case r.Addr == RLSEmbedded && c.external():
		return fmt.Errorf("--rls %s is the embedded node's bridge; with --nats-url name the deployment's bridge (serve --envoy-listen) as host:port", RLSEmbedded)
	case c.Mode != "strict" && c.Mode != "async" && c.Mode != "local":
		return fmt.Errorf("--rls loads ShouldRateLimit: --mode %s is not for it (strict, async or local)", c.Mode)
	case c.Candidates > 0 || c.Flood.Factor > 0:
		return errors.New("--candidates and --flood are not for --rls")
	}
	micro, err := policies.ParseCost(c.Cost)
	if err != nil || micro%kvstate.Unit != 0 {
		return fmt.Errorf("--cost %q: --rls sends it as hits_addend, a whole number", c.Cost)
	}
	return nil
}

// rlsHits is the run's hits_addend.
func (c *Config) rlsHits() uint32 {
	micro, _ := policies.ParseCost(c.Cost) // validated: whole
	return uint32(micro / kvstate.Unit)
}

// RLSReport is the --rls run's result; its JSON form is the --json line.
type RLSReport struct {
	Mode          string  `json:"mode"` // "rls"
	PolicyMode    string  `json:"policy_mode"`
	Target        string  `json:"target"`
	Keys          int     `json:"keys"`
	Zipf          float64 `json:"zipf"`
	Concurrency   int     `json:"concurrency"`
	Conns         int     `json:"conns"`
	Cost          string  `json:"cost"`
	Rate          string  `json:"rate"`
	Burst         string  `json:"burst"`
	DurationS     float64 `json:"duration_s"`
	Rounds        int     `json:"rounds"`
	Decisions     int64   `json:"decisions"`
	DecisionsPerS float64 `json:"decisions_per_sec"`
	P50ms         float64 `json:"p50_ms"`
	P99ms         float64 `json:"p99_ms"`
	P999ms        float64 `json:"p999_ms"`
	Admitted      int64   `json:"admitted"`
	Denied        int64   `json:"denied"`
	Errors        int64   `json:"errors"`
	Timeouts      int64   `json:"timeouts"`
	Unavailable   int64   `json:"unavailable"`
	Unmatched     int64   `json:"unmatched"`
	CPUPerDecUs   float64 `json:"cpu_us_per_decision"`
	// The NATS phase, with --rls-compare (null without).
	NATSDurationS *float64 `json:"nats_duration_s"`
	NATSPerS      *float64 `json:"nats_decisions_per_sec"`
	NATSP50ms     *float64 `json:"nats_p50_ms"`
	NATSP99ms     *float64 `json:"nats_p99_ms"`
	NATSAdmitted  *int64   `json:"nats_admitted"`
	NATSDenied    *int64   `json:"nats_denied"`
	NATSErrors    *int64   `json:"nats_errors"`
	NATSCPUPerDec *float64 `json:"nats_cpu_us_per_decision"`
	Ratio         *float64 `json:"ratio"` // decisions_per_sec / nats_decisions_per_sec
	// Overshoot of the phases checked (see above), units.
	Overshoot      float64 `json:"overshoot"`
	OvershootKeys  int     `json:"overshoot_keys"`
	OvershootMicro int64   `json:"-"`
}

// RunRLS runs the load cfg describes over Envoy's rate limit API against
// cfg.RLS.Addr (see above) and returns its figures; as Run, its error is
// for a run that could not be made.
func RunRLS(ctx context.Context, cfg Config) (*RLSReport, error) {
	c := &cfg
	dist, plan, err := prepare(c)
	if err != nil {
		return nil, err
	}
	progress := c.Progress
	var cleanup []func()
	defer func() {
		for i := len(cleanup) - 1; i >= 0; i-- {
			cleanup[i]()
		}
	}()
	target := c.RLS.Addr
	hasNode := c.external() || c.RLS.Compare || target == RLSEmbedded
	var connect func(name string) (*nats.Conn, error)
	switch {
	case c.external():
		connect = func(name string) (*nats.Conn, error) { return c.Dial(name) }
		logf(progress, "bench: the limitmesh deployment at %s", c.Target)
	case hasNode:
		if _, err := mesh.ParsePolicy(plan.policyName, plan.policyDoc); err != nil {
			return nil, fmt.Errorf("the embedded node does not implement --mode %s: %v", c.Mode, err)
		}
		if target == RLSEmbedded {
			c.onNode = func(emb *mesh.Embedded, node *mesh.Node, log *slog.Logger) (func(), error) {
				l, err := net.Listen("tcp", "127.0.0.1:0")
				if err != nil {
					return nil, err
				}
				stopBridge, err := c.StartBridge(l, emb, node, c.Prefix, log)
				if err != nil {
					l.Close()
					return nil, err
				}
				target = l.Addr().String()
				return func() {
					sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
					defer cancel()
					stopBridge(sctx)
				}, nil
			}
		}
		emb, _, stop, err := startBenchNode(ctx, c)
		if err != nil {
			return nil, err
		}
		cleanup = append(cleanup, stop)
		connect = func(name string) (*nats.Conn, error) { return emb.Connect(nats.Name(name)) }
		logf(progress, "bench: started an embedded node (NATS + JetStream in this process)")
	}
	if hasNode {
		admin, err := connect("limitmesh-bench-admin")
		if err != nil {
			return nil, err
		}
		cleanup = append(cleanup, admin.Close)
		_, _, rev, undo, err := putBenchPolicy(ctx, admin, c, plan)
		if err != nil {
			return nil, err
		}
		cleanup = append(cleanup, undo)
		if _, err := waitForBenchPolicy(ctx, admin, plan, rev, c.Timeout); err != nil {
			return nil, err
		}
		logf(progress, "bench: policy %s (revision %d): token_bucket %s burst %s per key, mode %s",
			plan.policyName, rev, c.Rate, c.Burst, c.Mode)
	}
	logf(progress, "bench: Envoy rate limit service at %s (domain %s, descriptor bench_run=%s, key=r<n>)", target, rlsDomain, plan.run)

	r := &benchRun{c: c, plan: plan, dist: dist, progress: progress}
	var natsPhase *phase
	natsTally, rlsTally := newTallies(c.Keys), newTallies(c.Keys)
	if c.RLS.Compare {
		r.load = make([]*inboxConn, c.Conns)
		for i := range r.load {
			nc, err := connect(fmt.Sprintf("limitmesh-bench-%d", i))
			if err != nil {
				return nil, err
			}
			cleanup = append(cleanup, nc.Close)
			perConn := (c.Concurrency + c.Conns - 1 - i) / c.Conns
			if r.load[i], err = newInboxConn(nc, perConn); err != nil {
				return nil, err
			}
		}
		natsPhase = r.newPhase("nats", plan.decideSubj, natsTally)
	}
	conns := make([]*grpc.ClientConn, c.Conns)
	for i := range conns {
		cc, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return nil, fmt.Errorf("--rls %s: %v", target, err)
		}
		cleanup = append(cleanup, func() { cc.Close() })
		conns[i] = cc
	}
	if err := probeRLS(ctx, conns[0], plan, c); err != nil {
		return nil, fmt.Errorf("--rls %s: %v", target, err)
	}
	rls := r.newRLSPhase(conns, rlsTally)

	if natsPhase != nil {
		if err := r.runRounds(ctx, natsPhase, rls); err != nil {
			return nil, err
		}
	} else {
		r.base = time.Now()
		for i, d := range splitDuration(c.Duration, c.Rounds) {
			if err := r.runSlice(ctx, rls, benchSlice{decide: true, round: i + 1, d: d}); err != nil {
				return nil, err
			}
		}
	}

	return r.rlsReport(target, natsPhase, rls, natsTally, rlsTally, c.RLS.Addr == RLSEmbedded), nil
}

func newTallies(n int) []keyTally {
	t := make([]keyTally, n)
	for i := range t {
		t[i].first.Store(math.MaxInt64)
	}
	return t
}

// rlsRequest is a worker's request, reused from call to call: only the
// key entry's value changes.
func rlsRequest(plan *benchPlan, hits uint32) (*rlsv3.RateLimitRequest, *ratelimitv3.RateLimitDescriptor_Entry) {
	key := &ratelimitv3.RateLimitDescriptor_Entry{Key: "key"}
	return &rlsv3.RateLimitRequest{Domain: rlsDomain, HitsAddend: hits,
		Descriptors: []*ratelimitv3.RateLimitDescriptor{{Entries: []*ratelimitv3.RateLimitDescriptor_Entry{
			{Key: "bench_run", Value: plan.run}, key}}}}, key
}

// probeRLS sends one request (key r0) and checks that a limit decided it,
// so that a server without the bench's descriptors in its config is
// reported before the run rather than as errors.
func probeRLS(ctx context.Context, cc *grpc.ClientConn, plan *benchPlan, c *Config) error {
	req, key := rlsRequest(plan, 1)
	key.Value = "r0"
	deadline := time.Now().Add(5 * time.Second)
	for {
		pctx, cancel := context.WithTimeout(ctx, c.Timeout)
		resp, err := rlsv3.NewRateLimitServiceClient(cc).ShouldRateLimit(pctx, req)
		cancel()
		switch {
		case err == nil && len(resp.Statuses) == 1 && resp.Statuses[0].CurrentLimit != nil:
			return nil
		case time.Now().After(deadline) && err != nil:
			return err
		case time.Now().After(deadline):
			return fmt.Errorf("no limit applies to domain %s, descriptor bench_run=%s, key=r0 (its config needs them: docs/protocol.md, The Envoy rate limit service, Load)", rlsDomain, plan.run)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// newRLSPhase makes --concurrency workers against the RLS server, spread
// over conns; worker i draws keys from stream i of --seed, as in the other
// phases.
func (r *benchRun) newRLSPhase(conns []*grpc.ClientConn, tally []keyTally) *phase {
	c := r.c
	p := &phase{name: "rls", tally: tally, workers: make([]*worker, c.Concurrency)}
	clients := make(map[*worker]rlsv3.RateLimitServiceClient, c.Concurrency)
	for i := range p.workers {
		w := &worker{pick: r.dist.picker(c.Seed, uint64(i)), hist: new(latencyHist)}
		p.workers[i] = w
		clients[w] = rlsv3.NewRateLimitServiceClient(conns[i%len(conns)])
	}
	hits := c.rlsHits()
	p.loop = func(w *worker, stop *atomic.Bool) { r.rlsWork(w, clients[w], hits, stop, tally) }
	return p
}

// rlsWork is one RLS worker's loop until stop (one slice).
func (r *benchRun) rlsWork(w *worker, cl rlsv3.RateLimitServiceClient, hits uint32, stop *atomic.Bool, tally []keyTally) {
	timeout, base := r.c.Timeout, r.base
	req, key := rlsRequest(r.plan, hits)
	for !stop.Load() {
		k := w.pick.next()
		key.Value = "r" + strconv.Itoa(k)
		t0 := time.Now()
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		resp, err := cl.ShouldRateLimit(ctx, req)
		cancel()
		t1 := time.Now()
		if err != nil {
			w.errs.Add(1)
			switch status.Code(err) {
			case codes.DeadlineExceeded:
				w.timeouts++
				continue
			case codes.Unavailable:
				w.unavailable++
			default:
				w.failed++
			}
			time.Sleep(10 * time.Millisecond) // a broken connection fails at once: pause rather than spin
			continue
		}
		if len(resp.Statuses) != 1 || resp.Statuses[0].CurrentLimit == nil {
			w.unmatched++
			w.errs.Add(1)
			continue
		}
		switch resp.OverallCode {
		case rlsv3.RateLimitResponse_OK:
			w.admitted++
			tally[k].add(r.plan.cost, t0.UnixNano()-base.UnixNano(), t1.UnixNano()-base.UnixNano())
		case rlsv3.RateLimitResponse_OVER_LIMIT:
			w.denied++
		default:
			w.failed++
			w.errs.Add(1)
			continue
		}
		w.hist.record(int64(t1.Sub(t0)))
		w.done.Add(1)
	}
}

func (r *benchRun) rlsReport(target string, natsPhase, rls *phase, natsTally, rlsTally []keyTally, checkRLS bool) *RLSReport {
	c := r.c
	ms := func(ns int64) float64 { return math.Round(float64(ns)/1e3) / 1e3 }
	res := rls.result()
	rep := &RLSReport{
		Mode: "rls", PolicyMode: string(c.Mode), Target: target, Keys: c.Keys, Zipf: c.Zipf, Concurrency: c.Concurrency,
		Conns: c.Conns, Cost: c.Cost, Rate: c.Rate, Burst: c.Burst, Rounds: c.Rounds,
		DurationS:     math.Round(res.elapsed.Seconds()*1e3) / 1e3,
		Decisions:     res.replies,
		DecisionsPerS: math.Round(res.perSec()),
		P50ms:         ms(res.hist.quantile(0.5)),
		P99ms:         ms(res.hist.quantile(0.99)),
		P999ms:        ms(res.hist.quantile(0.999)),
		Admitted:      res.admitted,
		Denied:        res.denied,
		Errors:        res.errors,
		Timeouts:      res.timeouts,
		Unavailable:   res.unavail,
		Unmatched:     res.unmatch,
		CPUPerDecUs:   cpuPer(rls.cpu, res.replies),
	}
	if checkRLS {
		rep.OvershootMicro, rep.OvershootKeys = overshoot(r.plan.limit, rlsTally)
	}
	if natsPhase != nil {
		n := natsPhase.result()
		f := func(v float64) *float64 { return &v }
		i := func(v int64) *int64 { return &v }
		rep.NATSDurationS = f(math.Round(n.elapsed.Seconds()*1e3) / 1e3)
		rep.NATSPerS = f(math.Round(n.perSec()))
		rep.NATSP50ms, rep.NATSP99ms = f(ms(n.hist.quantile(0.5))), f(ms(n.hist.quantile(0.99)))
		rep.NATSAdmitted, rep.NATSDenied, rep.NATSErrors = i(n.admitted), i(n.denied), i(n.errors)
		rep.NATSCPUPerDec = f(cpuPer(natsPhase.cpu, n.replies))
		if n.perSec() > 0 {
			rep.Ratio = f(math.Round(res.perSec()/n.perSec()*1e4) / 1e4)
		}
		m, k := overshoot(r.plan.limit, natsTally)
		rep.OvershootMicro += m
		rep.OvershootKeys += k
	}
	rep.Overshoot = float64(rep.OvershootMicro) / float64(kvstate.Unit)
	return rep
}
