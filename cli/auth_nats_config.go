package cli

import (
	"context"
	"fmt"
	"io"
	"slices"
	"strconv"

	"github.com/limitmesh/limitmesh/auth"
)

// authNATSConfig prints the nats-server configuration of a secured
// deployment for servers that limitmesh does not embed (a NATS cluster of
// its own, deploy/kubernetes/secured): operator mode with the deployment's
// operator, SYS as the system account, the full NATS resolver and every
// account preloaded. It holds public data only (JWTs, public keys): it
// can live in a ConfigMap; the creds files stay secret.
func authNATSConfig(_ context.Context, args []string, s stdio) error {
	var dir string
	fs := newFlags("auth nats-config", s)
	fs.StringVar(&dir, "resolver-dir", "/data/jwt", "directory of the servers' account resolver (on their persistent volume)")
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
	writeNATSConfig(s.out, d, dir)
	return nil
}

// writeNATSConfig writes the operator-mode configuration of d (see
// authNATSConfig), for inclusion in a server's configuration file.
func writeNATSConfig(w io.Writer, d *auth.Deployment, resolverDir string) {
	q := strconv.Quote
	fmt.Fprintf(w, "# Operator mode for the limitmesh deployment %s (prefix %s), written by\n", d.Operator.Subject, d.Prefix)
	fmt.Fprintln(w, "# `limitmesh auth nats-config`: public JWTs and keys only. Include it in the")
	fmt.Fprintln(w, "# configuration of every server of the cluster (include auth.conf).")
	fmt.Fprintf(w, "operator: %s\n", q(d.OperatorJWT))
	fmt.Fprintf(w, "system_account: %s\n", q(d.SystemAccount))
	fmt.Fprintln(w, "resolver {")
	fmt.Fprintln(w, "  type: full")
	fmt.Fprintf(w, "  dir: %s\n", q(resolverDir))
	fmt.Fprintln(w, "  allow_delete: false")
	fmt.Fprintln(w, `  interval: "2m"`)
	fmt.Fprintln(w, "}")
	fmt.Fprintln(w, "# SYS, LIMITER and every tenant's account; tenants added later reach the")
	fmt.Fprintln(w, "# running servers with `limitmesh auth add-tenant` (or auth push).")
	fmt.Fprintln(w, "resolver_preload {")
	jwts := d.AccountJWTs()
	pubs := make([]string, 0, len(jwts))
	for p := range jwts {
		pubs = append(pubs, p)
	}
	slices.Sort(pubs)
	for _, p := range pubs {
		fmt.Fprintf(w, "  %s: %s\n", q(p), q(jwts[p]))
	}
	fmt.Fprintln(w, "}")
}
