package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/limitmesh/limitmesh/auth"
	"github.com/limitmesh/limitmesh/cli/internal/clitext"
)

func runAuth(ctx context.Context, args []string, s stdio) error {
	sub := map[string]func(context.Context, []string, stdio) error{
		"init":       authInit,
		"add-tenant": authAddTenant,
		"push":       authPush,

		"nats-config": authNATSConfig, // auth_nats_config.go
	}
	if len(args) == 0 || sub[args[0]] == nil {
		authUsage(s.err)
		return errUsage
	}
	err := sub[args[0]](ctx, args[1:], s)
	if err == nil || errors.Is(err, errUsage) || errors.Is(err, flag.ErrHelp) {
		return err
	}
	// The command's name already says where the error comes from.
	return errors.New(strings.TrimPrefix(err.Error(), "auth: "))
}

func authUsage(w io.Writer) {
	fmt.Fprintln(w, "usage: limitmesh auth init DIR [--tenants acme,birch] [--prefix rl] [--force]")
	fmt.Fprintln(w, "       limitmesh auth add-tenant DIR NAME [--nats-url URL] [--no-push]")
	fmt.Fprintln(w, "       limitmesh auth push DIR [--nats-url URL]")
	fmt.Fprintln(w, "       limitmesh auth nats-config DIR [--resolver-dir /data/jwt]")
}

// parseArgs parses flags that may come before, between or after the
// positional arguments (`auth init DIR --tenants a,b`), then fills unset
// flags from their environment variables, and returns the positional
// arguments.
func parseArgs(fs *flag.FlagSet, args []string, s stdio) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, err
			}
			return nil, errUsage
		}
		if fs.NArg() == 0 {
			break
		}
		pos = append(pos, fs.Arg(0))
		args = fs.Args()[1:]
	}
	if err := parseFlags(fs, nil, s); err != nil {
		return nil, err
	}
	return pos, nil
}

func authInit(_ context.Context, args []string, s stdio) error {
	var (
		tenants listFlag
		o       auth.InitOptions
	)
	fs := newFlags("auth init", s)
	fs.Var(&tenants, "tenants", "comma-separated tenant names, one account each ("+auth.TenantNamePattern+")")
	fs.StringVar(&o.Prefix, "prefix", "rl", "subject prefix of the decide service the tenants import")
	fs.BoolVar(&o.Force, "force", false, "replace the deployment already in DIR")
	fs.BoolVar(&o.ShareIdentity, "share-identity", false, "tenant imports share the caller's whole identity (user, connection name, tags, user JWT) in Nats-Request-Info, not only its account")
	fs.Usage = func() { authUsage(s.err); fs.PrintDefaults() }
	pos, err := parseArgs(fs, args, s)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		fs.Usage()
		return errUsage
	}
	o.Tenants = tenants
	d, err := auth.Init(pos[0], o)
	if err != nil {
		return err
	}
	fmt.Fprintf(s.out, "wrote a secured deployment to %s (prefix %s); keep the directory private: keys/ and the .creds files are secrets\n", d.Dir, d.Prefix)
	fmt.Fprintf(s.out, "operator          %s  %s\n", d.Operator.Subject, filepath.Join(d.Dir, auth.OperatorJWTFile))
	fmt.Fprintf(s.out, "account SYS       %s  %s (pushes account updates)\n", d.SystemAccount, d.SystemCreds())
	fmt.Fprintf(s.out, "account LIMITER   %s  %s (limitmesh serve), %s (nats, limitmesh commands)\n", d.LimiterAccount, d.NodeCreds(), d.AdminCreds())
	for _, t := range d.TenantNames() {
		printTenant(s.out, d, t)
	}
	fmt.Fprintf(s.out, "next: limitmesh serve --auth %s\n", d.Dir)
	return nil
}

func printTenant(w io.Writer, d *auth.Deployment, name string) {
	fmt.Fprintf(w, "tenant %-10s %s  %s\n", name, d.Tenants[name], d.TenantCreds(name))
}

// pushFlags are the flags of the auth commands that reach a running server
// (as the system user of DIR).
type pushFlags struct {
	natsURL string
	timeout time.Duration
}

func (p *pushFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&p.natsURL, "nats-url", nats.DefaultURL, "NATS URL of the running deployment")
	fs.DurationVar(&p.timeout, "timeout", 5*time.Second, "how long to wait for NATS")
}

// push gives the running servers the accounts of d named by pubs, as d's
// system user.
func (p *pushFlags) push(ctx context.Context, d *auth.Deployment, pubs ...string) error {
	nc, err := connectNATS(p.natsURL, "limitmesh-auth", d.SystemCreds(), p.timeout)
	if err != nil {
		return err
	}
	defer nc.Close()
	for _, pub := range pubs {
		j, _ := d.AccountJWT(pub)
		pctx, cancel := context.WithTimeout(ctx, p.timeout)
		err := auth.PushAccount(pctx, nc, j)
		cancel()
		if err != nil {
			return fmt.Errorf("account %s: %v", pub, err)
		}
	}
	return nil
}

func authAddTenant(ctx context.Context, args []string, s stdio) error {
	var (
		pf     pushFlags
		noPush bool
	)
	fs := newFlags("auth add-tenant", s)
	pf.register(fs)
	fs.BoolVar(&noPush, "no-push", false, "only write the files (a server started later loads them)")
	fs.Usage = func() { authUsage(s.err); fs.PrintDefaults() }
	pos, err := parseArgs(fs, args, s)
	if err != nil {
		return err
	}
	if len(pos) != 2 {
		fs.Usage()
		return errUsage
	}
	d, _, err := auth.AddTenant(pos[0], pos[1])
	if err != nil {
		return err
	}
	name := pos[1]
	printTenant(s.out, d, name)
	if noPush {
		return nil
	}
	if err := pf.push(ctx, d, d.Tenants[name]); err != nil {
		return fmt.Errorf("tenant %s is written to %s but the running server did not take it (%v): "+
			"run `limitmesh auth push %s` when it is reachable, or restart it", name, d.Dir, err, d.Dir)
	}
	fmt.Fprintf(s.out, "pushed to %s: tenant %s can connect now\n", clitext.RedactURL(pf.natsURL), name)
	return nil
}

func authPush(ctx context.Context, args []string, s stdio) error {
	var pf pushFlags
	fs := newFlags("auth push", s)
	pf.register(fs)
	fs.Usage = func() { authUsage(s.err); fs.PrintDefaults() }
	pos, err := parseArgs(fs, args, s)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		fs.Usage()
		return errUsage
	}
	d, err := auth.Load(pos[0])
	if err != nil {
		return err
	}
	pubs := []string{d.LimiterAccount}
	for _, t := range d.TenantNames() {
		pubs = append(pubs, d.Tenants[t])
	}
	if err := pf.push(ctx, d, pubs...); err != nil {
		return err
	}
	fmt.Fprintf(s.out, "pushed %d accounts (LIMITER and %d tenants) to %s\n", len(pubs), len(pubs)-1, clitext.RedactURL(pf.natsURL))
	return nil
}
