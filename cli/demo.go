package cli

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/limitmesh/limitmesh/cli/internal/clitext"
	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh"
)

// The Acme contract of the domain reference (§1): 10 requests/s sustained,
// a burst of 40, six gateways.
const (
	demoRate     = 10
	demoBurst    = 40
	demoGateways = 6
	demoRequests = 80
)

func runDemo(ctx context.Context, args []string, s stdio) error {
	var (
		cf      clientFlags
		verbose bool
	)
	fs := newFlags("demo", s)
	cf.register(fs)
	fs.BoolVar(&verbose, "v", false, "log what the embedded node does")
	if err := parseFlags(fs, args, s); err != nil {
		return err
	}
	// Without --nats-url (or LIMITMESH_NATS_URL) the demo starts its own node.
	external := false
	fs.Visit(func(f *flag.Flag) {
		if f.Name == "nats-url" {
			external = true
		}
	})

	var (
		connect func() (*nats.Conn, error)
		cleanup []func()
	)
	defer func() {
		for i := len(cleanup) - 1; i >= 0; i-- {
			cleanup[i]()
		}
	}()
	if external {
		connect = cf.connect
		fmt.Fprintf(s.out, "using the limitmesh deployment at %s\n", clitext.RedactURL(cf.natsURL))
	} else {
		dir, err := os.MkdirTemp("", "limitmesh-demo-")
		if err != nil {
			return err
		}
		cleanup = append(cleanup, func() { os.RemoveAll(dir) })
		level := slog.LevelWarn
		if verbose {
			level = slog.LevelInfo
		}
		log := slog.New(slog.NewTextHandler(s.err, &slog.HandlerOptions{Level: level}))
		emb, err := mesh.StartEmbedded(mesh.EmbeddedConfig{DataDir: dir, ServerName: "limitmesh-demo", Logger: log})
		if err != nil {
			return fmt.Errorf("embedded NATS: %v", err)
		}
		cleanup = append(cleanup, emb.Shutdown)
		nodeConn, err := emb.Connect()
		if err != nil {
			return err
		}
		cleanup = append(cleanup, nodeConn.Close)
		node, err := mesh.NewNode(nodeConn, mesh.NodeConfig{Prefix: cf.prefix, Logger: log})
		if err != nil {
			return err
		}
		startCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
		err = node.Start(startCtx)
		cancel()
		if err != nil {
			return fmt.Errorf("start node: %v", err)
		}
		cleanup = append(cleanup, func() {
			sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = node.Stop(sctx)
		})
		connect = func() (*nats.Conn, error) { return emb.Connect() }
		fmt.Fprintln(s.out, "started an embedded limitmesh node (NATS + JetStream in this process)")
	}
	if err := demo(ctx, s, &cf, connect); err != nil {
		return err
	}

	// The leased story: against the deployment at --nats-url (every
	// gateway connects there), else on an embedded two-region supercluster.
	ld := &leasedDemo{
		connect: func(int) (*nats.Conn, error) { return connect() },
		region:  func(int) string { return "default" },
		regions: 1,
	}
	if !external {
		// The regions' servers warn while their gateways and JetStream
		// form: only errors, unless -v.
		log := slog.New(slog.NewTextHandler(s.err, &slog.HandlerOptions{Level: slog.LevelError}))
		if verbose {
			log = slog.New(slog.NewTextHandler(s.err, &slog.HandlerOptions{Level: slog.LevelInfo}))
		}
		var stop func()
		var err error
		if ld, stop, err = startLeasedDemo(ctx, cf.prefix, log); err != nil {
			return fmt.Errorf("the leased demo's regions: %v", err)
		}
		defer stop()
		fmt.Fprintf(s.out, "\nstarted an embedded supercluster of %d regions (one NATS server and node each) for leased mode\n", ld.regions)
	}
	return demoLeased(ctx, s.out, cf.prefix, ld)
}

func demo(ctx context.Context, s stdio, cf *clientFlags, connect func() (*nats.Conn, error)) error {
	// A tenant name of its own for this run, so that a demo against a shared
	// deployment starts from a full bucket.
	tenant := fmt.Sprintf("acme-demo-%d", time.Now().UnixNano()%1_000_000)
	policyName := "acme-search-demo"
	policy := fmt.Sprintf(`{"match":{"tenant":%q,"operation":"search"},"key":["tenant","operation"],`+
		`"limits":[{"name":"rate","algorithm":"token_bucket","rate":"%d/s","burst":%d}],`+
		`"description":"Acme search contract (limitmesh demo)"}`, tenant, demoRate, demoBurst)

	admin, err := connect()
	if err != nil {
		return err
	}
	defer admin.Close()
	js, err := jetstream.New(admin)
	if err != nil {
		return err
	}
	kv, err := js.KeyValue(ctx, cf.prefix+"_policies")
	if err != nil {
		return fmt.Errorf("open %s_policies: %v (is a node running?)", cf.prefix, err)
	}
	rev, err := kv.Put(ctx, policyName, []byte(policy))
	if err != nil {
		return fmt.Errorf("put policy: %v", err)
	}
	defer func() { _ = kv.Delete(context.Background(), policyName) }()

	gateways := make([]*nats.Conn, demoGateways)
	for i := range gateways {
		if gateways[i], err = connect(); err != nil {
			return err
		}
		defer gateways[i].Close()
	}
	subject := cf.prefix + ".v1.decide"
	body, _ := json.Marshal(decideRequest{Descriptor: map[string]string{"tenant": tenant, "operation": "search", "plan": "v7"}})

	// Wait (bounded) until the node applies the policy: a dry run names it.
	if err := waitForPolicy(ctx, admin, subject, tenant, policyName, rev); err != nil {
		return err
	}
	fmt.Fprintf(s.out, "policy %s (revision %d): token_bucket %d/s, burst %d, one key per tenant+operation\n\n",
		policyName, rev, demoRate, demoBurst)

	type result struct {
		gateway int
		reply   decideReply
		err     error
	}
	results := make([]result, demoRequests)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range demoRequests {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			g := i % demoGateways
			<-start
			results[i].gateway = g
			msg, err := gateways[g].Request(subject, body, 5*time.Second)
			if err != nil {
				results[i].err = err
				return
			}
			if code := msg.Header.Get("Nats-Service-Error-Code"); code != "" {
				results[i].err = fmt.Errorf("error %s: %s", code, msg.Data)
				return
			}
			results[i].err = json.Unmarshal(msg.Data, &results[i].reply)
		}(i)
	}
	began := time.Now()
	close(start)
	wg.Wait()
	elapsed := time.Since(began)

	var admitted, denied, failed int
	perGateway := make([]int, demoGateways)
	minRetry, maxRetry := int64(-1), int64(0)
	for _, r := range results {
		perGateway[r.gateway]++
		switch {
		case r.err != nil:
			failed++
		case r.reply.Allowed:
			admitted++
		default:
			denied++
			if minRetry < 0 || r.reply.RetryAfterMS < minRetry {
				minRetry = r.reply.RetryAfterMS
			}
			maxRetry = max(maxRetry, r.reply.RetryAfterMS)
		}
	}
	if failed > 0 {
		for _, r := range results {
			if r.err != nil {
				return fmt.Errorf("%d of %d requests failed, e.g. %v", failed, demoRequests, r.err)
			}
		}
	}

	// The same requests against six independent local buckets, one per
	// gateway, each with the whole contract's burst (§12).
	local := 0
	now := time.Now().UnixNano()
	limit := kvstate.Limit{Algorithm: kvstate.TokenBucket, Rate: demoRate * kvstate.Unit, Burst: demoBurst * kvstate.Unit}
	buckets := make([]kvstate.State, demoGateways)
	for i := range demoRequests {
		g := i % demoGateways
		var d kvstate.Decision
		d, buckets[g] = kvstate.Decide(limit, buckets[g], now, kvstate.Unit)
		if d.Allowed {
			local++
		}
	}

	bound := float64(demoBurst) + demoRate*elapsed.Seconds()
	fmt.Fprintf(s.out, "%d requests at once over %d gateway connections %v\n\n", demoRequests, demoGateways, perGateway)
	fmt.Fprintf(s.out, "one global limit (limitmesh, strict):  admitted %2d, denied %2d\n", admitted, denied)
	fmt.Fprintf(s.out, "  contract: admitted <= burst + rate x elapsed = %d + %d/s x %.3fs = %.1f\n",
		demoBurst, demoRate, elapsed.Seconds(), bound)
	if denied > 0 {
		fmt.Fprintf(s.out, "  every denial says when to retry: retry_after_ms %d..%d (one token every %d ms)\n",
			minRetry, maxRetry, 1000/demoRate)
	}
	fmt.Fprintf(s.out, "\nsix independent local buckets:        admitted %2d, denied %2d\n", local, demoRequests-local)
	fmt.Fprintf(s.out, "  each gateway holds a full burst: up to %d x %d = %d admitted at once,\n",
		demoGateways, demoBurst, demoGateways*demoBurst)
	fmt.Fprintf(s.out, "  an overshoot of up to (%d - 1) x %d = %d beyond the contract\n",
		demoGateways, demoBurst, (demoGateways-1)*demoBurst)
	if float64(admitted) > bound {
		return errors.New("the global limit admitted more than its contract: this is a bug")
	}
	return nil
}

// decideReply is the wire reply of CONTRACT.md §2.
type decideReply struct {
	Allowed      bool        `json:"allowed"`
	Policy       string      `json:"policy"`
	Revision     uint64      `json:"revision"`
	Remaining    json.Number `json:"remaining"`
	RetryAfterMS int64       `json:"retry_after_ms"`
	ResetAfterMS int64       `json:"reset_after_ms"`
}

// waitForPolicy polls with dry runs until the node decides with policy at rev.
func waitForPolicy(ctx context.Context, nc *nats.Conn, subject, tenant, policy string, rev uint64) error {
	body, _ := json.Marshal(decideRequest{Descriptor: map[string]string{"tenant": tenant, "operation": "search"}, DryRun: true})
	deadline := time.Now().Add(5 * time.Second)
	for {
		msg, err := nc.Request(subject, body, time.Second)
		if err == nil {
			var r decideReply
			if json.Unmarshal(msg.Data, &r) == nil && r.Policy == policy && r.Revision >= rev {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no node applied policy %s within 5s (last error: %v)", policy, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}
