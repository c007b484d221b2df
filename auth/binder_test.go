package auth

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nkeys"
)

// fixture is an operator with accounts and a Binder over an in-memory
// lookup that counts its calls.
type fixture struct {
	t        testing.TB
	op       nkeys.KeyPair
	limiter  string
	jwts     map[string]string
	lookups  map[string]int
	fail     error
	now      time.Time
	mu       sync.Mutex
	b        *Binder
	accounts map[string]string // name -> public key
}

func newFixture(t testing.TB, max int) *fixture {
	t.Helper()
	op, _ := nkeys.CreateOperator()
	f := &fixture{t: t, op: op, jwts: map[string]string{}, lookups: map[string]int{},
		now: time.Unix(1700000000, 0), accounts: map[string]string{}}
	f.limiter = f.account(op, LimiterAccountName, nil)
	opPub, _ := op.PublicKey()
	b, err := NewBinder(BinderConfig{
		LimiterAccount: f.limiter,
		Issuers:        []string{opPub},
		LookupTimeout:  time.Second,
		MaxAccounts:    max,
		Now:            func() time.Time { f.mu.Lock(); defer f.mu.Unlock(); return f.now },
		Lookup: func(_ context.Context, pub string) (string, error) {
			f.mu.Lock()
			defer f.mu.Unlock()
			f.lookups[pub]++
			if f.fail != nil {
				return "", f.fail
			}
			j, ok := f.jwts[pub]
			if !ok {
				return "", errors.New("no such account")
			}
			return j, nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	f.b = b
	return f
}

// account makes an account named name signed by signer and returns its
// public key.
func (f *fixture) account(signer nkeys.KeyPair, name string, edit func(*jwt.AccountClaims)) string {
	f.t.Helper()
	kp, _ := nkeys.CreateAccount()
	pub, _ := kp.PublicKey()
	ac := jwt.NewAccountClaims(pub)
	ac.Name = name
	if edit != nil {
		edit(ac)
	}
	j, err := ac.Encode(signer)
	if err != nil {
		f.t.Fatal(err)
	}
	f.jwts[pub] = j
	f.accounts[name] = pub
	return pub
}

func info(acc string) []string { return []string{`{"acc":"` + acc + `","rtt":465550}`} }

func TestBindRules(t *testing.T) {
	f := newFixture(t, 0)
	acme := f.account(f.op, "acme", nil)
	otherOp, _ := nkeys.CreateOperator()
	foreign := f.account(otherOp, "birch", nil)
	sys := f.account(f.op, SystemAccountName, nil)
	spaced := f.account(f.op, "Acme Corp", nil)
	expired := f.account(f.op, "old", func(ac *jwt.AccountClaims) { ac.Expires = time.Now().Add(-time.Hour).Unix() })
	swapped, _ := nkeys.CreateAccount()
	swappedPub, _ := swapped.PublicKey()
	f.jwts[swappedPub] = f.jwts[acme] // another account's JWT

	cases := []struct {
		name         string
		b            *Binder
		infos        []string
		tenant, want string
		err          error
	}{
		{"unsecured ignores the header", nil, info(acme), "birch", "birch", nil},
		{"unsecured, no tenant", nil, info(acme), "", "", nil},
		{"no header: LIMITER", f.b, nil, "birch", "birch", nil},
		{"LIMITER account", f.b, info(f.limiter), "birch", "birch", nil},
		{"LIMITER account, no tenant", f.b, info(f.limiter), "", "", nil},
		{"tenant, no tenant", f.b, info(acme), "", "acme", nil},
		{"tenant, its own", f.b, info(acme), "acme", "acme", nil},
		{"tenant, another", f.b, info(acme), "birch", "", ErrForbidden},
		{"two headers", f.b, append(info(f.limiter), info(acme)...), "", "", ErrForbidden},
		{"unreadable header", f.b, []string{`{"acc":`}, "", "", ErrForbidden},
		{"not an account key", f.b, info("ACME.>"), "", "", ErrForbidden},
		{"foreign operator", f.b, info(foreign), "", "", ErrForbidden},
		{"system account", f.b, info(sys), "", "", ErrForbidden},
		{"not a tenant name", f.b, info(spaced), "", "", ErrForbidden},
		{"expired account", f.b, info(expired), "", "", ErrForbidden},
		{"another account's JWT", f.b, info(swappedPub), "", "", ErrForbidden},
	}
	for _, c := range cases {
		got, err := bind(c.b, c.infos, c.tenant)
		if got != c.want || !errors.Is(err, c.err) || (c.err == nil) != (err == nil) {
			t.Errorf("%s: Bind(%q, %q) = %q, %v; want %q, %v", c.name, c.infos, c.tenant, got, err, c.want, c.err)
		}
	}
	// Every account was looked up once, refusals included.
	for pub, n := range f.lookups {
		if n != 1 {
			t.Errorf("account %s looked up %d times", pub, n)
		}
	}
	for _, again := range []string{acme, foreign, spaced} {
		_, _ = bind(f.b, info(again), "")
		if f.lookups[again] != 1 {
			t.Errorf("account %s looked up again (%d)", again, f.lookups[again])
		}
	}
}

func TestBindTenant(t *testing.T) {
	for _, c := range []struct {
		caller, tenant, want string
		forbidden            bool
	}{
		{"", "", "", false}, {"", "x", "x", false},
		{"a", "", "a", false}, {"a", "a", "a", false}, {"a", "b", "", true},
	} {
		got, err := BindTenant(c.caller, c.tenant)
		if got != c.want || errors.Is(err, ErrForbidden) != c.forbidden {
			t.Errorf("BindTenant(%q, %q) = %q, %v", c.caller, c.tenant, got, err)
		}
	}
}

// TestBindLookupFailure: a failed lookup is ErrLookup, not retried for the
// lookup timeout, then retried.
func TestBindLookupFailure(t *testing.T) {
	f := newFixture(t, 0)
	acme := f.account(f.op, "acme", nil)
	f.fail = errors.New("timeout")
	steps := []struct {
		advance time.Duration
		fail    bool
		want    string
		err     error
		lookups int
	}{
		{0, true, "", ErrLookup, 1},
		{500 * time.Millisecond, true, "", ErrLookup, 1},
		{500 * time.Millisecond, true, "", ErrLookup, 2},
		{999 * time.Millisecond, false, "", ErrLookup, 2},
		{time.Millisecond, false, "acme", nil, 3},
		{time.Hour, false, "acme", nil, 3},
	}
	for i, s := range steps {
		f.mu.Lock()
		f.now = f.now.Add(s.advance)
		if s.fail {
			f.fail = errors.New("timeout")
		} else {
			f.fail = nil
		}
		f.mu.Unlock()
		got, err := bind(f.b, info(acme), "")
		if got != s.want || !errors.Is(err, s.err) || (s.err == nil) != (err == nil) || f.lookups[acme] != s.lookups {
			t.Errorf("step %d: Bind = %q, %v after %d lookups; want %q, %v after %d", i, got, err, f.lookups[acme], s.want, s.err, s.lookups)
		}
	}
}

// TestBindBounded: the remembered accounts never exceed MaxAccounts.
func TestBindBounded(t *testing.T) {
	f := newFixture(t, 3)
	names := []string{"a", "b", "c", "d", "e"}
	for _, n := range names {
		f.account(f.op, n, nil)
	}
	for round := 0; round < 3; round++ {
		for _, n := range names {
			if got, err := bind(f.b, info(f.accounts[n]), ""); got != n || err != nil {
				t.Fatalf("Bind for %s = %q, %v", n, got, err)
			}
			if l := len(*f.b.known.Load()); l > 3 {
				t.Fatalf("%d accounts remembered, at most 3", l)
			}
		}
	}
}

// TestBindNoAllocation: a remembered tenant account's request binds
// without allocating.
func TestBindNoAllocation(t *testing.T) {
	f := newFixture(t, 0)
	acme := f.account(f.op, "acme", nil)
	in := info(acme)
	if _, err := bind(f.b, in, ""); err != nil {
		t.Fatal(err)
	}
	for _, tenant := range []string{"", "acme"} {
		if n := testing.AllocsPerRun(100, func() { _, _ = bind(f.b, in, tenant) }); n != 0 {
			t.Errorf("Bind(acme, %q) allocates %v times", tenant, n)
		}
	}
	if n := testing.AllocsPerRun(100, func() { _, _ = bind(f.b, info(f.limiter), "x") }); n > 1 { // info() allocates one
		t.Errorf("Bind(LIMITER) allocates %v times", n)
	}
}

// TestBindConcurrent: concurrent first requests of many accounts (run
// with -race).
func TestBindConcurrent(t *testing.T) {
	f := newFixture(t, 0)
	var names []string
	for _, n := range []string{"a", "b", "c", "d"} {
		f.account(f.op, n, nil)
		names = append(names, n)
	}
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Go(func() {
			for i := 0; i < 100; i++ {
				n := names[(g+i)%len(names)]
				if got, err := bind(f.b, info(f.accounts[n]), ""); got != n || err != nil {
					t.Errorf("Bind for %s = %q, %v", n, got, err)
					return
				}
			}
		})
	}
	wg.Wait()
	for _, n := range names {
		if f.lookups[f.accounts[n]] != 1 {
			t.Errorf("%s looked up %d times", n, f.lookups[f.accounts[n]])
		}
	}
}

func BenchmarkBind(b *testing.B) {
	f := newFixture(b, 0)
	acme := f.account(f.op, "acme", nil)
	in := info(acme)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := bind(f.b, in, "acme"); err != nil {
			b.Fatal(err)
		}
	}
}

// bind binds a request as the node does: its caller, then the tenant.
func bind(b *Binder, infos []string, tenant string) (string, error) {
	caller, err := b.Caller(infos)
	if err != nil {
		return "", err
	}
	return BindTenant(caller, tenant)
}
