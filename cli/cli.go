// Package cli implements the limitmesh command: serve, decide, the
// reservation commands (reserve, settle, release, renew), policy, usage,
// demo, bench, auth and shadow. cmd/limitmesh is a thin main around [Main].
//
// Every flag of every subcommand can also be set with an environment variable
// LIMITMESH_<FLAG> (upper case, dashes as underscores, e.g. --nats-url is
// LIMITMESH_NATS_URL); a flag on the command line wins over its variable.
package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"

	"github.com/limitmesh/limitmesh/mesh"
)

// Version is the limitmesh release (the node's micro service version).
const Version = mesh.Version

// env is the process environment as a lookup.
type env map[string]string

func parseEnv(environ []string) env {
	e := env{}
	for _, kv := range environ {
		if k, v, ok := strings.Cut(kv, "="); ok {
			e[k] = v
		}
	}
	return e
}

// io bundles a command's standard streams and environment.
type stdio struct {
	in       io.Reader
	out, err io.Writer
	env      env
}

// command is one subcommand.
type command struct {
	name    string
	summary string
	run     func(ctx context.Context, args []string, s stdio) error
}

func commands() []command {
	return []command{
		{"serve", "run a limitmesh node (embedded NATS unless --nats-url)", runServe},
		{"decide", "ask for one decision and print the reply", runDecide},
		{"reserve", "reserve units (decide's flags plus --ttl) and print the reply", runReserve},
		{"settle", "end a reservation keeping --cost units spent, giving the rest back", runSettle},
		{"release", "end a reservation giving all its units back", runRelease},
		{"renew", "extend an open reservation: it expires --ttl from now", runRenew},
		{"policy", "put, get, list, validate, history or roll back policies", runPolicy},
		{"usage", "print the usage ledger (report) or follow the usage stream (tail)", runUsage},
		{"demo", "the Acme story: one global limit against six local buckets", runDemo},
		{"bench", "drive a node or cluster with load and measure it against raw NATS", runBench},
		{"auth", "write a secured deployment (operator, accounts, creds) or add a tenant to one", runAuth},
		{"shadow", "report, promote or backtest shadow candidates", runShadow},
		{"version", "print the version", func(_ context.Context, _ []string, s stdio) error {
			fmt.Fprintln(s.out, "limitmesh", Version)
			return nil
		}},
	}
}

// exitError carries an exit code other than 1.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

// errUsage marks an error that was already reported with usage text.
var errUsage = errors.New("usage")

// Main runs the limitmesh command with args (without the program name) and
// returns the process exit code: 0 on success, 1 on failure, 2 on bad usage.
// Errors are printed to stderr as one line prefixed "limitmesh: ".
func Main(ctx context.Context, args, environ []string, stdin io.Reader, stdout, stderr io.Writer) int {
	s := stdio{in: stdin, out: stdout, err: stderr, env: parseEnv(environ)}
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		usage(stderr)
		if len(args) == 0 {
			return 2
		}
		return 0
	}
	for _, c := range commands() {
		if c.name != args[0] {
			continue
		}
		err := c.run(ctx, args[1:], s)
		switch {
		case err == nil:
			return 0
		case errors.Is(err, flag.ErrHelp):
			return 0
		case errors.Is(err, errUsage):
			return 2
		}
		fmt.Fprintf(stderr, "limitmesh %s: %v\n", c.name, err)
		var ee *exitError
		if errors.As(err, &ee) {
			return ee.code
		}
		return 1
	}
	fmt.Fprintf(stderr, "limitmesh: unknown command %q\n", args[0])
	usage(stderr)
	return 2
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "usage: limitmesh <command> [flags]")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "commands:")
	for _, c := range commands() {
		fmt.Fprintf(w, "  %-8s %s\n", c.name, c.summary)
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Run 'limitmesh <command> -h' for its flags. Every flag can also be set")
	fmt.Fprintln(w, "with LIMITMESH_<FLAG>, e.g. LIMITMESH_NATS_URL for --nats-url.")
}

// newFlags returns a flag set for a subcommand that prints its errors and
// usage to s.err.
func newFlags(name string, s stdio) *flag.FlagSet {
	fs := flag.NewFlagSet("limitmesh "+name, flag.ContinueOnError)
	fs.SetOutput(s.err)
	return fs
}

// parseFlags parses args, then fills every flag not given on the command line
// from its LIMITMESH_<FLAG> environment variable. A bad value, from either
// place, is reported in one line and is a usage error.
func parseFlags(fs *flag.FlagSet, args []string, s stdio) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return errUsage
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	var bad error
	fs.VisitAll(func(f *flag.Flag) {
		if set[f.Name] || bad != nil {
			return
		}
		name := EnvName(f.Name)
		v, ok := s.env[name]
		if !ok {
			return
		}
		if err := fs.Set(f.Name, v); err != nil {
			bad = fmt.Errorf("invalid value %q for %s: %v", v, name, err)
		}
	})
	if bad != nil {
		fmt.Fprintf(s.err, "%s: %v\n", fs.Name(), bad)
		return errUsage
	}
	return nil
}

// EnvName is the environment variable that sets flag name:
// "nats-url" -> "LIMITMESH_NATS_URL".
func EnvName(flagName string) string {
	return "LIMITMESH_" + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

// listFlag is a repeatable or comma-separated string flag.
type listFlag []string

func (l *listFlag) String() string { return strings.Join(*l, ",") }

func (l *listFlag) Set(v string) error {
	for _, p := range strings.Split(v, ",") {
		if p = strings.TrimSpace(p); p != "" {
			*l = append(*l, p)
		}
	}
	return nil
}

// multiFlag is a repeatable string flag whose values are kept whole (a
// descriptor value may hold commas).
type multiFlag []string

func (m *multiFlag) String() string { return strings.Join(*m, " ") }

func (m *multiFlag) Set(v string) error {
	*m = append(*m, v)
	return nil
}

// subcommand runs the subcommand of sub that args[0] names with the rest
// of args, or prints usage (one line each) and returns errUsage.
func subcommand(ctx context.Context, args []string, s stdio, sub map[string]func(context.Context, []string, stdio) error, usage ...string) error {
	if len(args) == 0 || sub[args[0]] == nil {
		for _, l := range usage {
			fmt.Fprintln(s.err, l)
		}
		return errUsage
	}
	return sub[args[0]](ctx, args[1:], s)
}
