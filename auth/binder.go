package auth

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nkeys"
)

// Lookup returns the JWT of the account with public key pub (a valid
// account public key). It is called only on a [Binder] cache miss.
type Lookup func(ctx context.Context, pub string) (string, error)

// BinderConfig configures a [Binder].
type BinderConfig struct {
	// LimiterAccount is the public key of the nodes' own account: its
	// requests are trusted (operators and nodes; no binding). Required.
	LimiterAccount string
	// Issuers are the keys trusted to sign tenant accounts: the operator
	// and its signing keys. Required.
	Issuers []string
	// Lookup fetches an account's JWT on a cache miss. Required.
	Lookup Lookup
	// LookupTimeout bounds one lookup (default 1 s). A failed lookup is
	// not retried for that account for the same duration: requests from it
	// fail fast with [ErrLookup] meanwhile.
	LookupTimeout time.Duration
	// MaxAccounts bounds the accounts remembered (default 10,000); when
	// full, the memory is cleared and refilled by lookups.
	MaxAccounts int
	// Now is the clock of the lookup backoff (default time.Now).
	Now func() time.Time
}

// Binder binds a decide request to the tenant of the account that sent it
// (CONTRACT.md §9). The node calls [Binder.Caller] with the values of the
// request's Nats-Request-Info header, then [BindTenant] with the caller and
// the descriptor's `tenant`. A nil
// *Binder is an unsecured node's: it trusts no header and binds nothing.
//
// An account's tenant is the name in its JWT, fetched once with the
// configured [Lookup], checked (signed by a trusted issuer, not expired,
// a valid tenant name) and remembered by account key: a remembered
// account costs one header scan and one map read, no allocation and no
// lock. A Binder is safe for concurrent use; lookups are serialized.
type Binder struct {
	limiter string
	issuers []string
	lookup  Lookup
	timeout time.Duration
	max     int
	now     func() time.Time

	known atomic.Pointer[map[string]binding] // copy on write, under mu
	mu    sync.Mutex
}

// binding is what an account's requests are bound to: a tenant, or a
// refusal (reason != "").
type binding struct {
	tenant string
	reason string    // why the account's requests are refused
	retry  time.Time // non-zero: a lookup failed; try again after this
	cause  error     // the failed lookup's error
}

// NewBinder returns a Binder for a secured node.
func NewBinder(cfg BinderConfig) (*Binder, error) {
	switch {
	case !nkeys.IsValidPublicAccountKey(cfg.LimiterAccount):
		return nil, errors.New("auth: binder: LimiterAccount is not an account public key")
	case len(cfg.Issuers) == 0:
		return nil, errors.New("auth: binder: no trusted issuers")
	case cfg.Lookup == nil:
		return nil, errors.New("auth: binder: no Lookup")
	}
	b := &Binder{
		limiter: cfg.LimiterAccount, issuers: slices.Clone(cfg.Issuers), lookup: cfg.Lookup,
		timeout: cfg.LookupTimeout, max: cfg.MaxAccounts, now: cfg.Now,
	}
	if b.timeout <= 0 {
		b.timeout = time.Second
	}
	if b.max <= 0 {
		b.max = 10000
	}
	if b.now == nil {
		b.now = time.Now
	}
	m := map[string]binding{}
	b.known.Store(&m)
	return b, nil
}

// BindTenant returns the tenant a decide request is decided for, given
// its caller (from [Binder.Caller]) and tenant, the value of the
// descriptor's `tenant` dimension ("" without one). The rules (CONTRACT.md
// §9), by caller:
//
//   - "" (a trusted caller: see [Binder.Caller]): tenant;
//   - a tenant account T: T when tenant is "" or T; otherwise an error
//     wrapping [ErrForbidden].
//
// It allocates only when it fails.
func BindTenant(caller, tenant string) (string, error) {
	switch {
	case caller == "":
		return tenant, nil
	case tenant == "" || tenant == caller:
		return caller, nil
	}
	return "", fmt.Errorf("%w: tenant %q may not be used by tenant %q's account", ErrForbidden, tenant, caller)
}

// Caller returns the tenant of the account that sent a request whose
// Nats-Request-Info header has the values infos (headers[RequestInfoHeader],
// nil without one), or "" for a trusted caller: a nil Binder (an unsecured
// node, whatever the header says), no header (the request did not cross
// an import, so it was sent in the nodes' own account), or the LIMITER
// account.
//
// A header repeated, unreadable, or naming an account that is not a tenant
// is refused with [ErrForbidden]; an account whose JWT cannot be fetched
// gives [ErrLookup]. The result is the remembered tenant name: Caller
// allocates only when it fails or on an account's first request.
func (b *Binder) Caller(infos []string) (string, error) {
	if b == nil || len(infos) == 0 {
		return "", nil
	}
	if len(infos) > 1 {
		// The server sets one value and removes the sender's; a second one
		// is a sender's that the server did not recognise as the header.
		return "", fmt.Errorf("%w: %d %s headers", ErrForbidden, len(infos), RequestInfoHeader)
	}
	acc, err := RequestInfoAccount(infos[0])
	if err != nil {
		return "", fmt.Errorf("%w: %w", ErrForbidden, err)
	}
	if acc == b.limiter {
		return "", nil
	}
	if e, ok := (*b.known.Load())[acc]; ok && e.retry.IsZero() {
		if e.reason != "" {
			return "", fmt.Errorf("%w: account %s: %s", ErrForbidden, acc, e.reason)
		}
		return e.tenant, nil
	}
	return b.miss(acc)
}

// miss resolves an account not remembered (or whose lookup failed).
func (b *Binder) miss(acc string) (string, error) {
	if !nkeys.IsValidPublicAccountKey(acc) {
		return "", fmt.Errorf("%w: %q is not an account public key", ErrForbidden, acc)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	e, ok := (*b.known.Load())[acc]
	if !ok || (!e.retry.IsZero() && !b.now().Before(e.retry)) {
		e = b.resolve(acc)
		b.remember(acc, e)
	}
	switch {
	case !e.retry.IsZero():
		return "", fmt.Errorf("%w: account %s: %w", ErrLookup, acc, e.cause)
	case e.reason != "":
		return "", fmt.Errorf("%w: account %s: %s", ErrForbidden, acc, e.reason)
	}
	return e.tenant, nil
}

// resolve fetches and checks acc's JWT.
func (b *Binder) resolve(acc string) binding {
	ctx, cancel := context.WithTimeout(context.Background(), b.timeout)
	defer cancel()
	text, err := b.lookup(ctx, acc)
	if err != nil {
		return binding{retry: b.now().Add(b.timeout), cause: err}
	}
	tenant, reason := checkTenantAccount(acc, text, b.issuers)
	return binding{tenant: tenant, reason: reason}
}

// checkTenantAccount decodes the JWT of account acc and returns its tenant
// name, or why its requests are refused.
func checkTenantAccount(acc, text string, issuers []string) (tenant, reason string) {
	ac, err := jwt.DecodeAccountClaims(text)
	switch {
	case err != nil:
		return "", "its JWT does not decode: " + err.Error()
	case ac.Subject != acc:
		return "", "its JWT is another account's"
	case !slices.Contains(issuers, ac.Issuer):
		return "", "its JWT is not signed by the trusted operator"
	case !ValidTenantName(ac.Name):
		return "", fmt.Sprintf("its name %q is not a tenant name", ac.Name)
	}
	vr := jwt.CreateValidationResults()
	ac.Validate(vr)
	if vr.IsBlocking(true) {
		return "", "its JWT is not valid: " + fmt.Sprint(vr.Errors())
	}
	return ac.Name, ""
}

// remember stores e for acc (b.mu held): a new map with it, cleared first
// when full.
func (b *Binder) remember(acc string, e binding) {
	old := *b.known.Load()
	var m map[string]binding
	if len(old) >= b.max {
		m = make(map[string]binding, 1)
	} else {
		m = make(map[string]binding, len(old)+1)
		for k, v := range old {
			m[k] = v
		}
	}
	m[acc] = e
	b.known.Store(&m)
}

// LimiterAccount is the public key of the account whose requests b trusts.
func (b *Binder) LimiterAccount() string { return b.limiter }
