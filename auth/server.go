package auth

import (
	"errors"
	"fmt"
	"path/filepath"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
)

// ResolverDirName is the directory of the embedded server's account
// resolver, under its data directory (server.Options.StoreDir).
const ResolverDirName = "jwt"

// resolverSync is how often a server's resolver compares its accounts with
// the other servers' of its cluster.
const resolverSync = time.Minute

// Configure sets opts for operator mode with d: d's operator is the only
// trusted one, SYS is the system account, and the account resolver is the
// server's full NATS resolver, whose own directory is
// <opts.StoreDir>/jwt. Every account of d is stored there (a stored JWT
// newer than d's is kept), and the resolver accepts account updates signed
// by the operator, pushed through the system account ([PushAccount]), with
// no restart. opts.StoreDir must be set. It fits mesh.EmbeddedConfig's
// Configure hook.
func (d *Deployment) Configure(opts *server.Options) error {
	if opts.StoreDir == "" {
		return errors.New("auth: the server needs a data directory for its account resolver")
	}
	res, err := server.NewDirAccResolver(filepath.Join(opts.StoreDir, ResolverDirName), 0, resolverSync, server.NoDelete)
	if err != nil {
		return fmt.Errorf("auth: account resolver: %w", err)
	}
	for pub, j := range d.accounts {
		if err := res.Store(pub, j); err != nil {
			res.Close()
			return fmt.Errorf("auth: account resolver: store %s: %w", pub, err)
		}
	}
	opts.TrustedOperators = []*jwt.OperatorClaims{d.Operator}
	opts.SystemAccount = d.SystemAccount
	opts.AccountResolver = res
	return nil
}
