package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh"
	"github.com/limitmesh/limitmesh/mesh/client"
	"github.com/limitmesh/limitmesh/policies"
)

// `limitmesh bench --mode leased` (CONTRACT §8): --holders SDK holders
// (client.Leasing) in this process, spread over the nodes of --regions
// regions (an embedded supercluster, one server and node per region;
// with --nats-url every holder connects there), spend the bench policy's
// grants. Demand moves: with --shift D, in each span of D of the decide
// phase half the holders are busy (every worker of theirs decides in a
// closed loop: far more than their share of the contract) and the other
// half idle, swapping every D; with --shift 0 all are busy. The echo phase
// runs the same workers against a raw NATS responder in each region.
//
// A worker spends locally when its holder holds a grant (Lease.Spend: no
// round trip), else asks through Lease.Decide (a grant from its region's
// node, a local denial while the key's limits are exhausted, or a remote
// decision). local_fraction = decisions made by the holders themselves /
// all decisions. The tallies' times come from a coarse clock advanced every
// millisecond (a clock read costs more than a local spend on some VMs):
// a key's span is widened by a tick at each end, so the overshoot check
// stays sound (never shows a correct node's admissions as overshoot).
// overshoot is the cost admitted beyond burst + rate × span per key; every
// key's must be at most its bound (max_outstanding), or bench fails.
// utilization = admitted / Σ (burst + rate × span) over the keys with
// admissions; latency is sampled (one decision in 16).

// leasedSample is one decision in this many that is timed.
const leasedSample = 16

// coarseTick is the resolution of the leased bench's clock.
const coarseTick = time.Millisecond

func runLeased(ctx context.Context, c *Config, plan *benchPlan, dist *keyDist, progress io.Writer) (*Report, error) {
	pol, err := policies.Parse(plan.policyName, plan.policyDoc)
	if err != nil {
		return nil, err
	}
	if _, err := mesh.ParsePolicy(plan.policyName, plan.policyDoc); err != nil {
		return nil, fmt.Errorf("the node does not implement --mode leased: %v", err)
	}
	var (
		connect func(region int, name string) (*nats.Conn, error)
		regions = 1
		cleanup []func()
	)
	defer func() {
		for i := len(cleanup) - 1; i >= 0; i-- {
			cleanup[i]()
		}
	}()
	if c.external() {
		connect = func(_ int, name string) (*nats.Conn, error) { return c.Dial(name) }
		logf(progress, "bench: the limitmesh deployment at %s", c.Target)
	} else {
		level := slog.LevelWarn
		if c.Verbose {
			level = slog.LevelInfo
		}
		log := slog.New(slog.NewTextHandler(c.logWriter(), &slog.HandlerOptions{Level: level}))
		rctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		er, err := c.StartRegions(rctx, c.Regions, c.Prefix, log)
		cancel()
		if err != nil {
			return nil, err
		}
		cleanup = append(cleanup, er.Stop)
		regions = c.Regions
		connect = er.Connect
		logf(progress, "bench: started %d embedded region(s) %v, one NATS server and node each", regions, er.Names)
	}

	admin, err := connect(0, "limitmesh-bench-admin")
	if err != nil {
		return nil, err
	}
	cleanup = append(cleanup, admin.Close)
	_, _, rev, undo, err := putBenchPolicy(ctx, admin, c, plan)
	if err != nil {
		return nil, err
	}
	cleanup = append(cleanup, undo)
	// Every region's node must decide with the policy: a dry run from a
	// region's connection reaches a node of that region.
	var sample []byte
	for r := range regions {
		nc, err := connect(r, fmt.Sprintf("limitmesh-bench-probe-%d", r))
		if err != nil {
			return nil, err
		}
		cleanup = append(cleanup, nc.Close)
		if sample, err = waitForBenchPolicy(ctx, nc, plan, rev, c.Timeout); err != nil {
			return nil, err
		}
		// The echo responder of the region, answering as large a payload
		// as a decision reply.
		echoConn, err := connect(r, fmt.Sprintf("limitmesh-bench-echo-%d", r))
		if err != nil {
			return nil, err
		}
		cleanup = append(cleanup, echoConn.Close)
		reply := sample
		sub, err := echoConn.QueueSubscribe(plan.echoSubj, "limitmesh-bench-echo", func(m *nats.Msg) { _ = m.Respond(reply) })
		if err != nil {
			return nil, err
		}
		_ = sub.SetPendingLimits(-1, -1)
		if err := echoConn.Flush(); err != nil {
			return nil, err
		}
	}

	lb := &leasedBench{c: c, plan: plan, pol: pol, dist: dist, tally: make([]keyTally, c.Keys), base: time.Now()}
	for i := range lb.tally {
		lb.tally[i].first.Store(math.MaxInt64)
	}
	lb.holders = make([]*leasedHolder, c.Holders)
	for h := range lb.holders {
		nc, err := connect(h%regions, fmt.Sprintf("limitmesh-bench-holder-%d", h))
		if err != nil {
			return nil, err
		}
		cleanup = append(cleanup, nc.Close)
		cl, err := client.New(nc, client.Prefix(c.Prefix), client.Timeout(c.Timeout),
			client.Leasing(fmt.Sprintf("bench-%s-%d", plan.run, h)))
		if err != nil {
			return nil, err
		}
		lb.holders[h] = &leasedHolder{nc: nc, cl: cl, leases: make([]*client.Lease, c.Keys)}
	}
	perHolder := max((c.Concurrency+c.Holders-1)/c.Holders, 1)
	l := pol.Lease
	logf(progress, "bench: policy %s (revision %d): token_bucket %s burst %s per key, mode leased, grants of %s for %s, max_outstanding %s",
		plan.policyName, rev, c.Rate, c.Burst, units(l.Size), l.TTL, units(l.MaxOutstanding))
	logf(progress, "bench: %d holders over %d region(s), %d workers each, demand shifting every %v", c.Holders, regions, perHolder, c.Shift)

	stopClock := lb.startClock()
	defer stopClock()
	echo, decide := &leasedPhase{}, &leasedPhase{}
	for _, sl := range interleave(c.EchoDuration, c.Duration, c.Rounds) {
		if sl.decide {
			logf(progress, "bench: decide %d/%d (%v)", sl.round, c.Rounds, sl.d)
			lb.runSlice(ctx, decide, true, perHolder, sl.d)
		} else {
			logf(progress, "bench: echo %d/%d (%v)", sl.round, c.Rounds, sl.d)
			lb.runSlice(ctx, echo, false, perHolder, sl.d)
		}
	}
	if err := writeHeapProfile(c.MemProfile); err != nil {
		return nil, err
	}
	for _, h := range lb.holders {
		_ = h.cl.Close() // return what the holders hold
	}
	rep := lb.report(echo, decide, regions)
	rep.RSSPeakMB = peakRSSMB()
	rep.KeysOverBound = lb.overBound()
	return rep, nil
}

// leasedBench is one leased run's shared parts.
type leasedBench struct {
	c       *Config
	plan    *benchPlan
	pol     *policies.Policy
	dist    *keyDist
	holders []*leasedHolder
	tally   []keyTally
	base    time.Time
	coarse  atomic.Int64 // ns since base, advanced every coarseTick
	// decideDone is the decide time of the slices before the current
	// one; decideStart is when the current decide slice began.
	decideDone  time.Duration
	decideStart time.Time
}

// leasedHolder is one SDK holder: its connection, client and a lease per
// key (made on first use; the client shares them among its workers).
type leasedHolder struct {
	nc     *nats.Conn
	cl     *client.Client
	mu     sync.Mutex
	leases []*client.Lease
}

func (h *leasedHolder) lease(k int, run string) (*client.Lease, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if l := h.leases[k]; l != nil {
		return l, nil
	}
	l, err := h.cl.Lease(map[string]string{"bench_run": run, "key": fmt.Sprintf("k%d", k)})
	if err == nil {
		h.leases[k] = l
	}
	return l, err
}

// startClock starts the coarse clock; the returned function stops it.
func (lb *leasedBench) startClock() func() {
	stop := make(chan struct{})
	done := make(chan struct{})
	lb.coarse.Store(int64(time.Since(lb.base)))
	go func() {
		defer close(done)
		tk := time.NewTicker(coarseTick)
		defer tk.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tk.C:
				lb.coarse.Store(int64(time.Since(lb.base)))
			}
		}
	}()
	return func() { close(stop); <-done }
}

// busy reports whether holder h is busy at decide time t.
func (lb *leasedBench) busy(h int, t time.Duration) bool {
	if lb.c.Shift <= 0 || len(lb.holders) == 1 {
		return true
	}
	return (h+int(t/lb.c.Shift))%2 == 0
}

// leasedPhase is what one phase counted over its slices.
type leasedPhase struct {
	mu       sync.Mutex
	elapsed  time.Duration
	n        int64 // replies (echo) or decisions (decide)
	admitted int64
	denied   int64
	local    int64
	errors   int64
	timeouts int64
	unavail  int64
	unmatch  int64
	hist     latencyHist
}

// leasedWorker counts one worker's slice before it is merged.
type leasedWorker struct {
	n, admitted, denied, local, errors, timeouts, unavail, unmatch int64
	hist                                                           latencyHist
}

// runSlice runs perHolder workers of every holder for d: decide workers
// decide while their holder is busy (and wait while it is idle), echo
// workers send raw requests under the same busy pattern.
func (lb *leasedBench) runSlice(ctx context.Context, ph *leasedPhase, decide bool, perHolder int, d time.Duration) {
	start := time.Now()
	if decide {
		lb.decideStart = start
	}
	deadline := start.Add(d)
	var stop atomic.Bool
	var wg sync.WaitGroup
	results := make([]leasedWorker, len(lb.holders)*perHolder)
	echoBody := lb.plan.appendBody(nil, 0)
	for h, holder := range lb.holders {
		for w := range perHolder {
			idx := h*perHolder + w
			res := &results[idx]
			picker := lb.dist.picker(lb.c.Seed, uint64(idx))
			wg.Go(func() {
				var i int64
				for !stop.Load() {
					now := time.Since(lb.decideStart) + lb.decideDone
					if !decide {
						now = time.Since(start) + ph.elapsed
					}
					if !lb.busy(h, now) {
						time.Sleep(time.Millisecond)
						continue
					}
					i++
					timed := i%leasedSample == 0
					var t0 time.Time
					if timed {
						t0 = time.Now()
					}
					if decide {
						lb.decideOne(ctx, holder, picker.next(), res)
					} else {
						if _, err := holder.nc.Request(lb.plan.echoSubj, echoBody, lb.c.Timeout); err != nil {
							res.errors++
							continue
						}
						res.n++
					}
					if timed {
						res.hist.record(int64(time.Since(t0)))
					}
					// A local decision takes no time off the CPU: yield,
					// or the workers would keep the node, the server and
					// the holders' own grant requests waiting for a
					// processor (the scheduler preempts only every 10ms).
					runtime.Gosched()
				}
			})
		}
	}
	for time.Now().Before(deadline) && ctx.Err() == nil {
		time.Sleep(min(time.Until(deadline), 10*time.Millisecond))
	}
	stop.Store(true)
	wg.Wait()
	elapsed := time.Since(start)
	ph.mu.Lock()
	defer ph.mu.Unlock()
	ph.elapsed += elapsed
	if decide {
		lb.decideDone += elapsed
	}
	for i := range results {
		r := &results[i]
		ph.n += r.n
		ph.admitted += r.admitted
		ph.denied += r.denied
		ph.local += r.local
		ph.errors += r.errors
		ph.timeouts += r.timeouts
		ph.unavail += r.unavail
		ph.unmatch += r.unmatch
		ph.hist.merge(&r.hist)
	}
}

// decideOne decides one request of key k through holder: a local spend
// when it holds a grant, else Lease.Decide.
func (lb *leasedBench) decideOne(ctx context.Context, holder *leasedHolder, k int, res *leasedWorker) {
	l, err := holder.lease(k, lb.plan.run)
	if err != nil {
		res.errors++
		return
	}
	cost := lb.plan.cost
	sent := lb.coarse.Load() - int64(coarseTick)
	if l.SpendMicro(cost) {
		res.n++
		res.admitted++
		res.local++
		lb.tally[k].add(cost, sent, lb.coarse.Load()+2*int64(coarseTick))
		return
	}
	r, err := l.Decide(ctx, 1, client.Cost(lb.c.Cost))
	switch {
	case err != nil:
		res.errors++
		switch {
		case isTimeout(err):
			res.timeouts++
		case client.IsUnavailable(err):
			res.unavail++
		}
		return
	case r.Policy == "":
		res.errors++
		res.unmatch++
		return
	}
	res.n++
	if r.Source == client.SourceLease {
		res.local++
	}
	if r.Allowed {
		res.admitted++
		lb.tally[k].add(cost, sent, lb.coarse.Load()+2*int64(coarseTick))
	} else {
		res.denied++
	}
}

func isTimeout(err error) bool { return errors.Is(err, client.ErrTimeout) }

// overBound counts the keys whose overshoot is above their bound.
func (lb *leasedBench) overBound() int {
	n := 0
	for i := range lb.tally {
		t := &lb.tally[i]
		if a := t.admitted.Load(); a > 0 && a-allowance(lb.plan.limit, t.last.Load()-t.first.Load()) > lb.pol.Lease.MaxOutstanding {
			n++
		}
	}
	return n
}

// report builds the run's report, the leased fields included.
func (lb *leasedBench) report(echo, decide *leasedPhase, regions int) *Report {
	c := lb.c
	ms := func(ns int64) float64 { return math.Round(float64(ns)/1e3) / 1e3 }
	perSec := func(n int64, d time.Duration) float64 {
		if d <= 0 {
			return 0
		}
		return math.Round(float64(n) / d.Seconds())
	}
	rep := &Report{
		Policy: lb.plan.policyName, Lease: lb.pol.Lease,
		Mode: string(c.Mode), Keys: c.Keys, Zipf: c.Zipf, Concurrency: c.Concurrency, Conns: c.Holders,
		Cost: c.Cost, Rate: c.Rate, Burst: c.Burst,
		DurationS:     math.Round(decide.elapsed.Seconds()*1e3) / 1e3,
		EchoDurationS: math.Round(echo.elapsed.Seconds()*1e3) / 1e3,
		Rounds:        c.Rounds,
		Decisions:     decide.n,
		DecisionsPerS: perSec(decide.n, decide.elapsed),
		EchoRequests:  echo.n,
		EchoPerS:      perSec(echo.n, echo.elapsed),
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
		Holders:       c.Holders,
		Regions:       regions,
		ShiftS:        c.Shift.Seconds(),
	}
	if rep.EchoPerS > 0 {
		rep.Ratio = math.Round(rep.DecisionsPerS/rep.EchoPerS*1e4) / 1e4
	}
	var capacity, admitted int64
	for i := range lb.tally {
		t := &lb.tally[i]
		a := t.admitted.Load()
		if a == 0 {
			continue
		}
		rep.KeysAdmitted++
		admitted += a
		capacity += allowance(lb.plan.limit, t.last.Load()-t.first.Load())
	}
	rep.OvershootMicro, rep.OvershootKeys = overshoot(lb.plan.limit, lb.tally)
	rep.Overshoot = float64(rep.OvershootMicro) / float64(kvstate.Unit)
	bound := float64(lb.pol.Lease.MaxOutstanding) * float64(rep.KeysAdmitted) / float64(kvstate.Unit)
	util, local := 0.0, 0.0
	if capacity > 0 {
		util = math.Round(float64(admitted)/float64(capacity)*1e4) / 1e4
	}
	if decide.n > 0 {
		local = math.Round(float64(decide.local)/float64(decide.n)*1e4) / 1e4
	}
	rep.Bound, rep.Utilization, rep.LocalFraction = &bound, &util, &local
	return rep
}
