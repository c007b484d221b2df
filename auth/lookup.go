package auth

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"
)

// lookupSubject is the resolver's lookup of one account's JWT.
func lookupSubject(pub string) string { return "$SYS.REQ.ACCOUNT." + pub + ".CLAIMS.LOOKUP" }

// ServerLookup is a [Lookup] that asks the NATS servers' account resolver
// over nc, a connection in LIMITER (whose account imports the lookup from
// SYS; [Init] sets that up). An empty answer (a server that does not hold
// the account) is an error.
func ServerLookup(nc *nats.Conn) Lookup {
	return func(ctx context.Context, pub string) (string, error) {
		msg, err := nc.RequestWithContext(ctx, lookupSubject(pub), nil)
		if err != nil {
			return "", fmt.Errorf("account lookup: %w", err)
		}
		if len(msg.Data) == 0 {
			return "", errors.New("account lookup: the resolver does not hold the account")
		}
		return string(msg.Data), nil
	}
}

// Binder returns the [Binder] of a node of deployment d whose connection
// is nc (a user in LIMITER): d's operator and signing keys are the trusted
// issuers; an account of d is looked up in d (no request), any other (a
// tenant added since d was loaded) from the server ([ServerLookup]).
// timeout bounds one server lookup (0: 1 s).
func (d *Deployment) Binder(nc *nats.Conn, timeout time.Duration) (*Binder, error) {
	issuers := append([]string{d.Operator.Subject}, d.Operator.SigningKeys...)
	accounts := d.AccountJWTs()
	server := ServerLookup(nc)
	return NewBinder(BinderConfig{
		LimiterAccount: d.LimiterAccount,
		Issuers:        issuers,
		LookupTimeout:  timeout,
		Lookup: func(ctx context.Context, pub string) (string, error) {
			if j, ok := accounts[pub]; ok {
				return j, nil
			}
			return server(ctx, pub)
		},
	})
}

// CredsAccount returns the public keys of the user of a creds file and of
// the account that issued it.
func CredsAccount(credsFile string) (user, account string, err error) {
	b, err := os.ReadFile(credsFile)
	if err != nil {
		return "", "", err
	}
	text, err := jwt.ParseDecoratedJWT(b)
	if err != nil {
		return "", "", fmt.Errorf("%s: %w", credsFile, err)
	}
	uc, err := jwt.DecodeUserClaims(text)
	if err != nil {
		return "", "", fmt.Errorf("%s: not a user JWT: %w", credsFile, err)
	}
	account = uc.Issuer
	if uc.IssuerAccount != "" {
		account = uc.IssuerAccount
	}
	return uc.Subject, account, nil
}

// DiscoverBinder returns the [Binder] of a node that joins a secured
// deployment with only its creds file (no deployment directory): its own
// account, the issuer of its user, is the trusted LIMITER account, and the
// key that signed LIMITER's JWT (fetched from the server over nc) is the
// one trusted issuer of tenant accounts. Tenant accounts signed by another
// key of the operator are refused; a node that has the deployment
// directory uses [Deployment.Binder] instead.
func DiscoverBinder(ctx context.Context, nc *nats.Conn, credsFile string, timeout time.Duration) (*Binder, error) {
	_, limiter, err := CredsAccount(credsFile)
	if err != nil {
		return nil, err
	}
	lookup := ServerLookup(nc)
	text, err := lookup(ctx, limiter)
	if err != nil {
		return nil, fmt.Errorf("%w: the node's own account %s: %w", ErrLookup, limiter, err)
	}
	ac, err := jwt.DecodeAccountClaims(text)
	if err != nil || ac.Subject != limiter {
		return nil, fmt.Errorf("%w: the node's own account %s: the resolver's JWT does not decode to it", ErrLookup, limiter)
	}
	return NewBinder(BinderConfig{
		LimiterAccount: limiter,
		Issuers:        []string{ac.Issuer},
		Lookup:         lookup,
		LookupTimeout:  timeout,
	})
}
