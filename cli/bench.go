package cli

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/limitmesh/limitmesh/cli/internal/bench"
	"github.com/limitmesh/limitmesh/cli/internal/clitext"
	"github.com/limitmesh/limitmesh/mesh"
)

// `limitmesh bench` drives a node (or a cluster) with load and measures it
// against raw NATS request-reply in the same run: the harness is package
// bench (cli/internal/bench, whose doc says how a run is made and what
// its figures mean); this file is its flags, bench_report.go its output
// and its verdict.

// benchCommand is what `limitmesh bench` takes from its flags: the run's
// Config and the output's options.
type benchCommand struct {
	cfg        bench.Config
	cf         clientFlags
	external   bool // --nats-url given
	metricsURL string
	jsonOut    bool
	quiet      bool
}

// reserveFlagNames are the flags only the reserve modes take.
var reserveFlagNames = []string{"ttl", "leak-wait", "hold", "slots", "random-cost", "abandon", "metrics-url"}

func benchFlags(s stdio) (*benchCommand, func([]string) error) {
	b := &benchCommand{}
	c := &b.cfg
	fs := newFlags("bench", s)
	b.cf.register(fs)
	fs.DurationVar(&c.Duration, "duration", 10*time.Second, "length of the decide phase")
	fs.DurationVar(&c.EchoDuration, "echo-duration", 0, "length of the raw NATS echo phase (default: --duration)")
	fs.IntVar(&c.Rounds, "rounds", 5, "alternating slices each phase is split into, echo first (1: echo, then decide)")
	fs.IntVar(&c.Concurrency, "concurrency", 64, "requests in flight")
	fs.IntVar(&c.Conns, "conns", 4, "NATS connections the requests are spread over")
	fs.IntVar(&c.Keys, "keys", 10000, "distinct limit keys (1: a single hot key)")
	fs.Float64Var(&c.Zipf, "zipf", 1.1, "Zipf exponent of the key popularity (0: uniform)")
	fs.Uint64Var(&c.Seed, "seed", 1, "seed of the key sequence")
	fs.StringVar(&c.Cost, "cost", "1", "cost of each request (decimal)")
	fs.StringVar((*string)(&c.Mode), "mode", string(bench.Strict), "policy mode: strict, async, local or leased; or reserve (reserve and settle) or concurrency (acquire and release)")
	fs.IntVar(&c.Holders, "holders", 6, "leased: SDK holders (gateways) in this process")
	fs.IntVar(&c.Regions, "regions", 1, "leased: regions of the embedded supercluster the holders are spread over (without --nats-url)")
	fs.DurationVar(&c.Shift, "shift", 2*time.Second, "leased: demand moves between the holders every D (0: every holder busy all along)")
	fs.StringVar(&c.Rate, "rate", "1000/s", "token_bucket rate of each key (N/s, N/m, N/h or N/d)")
	fs.StringVar(&c.Burst, "burst", "100", "token_bucket burst of each key")
	fs.BoolVar(&b.jsonOut, "json", false, "print the results as one JSON object on the last line")
	fs.IntVar(&c.Candidates, "candidates", 0, "shadow candidates to put on the run's descriptors; the shadow evaluation's lag is reported")
	fs.BoolVar(&b.quiet, "quiet", false, "no progress lines on stderr")
	fs.BoolVar(&c.Verbose, "v", false, "log what the embedded node does")
	fs.Int64Var(&c.MaxKeys, "max-keys", 0, "max_keys of the bench policy: live keys per node beyond which new keys share one overflow key (0: the default)")
	fs.Float64Var(&c.Flood.Factor, "flood", 0, "offer a flood of F times the flood tenant's capacity (--flood-rate) on its one key, next to the measured load (0: none)")
	fs.StringVar(&c.Flood.Rate, "flood-rate", "1000/s", "token_bucket rate of the flood tenant's key (its capacity)")
	fs.StringVar(&c.Flood.Burst, "flood-burst", "100", "token_bucket burst of the flood tenant's key")
	fs.DurationVar(&c.Reserve.TTL, "ttl", 2*time.Second, "reserve, concurrency: the reservations' ttl")
	fs.DurationVar(&c.Reserve.LeakWait, "leak-wait", 0, "reserve, concurrency: how long to wait after the run for every key to be full again and no reservation open "+
		"(default: --ttl, or a reserve key's time to fill up if longer, plus 2s)")
	fs.DurationVar(&c.Reserve.Hold, "hold", 2*time.Millisecond, "concurrency: the longest a worker holds a slot (each hold is uniform in 0..--hold)")
	fs.StringVar(&c.Reserve.Slots, "slots", "", "concurrency: units each key may hold at once (default: --concurrency / --keys / 2, at least 1)")
	fs.BoolVar(&c.Reserve.RandomCost, "random-cost", false, "reserve, concurrency: each reserve's cost is uniform in 0.000001..--cost")
	fs.Float64Var(&c.Reserve.Abandon, "abandon", 0, "reserve, concurrency: the fraction of admitted reservations a worker never settles or releases (they expire after --ttl)")
	fs.StringVar(&b.metricsURL, "metrics-url", "", "reserve, concurrency: with --nats-url, the nodes' /metrics URLs (comma-separated) to read limitmesh_reservations_open from")
	fs.StringVar(&c.RLS.Addr, "rls", "", "host:port of a server of Envoy's rate limit API (gRPC ShouldRateLimit) to load instead of the decide service: "+
		"limitmesh's bridge (serve --envoy-listen) or envoyproxy/ratelimit; \""+bench.RLSEmbedded+"\": the embedded node's own bridge")
	fs.BoolVar(&c.RLS.Compare, "rls-compare", true, "with --rls: alternate with the decide phase over NATS against the bench's node (embedded, or --nats-url) and report rls/nats")
	fs.StringVar(&c.CPUProfile, "cpuprofile", "", "write a CPU profile of the decide phase (this process: the embedded node too) to `file`; "+
		"pprof cannot pause, so with --rounds > 1 it also covers the echo slices between the first and the last decide slice")
	fs.StringVar(&c.MemProfile, "memprofile", "", "write a heap profile (this process: the embedded node too) to `file` at the end of the decide phase")
	fs.BoolVar(&c.Usage, "usage", true, "the embedded node publishes usage records and keeps the ledger (false: usage off, to compare)")
	fs.StringVar(&c.Roles, "roles", "decide,ledger,shadow", "roles of the embedded node (serve --roles); decide alone measures what deciding and publishing usage cost without the ledger")
	fs.Usage = func() {
		fmt.Fprintln(s.err, "usage: limitmesh bench [--nats-url URL] [--duration 10s] [--concurrency 64] [--keys 10000] [--zipf 1.1] [--mode strict] [--json]")
		fmt.Fprintln(s.err, "       limitmesh bench --mode leased [--holders 6] [--regions 1] [--shift 2s] [...]")
		fmt.Fprintln(s.err, "       limitmesh bench --mode reserve|concurrency [--ttl 2s] [--random-cost] [--slots N] [--hold 2ms] [...]")
		fmt.Fprintln(s.err, "Without --nats-url, bench starts an embedded node in this process.")
		fs.PrintDefaults()
	}
	return b, func(args []string) error {
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
		b.external = set["nats-url"]
		if c.Mode == bench.Leased {
			// Leased mode measures utilization under demand above
			// capacity on a contiguous decide phase: one key and one
			// round unless asked otherwise.
			if !set["keys"] {
				c.Keys = 1
			}
			if !set["rounds"] {
				c.Rounds = 1
			}
		} else if set["holders"] || set["regions"] || set["shift"] {
			fmt.Fprintln(s.err, "limitmesh bench: --holders, --regions and --shift are for --mode leased")
			return errUsage
		}
		if !c.Mode.Reserves() {
			for _, name := range reserveFlagNames {
				if set[name] {
					fmt.Fprintf(s.err, "limitmesh bench: --%s is for --mode reserve and concurrency\n", name)
					return errUsage
				}
			}
		}
		if c.EchoDuration == 0 {
			c.EchoDuration = c.Duration
		}
		b.configure(s)
		if err := b.validate(); err != nil {
			fmt.Fprintf(s.err, "limitmesh bench: %v\n", err)
			return errUsage
		}
		return nil
	}
}

// configure completes the run's Config from the parsed flags: the
// deployment or the embedded parts, where progress and logs go.
func (b *benchCommand) configure(s stdio) {
	c := &b.cfg
	c.Prefix, c.Timeout = b.cf.prefix, b.cf.timeout
	if b.external {
		c.Dial = func(name string) (*nats.Conn, error) { return b.cf.dial(name) }
		c.Target = clitext.RedactURL(b.cf.natsURL)
	}
	for u := range strings.SplitSeq(b.metricsURL, ",") {
		if u = strings.TrimSpace(u); u != "" {
			c.Reserve.MetricsURLs = append(c.Reserve.MetricsURLs, u)
		}
	}
	c.Log = s.err
	if !b.quiet {
		c.Progress = s.err
	}
	c.StartRegions = func(ctx context.Context, n int, prefix string, log *slog.Logger) (bench.Regions, error) {
		er, err := startRegions(ctx, n, prefix, log)
		if err != nil {
			return bench.Regions{}, err
		}
		return bench.Regions{Names: er.names, Connect: er.connect, Stop: er.stop}, nil
	}
	c.StartBridge = func(l net.Listener, emb *mesh.Embedded, node *mesh.Node, prefix string, log *slog.Logger) (func(context.Context), error) {
		connect := func(name string) (*nats.Conn, error) { return emb.Connect(nats.Name(name)) }
		br, err := startEnvoy(l, connect, node, prefix, mesh.DefaultDecisionTimeout, nil, log)
		if err != nil {
			return nil, err
		}
		return func(ctx context.Context) { br.stop(ctx, log) }, nil
	}
}

// validate checks the flags: those only the command knows (the prefix,
// the regions, the RLS address), then the run's Config.
func (b *benchCommand) validate() error {
	c := &b.cfg
	if !prefixRE.MatchString(c.Prefix) {
		return fmt.Errorf("--prefix %q: must match %s", c.Prefix, prefixRE)
	}
	if c.Regions < 1 || c.Regions > len(regionNames) {
		return fmt.Errorf("--regions %d: must be 1..%d", c.Regions, len(regionNames))
	}
	if a := c.RLS.Addr; a != "" && a != bench.RLSEmbedded && !validHostPort(a) {
		return fmt.Errorf("--rls %q: want host:port or %q", a, bench.RLSEmbedded)
	}
	return c.Validate()
}

func runBench(ctx context.Context, args []string, s stdio) error {
	b, parse := benchFlags(s)
	if err := parse(args); err != nil {
		return err
	}
	if b.cfg.RLS.Addr != "" {
		rep, err := bench.RunRLS(ctx, b.cfg)
		if err != nil {
			return err
		}
		printRLSReport(s.out, rep, b.external)
		b.printJSON(s, rep)
		return rlsVerdict(&b.cfg, rep)
	}
	rep, err := bench.Run(ctx, b.cfg)
	if err != nil {
		return err
	}
	printReport(s.out, &b.cfg, rep, b.external)
	b.printJSON(s, rep)
	return verdict(&b.cfg, rep)
}

// printJSON prints rep as the --json line, when asked.
func (b *benchCommand) printJSON(s stdio, rep any) {
	if b.jsonOut {
		j, _ := json.Marshal(rep)
		fmt.Fprintln(s.out, string(j))
	}
}
