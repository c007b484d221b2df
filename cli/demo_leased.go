package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/limitmesh/limitmesh/mesh"
	"github.com/limitmesh/limitmesh/mesh/client"
)

// The leased part of the demo (CONTRACT §8): Acme's six gateways are Go
// SDK holders (client.Leasing), three in each of two regions, spending
// grants of a leased policy with the same contract.
const (
	demoLeaseSize        = 5
	demoLeaseTTL         = "2s"
	demoLeaseOutstanding = 20
	demoRegions          = 2
)

// leasedDemo is where the leased story runs: connect(g) connects gateway
// g (to its region's server), region(g) names its region.
type leasedDemo struct {
	connect func(g int) (*nats.Conn, error)
	region  func(g int) string
	regions int
}

// startLeasedDemo starts the embedded two-region supercluster the story
// runs on (one server and node per region); stop undoes it.
func startLeasedDemo(ctx context.Context, prefix string, log *slog.Logger) (*leasedDemo, func(), error) {
	er, err := startRegions(ctx, demoRegions, prefix, log)
	if err != nil {
		return nil, nil, err
	}
	return &leasedDemo{
		connect: func(g int) (*nats.Conn, error) {
			return er.connect(g%demoRegions, fmt.Sprintf("demo-gateway-%d", g))
		},
		region:  func(g int) string { return er.names[g%demoRegions] },
		regions: demoRegions,
	}, er.stop, nil
}

// demoLeased puts a leased Acme policy, lets six SDK gateways send 80
// requests at once, and prints the admitted count against the contract and
// the policy's overshoot bound. It fails when the run admitted more than
// the contract plus the bound.
func demoLeased(ctx context.Context, out io.Writer, prefix string, ld *leasedDemo) error {
	tenant := fmt.Sprintf("acme-lease-%d", time.Now().UnixNano()%1_000_000)
	policyName := "acme-search-leased-demo"
	doc := fmt.Sprintf(`{"match":{"tenant":%q,"operation":"search"},"key":["tenant","operation"],`+
		`"limits":[{"name":"rate","algorithm":"token_bucket","rate":"%d/s","burst":%d}],"mode":"leased",`+
		`"lease":{"size":%d,"ttl":%q,"max_outstanding":%d},"description":"Acme search contract, leased (limitmesh demo)"}`,
		tenant, demoRate, demoBurst, demoLeaseSize, demoLeaseTTL, demoLeaseOutstanding)
	p, err := mesh.ParsePolicy(policyName, []byte(doc))
	if err != nil {
		return fmt.Errorf("the leased demo policy: %v", err)
	}
	b, err := mesh.OvershootBound(p, mesh.BoundParams{})
	if err != nil || len(b.Limits) != 1 {
		return fmt.Errorf("the leased demo policy's bound: %v", err)
	}
	bound := b.Limits[0]

	admin, err := ld.connect(0)
	if err != nil {
		return err
	}
	defer admin.Close()
	js, err := jetstream.New(admin)
	if err != nil {
		return err
	}
	kv, err := js.KeyValue(ctx, prefix+"_policies")
	if err != nil {
		return fmt.Errorf("open %s_policies: %v", prefix, err)
	}
	rev, err := kv.Put(ctx, policyName, []byte(doc))
	if err != nil {
		return fmt.Errorf("put policy: %v", err)
	}
	defer func() { _ = kv.Delete(context.Background(), policyName) }()

	gws := make([]*client.Client, demoGateways)
	names := make([]string, demoGateways)
	for g := range gws {
		nc, err := ld.connect(g)
		if err != nil {
			return err
		}
		defer nc.Close()
		names[g] = fmt.Sprintf("gw-%s-%d", ld.region(g), g/ld.regions+1)
		if gws[g], err = client.New(nc, client.Prefix(prefix), client.Leasing(names[g])); err != nil {
			return err
		}
		defer gws[g].Close()
		// Every region's node must have applied the policy before the
		// gateways ask it for grants.
		if err := waitForPolicy(ctx, nc, prefix+".v1.decide", tenant, policyName, rev); err != nil {
			return err
		}
	}
	regions := make([]string, 0, ld.regions)
	for g := range min(ld.regions, demoGateways) {
		regions = append(regions, ld.region(g))
	}
	fmt.Fprintf(out, "\nleased: policy %s (revision %d): the same contract, mode leased, grants of %d for %s, max_outstanding %d\n",
		policyName, rev, demoLeaseSize, demoLeaseTTL, demoLeaseOutstanding)
	fmt.Fprintf(out, "  %d SDK gateways (client.Leasing) in %d region(s) [%s]: %s\n\n",
		demoGateways, ld.regions, strings.Join(regions, ", "), strings.Join(names, " "))

	desc := map[string]string{"tenant": tenant, "operation": "search", "plan": "v7"}
	type result struct {
		r   *client.Result
		err error
	}
	results := make([]result, demoRequests)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range demoRequests {
		wg.Go(func() {
			<-start
			rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			results[i].r, results[i].err = gws[i%demoGateways].Decide(rctx, desc, 1)
		})
	}
	began := time.Now()
	close(start)
	wg.Wait()
	elapsed := time.Since(began)

	var admitted, denied, local int
	for _, r := range results {
		if r.err != nil {
			return fmt.Errorf("a leased decision failed: %v", r.err)
		}
		if r.r.Allowed {
			admitted++
		} else {
			denied++
		}
		if r.r.Source == client.SourceLease {
			local++
		}
	}
	contract := float64(demoBurst) + demoRate*elapsed.Seconds()
	limit := contract + float64(bound.Units)/1e6
	fmt.Fprintf(out, "%d requests at once over the %d gateways\n\n", demoRequests, demoGateways)
	fmt.Fprintf(out, "leased (grants spent in the gateways):  admitted %2d, denied %2d; %d decided in the gateway itself\n",
		admitted, denied, local)
	fmt.Fprintf(out, "  contract + bound: burst + rate x elapsed + max_outstanding = %d + %d/s x %.3fs + %d = %.1f\n",
		demoBurst, demoRate, elapsed.Seconds(), bound.Units/1_000_000, limit)
	fmt.Fprintf(out, "  the bound (limitmesh policy explain): %s\n", bound.Arithmetic)
	if float64(admitted) > limit {
		return errors.New("the leased limit admitted more than its contract plus its bound: this is a bug")
	}
	return nil
}
