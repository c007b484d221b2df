package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh"
	"github.com/limitmesh/limitmesh/policies"
)

func runPolicy(ctx context.Context, args []string, s stdio) error {
	sub := map[string]func(context.Context, []string, stdio) error{
		"put":      policyPut,
		"get":      policyGet,
		"list":     policyList,
		"validate": policyValidate,
		"history":  policyHistory,
		"rollback": policyRollback,
		"explain":  policyExplain,

		"import-envoy": policyImportEnvoy, // offline, policy_envoy.go
	}
	return subcommand(ctx, args, s, sub,
		"usage: limitmesh policy put NAME FILE|-",
		"       limitmesh policy get NAME [--revision N]",
		"       limitmesh policy list",
		"       limitmesh policy validate FILE [--name NAME]",
		"       limitmesh policy history NAME",
		"       limitmesh policy rollback NAME",
		"       limitmesh policy explain NAME [--nodes N] [--file FILE]",
		"       limitmesh policy import-envoy FILE|DIR... [--json] [--dir DIR]",
	)
}

// policyKV is the policy bucket of a running installation, with the
// JetStream context it was opened from (to list its keys, see
// [kvstate.Keys]).
type policyKV struct {
	jetstream.KeyValue
	js jetstream.JetStream
}

// keys returns the bucket's keys.
func (b policyKV) keys(ctx context.Context) ([]string, error) {
	return kvstate.Keys(ctx, b.js, b.Bucket(), "")
}

// policyBucket opens the policy bucket of a running installation.
func policyBucket(ctx context.Context, cf *clientFlags) (policyKV, func(), error) {
	nc, js, err := cf.connectJS()
	if err != nil {
		return policyKV{}, nil, err
	}
	name := cf.prefix + "_policies"
	kv, err := js.KeyValue(ctx, name)
	if err != nil {
		nc.Close()
		if errors.Is(err, jetstream.ErrBucketNotFound) {
			return policyKV{}, nil, fmt.Errorf("bucket %s does not exist: start a node first (limitmesh serve)", name)
		}
		return policyKV{}, nil, fmt.Errorf("open bucket %s: %v", name, err)
	}
	return policyKV{kv, js}, nc.Close, nil
}

// withBucket parses the client flags of a policy subcommand, checks that it got
// exactly nargs positional arguments and runs fn with the open bucket.
func withBucket(ctx context.Context, name string, args []string, nargs int, s stdio,
	extra func(fsAdder), fn func(ctx context.Context, kv policyKV, args []string) error) error {
	var cf clientFlags
	fs := newFlags("policy "+name, s)
	cf.register(fs)
	if extra != nil {
		extra(fs)
	}
	if err := parseFlags(fs, interspersed(args), s); err != nil {
		return err
	}
	if fs.NArg() != nargs {
		fmt.Fprintf(s.err, "limitmesh policy %s: want %d argument(s), got %d\n", name, nargs, fs.NArg())
		return errUsage
	}
	ctx, cancel := context.WithTimeout(ctx, cf.timeout)
	defer cancel()
	kv, closeFn, err := policyBucket(ctx, &cf)
	if err != nil {
		return err
	}
	defer closeFn()
	return fn(ctx, kv, fs.Args())
}

// fsAdder is the part of flag.FlagSet that subcommands add flags with.
type fsAdder interface {
	Uint64Var(*uint64, string, uint64, string)
	BoolVar(*bool, string, bool, string)
	StringVar(*string, string, string, string)
}

// interspersed moves flags after positional arguments to the front, so that
// `policy get NAME --revision 3` works like `policy get --revision 3 NAME`.
func interspersed(args []string) []string {
	var flags, pos []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		switch {
		case a == "--":
			pos = append(pos, args[i+1:]...)
			i = len(args)
		case strings.HasPrefix(a, "-") && a != "-":
			flags = append(flags, a)
			if !strings.Contains(a, "=") && i+1 < len(args) && !isBoolFlag(a) {
				flags = append(flags, args[i+1])
				i++
			}
		default:
			pos = append(pos, a)
		}
	}
	return append(flags, pos...)
}

func isBoolFlag(a string) bool {
	switch strings.TrimLeft(a, "-") {
	case "force", "h", "help":
		return true
	}
	return false
}

func readDoc(path string, in io.Reader) ([]byte, error) {
	if path == "-" {
		return io.ReadAll(io.LimitReader(in, 1<<20))
	}
	return os.ReadFile(path)
}

func policyPut(ctx context.Context, args []string, s stdio) error {
	var force bool
	return withBucket(ctx, "put", args, 2, s, func(fs fsAdder) {
		fs.BoolVar(&force, "force", false, "put even if this command's validation rejects the policy")
	}, func(ctx context.Context, kv policyKV, args []string) error {
		name := args[0]
		doc, err := readDoc(args[1], s.in)
		if err != nil {
			return err
		}
		if _, err := mesh.ParsePolicy(name, doc); err != nil && !force {
			return fmt.Errorf("not put: %v", err)
		}
		rev, err := kv.Put(ctx, name, doc)
		if err != nil {
			return fmt.Errorf("put %s: %v", name, err)
		}
		fmt.Fprintf(s.out, "put %s at revision %d\n", name, rev)
		return nil
	})
}

func policyGet(ctx context.Context, args []string, s stdio) error {
	var revision uint64
	return withBucket(ctx, "get", args, 1, s, func(fs fsAdder) {
		fs.Uint64Var(&revision, "revision", 0, "a past revision instead of the current one")
	}, func(ctx context.Context, kv policyKV, args []string) error {
		var (
			e   jetstream.KeyValueEntry
			err error
		)
		if revision > 0 {
			e, err = kv.GetRevision(ctx, args[0], revision)
		} else {
			e, err = kv.Get(ctx, args[0])
		}
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			return fmt.Errorf("no policy %q", args[0])
		} else if err != nil {
			return err
		}
		fmt.Fprintf(s.err, "# %s revision %d, %s\n", e.Key(), e.Revision(), e.Created().UTC().Format(time.RFC3339))
		fmt.Fprintln(s.out, strings.TrimSpace(string(e.Value())))
		return nil
	})
}

func policyList(ctx context.Context, args []string, s stdio) error {
	return withBucket(ctx, "list", args, 0, s, nil, func(ctx context.Context, kv policyKV, _ []string) error {
		names, err := kv.keys(ctx)
		if err != nil {
			return err
		}
		tw := tabwriter.NewWriter(s.out, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "NAME\tREVISION\tSTATUS\tMODE\tLIMITS\tDESCRIPTION")
		for _, n := range names {
			e, err := kv.Get(ctx, n)
			if err != nil {
				continue // deleted meanwhile
			}
			p, err := mesh.ParsePolicy(n, e.Value())
			if err != nil {
				fmt.Fprintf(tw, "%s\t%d\tinvalid\t-\t-\t%s\n", n, e.Revision(), oneLine(err.Error(), 60))
				continue
			}
			fmt.Fprintf(tw, "%s\t%d\tvalid\t%s\t%s\t%s\n", n, e.Revision(), p.Mode, limitsSummary(p), oneLine(p.Description, 40))
		}
		return tw.Flush()
	})
}

func policyValidate(_ context.Context, args []string, s stdio) error {
	var name string
	fs := newFlags("policy validate", s)
	fs.StringVar(&name, "name", "", "policy name (default: the file name without its extension)")
	if err := parseFlags(fs, interspersed(args), s); err != nil {
		return err
	}
	if fs.NArg() != 1 {
		fmt.Fprintln(s.err, "usage: limitmesh policy validate FILE [--name NAME]")
		return errUsage
	}
	path := fs.Arg(0)
	if name == "" {
		name = strings.TrimSuffix(filepath.Base(path), filepath.Ext(path))
		if path == "-" {
			name = "stdin"
		}
	}
	doc, err := readDoc(path, s.in)
	if err != nil {
		return err
	}
	p, err := mesh.ParsePolicy(name, doc)
	if err != nil {
		return fmt.Errorf("invalid: %v", err)
	}
	fmt.Fprintf(s.out, "valid: %s (%s; %s)\n", name, p.Mode, limitsSummary(p))
	return nil
}

func policyHistory(ctx context.Context, args []string, s stdio) error {
	return withBucket(ctx, "history", args, 1, s, nil, func(ctx context.Context, kv policyKV, args []string) error {
		entries, err := kv.History(ctx, args[0])
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			return fmt.Errorf("no history for %q", args[0])
		} else if err != nil {
			return err
		}
		tw := tabwriter.NewWriter(s.out, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "REVISION\tCREATED\tOPERATION\tSTATUS")
		for _, e := range entries {
			status := "-"
			if e.Operation() == jetstream.KeyValuePut {
				status = "valid"
				if _, err := mesh.ParsePolicy(e.Key(), e.Value()); err != nil {
					status = "invalid: " + oneLine(err.Error(), 70)
				}
			}
			fmt.Fprintf(tw, "%d\t%s\t%s\t%s\n", e.Revision(), e.Created().UTC().Format(time.RFC3339), e.Operation(), status)
		}
		return tw.Flush()
	})
}

func policyRollback(ctx context.Context, args []string, s stdio) error {
	return withBucket(ctx, "rollback", args, 1, s, nil, func(ctx context.Context, kv policyKV, args []string) error {
		name := args[0]
		entries, err := kv.History(ctx, name)
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			return fmt.Errorf("no history for %q", name)
		} else if err != nil {
			return err
		}
		current := entries[len(entries)-1]
		target := rollbackTarget(entries)
		if target == nil {
			return fmt.Errorf("no earlier valid revision of %q in the bucket's history", name)
		}
		rev, err := kv.Update(ctx, name, target.Value(), current.Revision())
		if errors.Is(err, jetstream.ErrKeyExists) || errors.Is(err, jetstream.ErrKeyRevisionMismatch) {
			return fmt.Errorf("%q changed while rolling back; nothing written, try again", name)
		} else if err != nil {
			return err
		}
		fmt.Fprintf(s.out, "rolled back %s to the value of revision %d (now revision %d)\n", name, target.Revision(), rev)
		return nil
	})
}

// rollbackTarget is the newest PUT before the current entry whose value is a
// valid policy and differs from the current value; nil if there is none.
func rollbackTarget(entries []jetstream.KeyValueEntry) jetstream.KeyValueEntry {
	if len(entries) < 2 {
		return nil
	}
	current := entries[len(entries)-1]
	for i := len(entries) - 2; i >= 0; i-- {
		e := entries[i]
		if e.Operation() != jetstream.KeyValuePut {
			continue
		}
		if current.Operation() == jetstream.KeyValuePut && string(e.Value()) == string(current.Value()) {
			continue
		}
		if _, err := mesh.ParsePolicy(e.Key(), e.Value()); err == nil {
			return e
		}
	}
	return nil
}

func limitsSummary(p *policies.Policy) string {
	parts := make([]string, 0, len(p.Limits))
	for _, l := range p.Limits {
		parts = append(parts, l.Name)
	}
	return strings.Join(parts, ",")
}

func oneLine(s string, max int) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > max {
		s = s[:max-1] + "…"
	}
	return s
}

// policyExplain prints a policy's mode, its limits and the overshoot bound
// of its mode per limit key as a number of units for --nodes nodes, with
// the arithmetic (mesh.OvershootBound). The policy comes from the policy
// bucket, or from --file offline.
func policyExplain(ctx context.Context, args []string, s stdio) error {
	var (
		cf       clientFlags
		file     string
		nodes    int
		interval time.Duration
		wtimeout time.Duration
	)
	fs := newFlags("policy explain", s)
	cf.register(fs)
	fs.StringVar(&file, "file", "", "read the policy from FILE (- for stdin) instead of the bucket")
	fs.IntVar(&nodes, "nodes", 1, "number of nodes serving the policy")
	fs.DurationVar(&interval, "async-interval", mesh.DefaultAsyncInterval, "the nodes' async write-behind interval")
	fs.DurationVar(&wtimeout, "decision-timeout", mesh.DefaultDecisionTimeout, "the nodes' decision timeout (bounds a state write)")
	var descriptor string
	fs.StringVar(&descriptor, "descriptor", "", "name=value,name=value: list the layers and policies this descriptor meets (CONTRACT §11) instead of one policy")
	if err := parseFlags(fs, interspersed(args), s); err != nil {
		return err
	}
	if descriptor != "" && fs.NArg() == 0 {
		return explainDescriptor(ctx, &cf, descriptor, mesh.BoundParams{Nodes: nodes, AsyncInterval: interval, WriteTimeout: wtimeout}, s)
	}
	if fs.NArg() != 1 {
		fmt.Fprintln(s.err, "usage: limitmesh policy explain NAME [--nodes N] [--file FILE] | --descriptor name=value,...")
		return errUsage
	}
	if nodes < 1 {
		fmt.Fprintf(s.err, "limitmesh policy explain: --nodes %d: want at least 1\n", nodes)
		return errUsage
	}
	name := fs.Arg(0)
	var (
		doc []byte
		rev uint64
		err error
	)
	if file != "" {
		if doc, err = readDoc(file, s.in); err != nil {
			return err
		}
	} else {
		ctx, cancel := context.WithTimeout(ctx, cf.timeout)
		defer cancel()
		kv, closeFn, err := policyBucket(ctx, &cf)
		if err != nil {
			return err
		}
		defer closeFn()
		e, err := kv.Get(ctx, name)
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			return fmt.Errorf("no policy %q", name)
		} else if err != nil {
			return err
		}
		doc, rev = e.Value(), e.Revision()
	}
	p, err := mesh.ParsePolicy(name, doc)
	if err != nil {
		return fmt.Errorf("invalid: %v", err)
	}
	b, err := mesh.OvershootBound(p, mesh.BoundParams{Nodes: nodes, AsyncInterval: interval, WriteTimeout: wtimeout})
	if err != nil {
		return err
	}
	writeExplain(s.out, p, rev, nodes, b)
	return nil
}

// explainDescriptor prints the layers a descriptor meets, each with its
// policy and that policy's explanation, and the bound a request of it is
// decided within: the largest of theirs (CONTRACT §11).
func explainDescriptor(ctx context.Context, cf *clientFlags, text string, bp mesh.BoundParams, s stdio) error {
	var dims []policies.Dim
	for _, kv := range strings.Split(text, ",") {
		name, value, ok := strings.Cut(kv, "=")
		if !ok {
			return fmt.Errorf("--descriptor: %q is not name=value", kv)
		}
		dims = append(dims, policies.Dim{Name: name, Value: value})
	}
	d, err := policies.NewDescriptor(dims)
	if err != nil {
		return fmt.Errorf("--descriptor: %v", err)
	}
	ctx, cancel := context.WithTimeout(ctx, cf.timeout)
	defer cancel()
	kv, closeFn, err := policyBucket(ctx, cf)
	if err != nil {
		return err
	}
	defer closeFn()
	names, err := kv.keys(ctx)
	if err != nil {
		return err
	}
	var live []*policies.Policy
	for _, name := range names {
		e, err := kv.Get(ctx, name)
		if err != nil {
			continue // deleted meanwhile
		}
		p, err := mesh.ParsePolicy(name, e.Value())
		if err != nil || p.Shadow {
			continue // invalid ones are not in force; candidates never decide
		}
		p.Revision = e.Revision()
		live = append(live, p)
	}
	ps := policies.NewSnapshot(live).MatchLayers(d, nil)
	if len(ps) == 0 {
		fmt.Fprintln(s.out, "no policy matches: the descriptor is not limited")
		return nil
	}
	fmt.Fprintf(s.out, "descriptor %s meets %d layer(s): admitted only if every layer admits, spending in all or none\n", text, len(ps))
	var worst int64
	worstOf := ""
	for _, p := range ps {
		layer := p.Layer
		if layer == "" {
			layer = `""`
		}
		b, err := mesh.OvershootBound(p, bp)
		if err != nil {
			return err
		}
		fmt.Fprintf(s.out, "\nlayer %s: ", layer)
		writeExplain(s.out, p, p.Revision, max(bp.Nodes, 1), b)
		for _, l := range b.Limits {
			if l.Units > worst {
				worst, worstOf = l.Units, p.Name+"/"+l.Name
			}
		}
	}
	if len(ps) > 1 {
		fmt.Fprintln(s.out)
		if worst == 0 {
			fmt.Fprintln(s.out, "decided within the largest bound of its layers: 0 units (every layer strict)")
		} else {
			fmt.Fprintf(s.out, "decided within the largest bound of its layers: %s units (%s)\n", formatUnits(worst), worstOf)
		}
	}
	return nil
}

// writeExplain prints what policyExplain reports.
func writeExplain(w io.Writer, p *policies.Policy, rev uint64, nodes int, b mesh.Bound) {
	fmt.Fprintf(w, "policy %s", p.Name)
	if rev > 0 {
		fmt.Fprintf(w, " (revision %d)", rev)
	}
	fmt.Fprintf(w, ": mode %s", p.Mode)
	if p.Layer != "" {
		fmt.Fprintf(w, ", layer %s", p.Layer)
	}
	if p.Shadow {
		fmt.Fprint(w, ", shadow (never denies)")
	}
	fmt.Fprintln(w)
	for _, l := range p.Limits {
		fmt.Fprintf(w, "  limit %s: %s\n", l.Name, mesh.FormatLimit(l.Limit))
	}
	if p.Mode == policies.ModeLeased {
		fmt.Fprintf(w, "  lease: grants of up to %s units, ttl %s (holders stop %s early: the skew margin), at most %s units outstanding per key\n",
			formatUnits(p.Lease.Size), p.Lease.TTL, mesh.LeaseSkewMargin(p.Lease.TTL), formatUnits(p.Lease.MaxOutstanding))
	}
	nodeWord := "nodes"
	if nodes == 1 {
		nodeWord = "node"
	}
	fmt.Fprintf(w, "overshoot bound per limit key with %d %s (units admitted beyond the limit at most):\n", nodes, nodeWord)
	for _, l := range b.Limits {
		per := ""
		if l.Per != "" {
			per = " per " + l.Per
		}
		fmt.Fprintf(w, "  %s: %s: %s units%s\n", b.Mode, l.Name, l.Arithmetic, per)
	}
	switch b.Mode {
	case policies.ModeStrict:
		fmt.Fprintln(w, "  (strict: every admission is written with compare-and-swap before the reply)")
	case policies.ModeAsync:
		fmt.Fprintln(w, "  (async: per owner crash or lost write of a key: burst + rate × (interval + write timeout); windows: limit)")
	case policies.ModeLocal:
		fmt.Fprintln(w, "  (local: each node enforces the whole limit alone: (nodes − 1) × burst; windows: (nodes − 1) × limit)")
	case policies.ModeLeased:
		fmt.Fprintln(w, "  (leased: units granted to holders and neither spent, returned nor expired, whatever the number of nodes and gateways:")
		for _, l := range p.Limits {
			fmt.Fprintf(w, "   %s: %s)\n", l.Name, mesh.LeaseContract(l.Limit, p.Lease.MaxOutstanding))
		}
	}
	writeReservations(w, p)
}

// writeReservations prints how p behaves under reservations (CONTRACT §10).
func writeReservations(w io.Writer, p *policies.Policy) {
	if p.Mode == policies.ModeLocal {
		fmt.Fprintln(w, "reservations: none (a local policy is decided by each node alone; rl.v1.reserve refuses it)")
		return
	}
	ttl := p.ReservationTTL(policies.MaxReservationTTL)
	if p.ReservedOnly() {
		fmt.Fprintln(w, "reservations: only reserved: a concurrency limit's units are held until settled, released or expired,")
		fmt.Fprintln(w, "  so rl.v1.decide refuses this policy (400) and callers use rl.v1.reserve")
	} else {
		fmt.Fprintln(w, "reservations: rl.v1.reserve holds the cost in every limit until the reservation ends")
	}
	fmt.Fprintf(w, "  ttl: %s unless the request names one, at most %s; rl.v1.renew extends it\n", policies.DefaultReservationTTL, ttl)
	fmt.Fprintln(w, "  written by the key's owner before the reply, whatever the mode: no overshoot from reservations")
	for _, l := range p.Limits {
		var how string
		switch l.Algorithm {
		case kvstate.Concurrency:
			how = "held while the reservation is open; settle, release or expiry gives the hold back (never with time)"
		case kvstate.TokenBucket, kvstate.GCRA:
			how = "settle keeps the settled units spent and gives the rest back, never more than the bucket would hold had they never been taken; expiry keeps the whole cost spent"
		case kvstate.SlidingLog:
			how = "settle shrinks the reservation's own log entry to the settled units; expiry keeps the whole cost"
		default:
			how = "settle gives the unused units back if the reservation was made in the current window (or period); expiry keeps the whole cost"
		}
		fmt.Fprintf(w, "  %s: %s\n", l.Name, how)
	}
}
