// Package auth is limitmesh's secured deployment (CONTRACT.md §9): the NATS
// operator, accounts and users of a deployment directory (made with
// nats-io/jwt and nkeys), the embedded server's operator-mode options, the
// push of a new tenant's account to a running server, and the tenant
// binding of decide requests ([Binder]): the calling account, which the
// server states in the Nats-Request-Info header of a request that crossed
// the decide service's import, decides the request's tenant.
//
// The accounts: SYS (the NATS system account: the resolver, account
// updates); LIMITER (the nodes with JetStream, the buckets and streams,
// the operators' admin user; it exports the decide service); one account
// per tenant, named for the tenant, whose only import is the decide
// service and whose user may publish only to the decide subject and
// receive replies.
//
// A deployment directory holds public files (the manifest, the operator's
// and the accounts' JWTs) and secret ones (the keys/ directory of seeds and
// every creds file); every file is written owner-only (0600, directories
// 0700) and nothing here prints a secret.
//
// This package must not import mesh; mesh calls the [Binder].
package auth

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nkeys"
)

// Files of a deployment directory, relative to it.
const (
	// ManifestFile names the deployment's subject prefix and its public keys.
	ManifestFile = "deployment.json"
	// OperatorJWTFile is the operator's JWT.
	OperatorJWTFile = "operator.jwt"
	// SystemCredsFile is a user of the system account, for the tools that
	// push account updates.
	SystemCredsFile = "sys.creds"
	// NodeCredsFile is the user in LIMITER the nodes connect as.
	NodeCredsFile = "node.creds"
	// AdminCredsFile is the user in LIMITER for operators (`nats kv put
	// rl_policies ...`, the limitmesh commands).
	AdminCredsFile = "admin.creds"

	accountsDir = "accounts" // SYS.jwt, LIMITER.jwt, tenants/<name>.jwt
	keysDir     = "keys"     // seeds: operator.nk, SYS.nk, LIMITER.nk, tenants/<name>.nk
	tenantsDir  = "tenants"  // <name>.creds
)

// Permissions of what a deployment directory holds.
const (
	dirMode  fs.FileMode = 0o700
	fileMode fs.FileMode = 0o600
)

// manifestVersion is the version of [ManifestFile]'s layout.
const manifestVersion = 1

// manifest is the JSON of [ManifestFile]: public values only.
type manifest struct {
	Version        int    `json:"version"`
	Prefix         string `json:"prefix"`
	Operator       string `json:"operator"`
	SystemAccount  string `json:"system_account"`
	LimiterAccount string `json:"limiter_account"`
	ShareIdentity  bool   `json:"share_identity"`
}

// Deployment is the public description of a secured deployment, as read
// from its directory by [Load] (or written by [Init]). It holds no secret.
type Deployment struct {
	// Dir is the deployment directory.
	Dir string
	// Prefix is the subject prefix of the decide service the tenant
	// accounts import (<Prefix>.v1.decide).
	Prefix string
	// Operator is the decoded operator JWT; OperatorJWT its text.
	Operator    *jwt.OperatorClaims
	OperatorJWT string
	// SystemAccount and LimiterAccount are the public keys of SYS and
	// LIMITER.
	SystemAccount  string
	LimiterAccount string
	// ShareIdentity reports whether tenant imports share the caller's
	// whole identity (user, connection name, tags, user JWT) in
	// Nats-Request-Info, not only its account.
	ShareIdentity bool
	// Tenants maps each tenant name to its account's public key.
	Tenants map[string]string
	// accounts maps every account's public key to its JWT.
	accounts map[string]string
}

// NodeCreds, AdminCreds and SystemCreds are the paths of the creds files
// of the node user, the admin user (both in LIMITER) and the system user.
func (d *Deployment) NodeCreds() string   { return filepath.Join(d.Dir, NodeCredsFile) }
func (d *Deployment) AdminCreds() string  { return filepath.Join(d.Dir, AdminCredsFile) }
func (d *Deployment) SystemCreds() string { return filepath.Join(d.Dir, SystemCredsFile) }

// TenantCreds is the path of the creds file of tenant name's user.
func (d *Deployment) TenantCreds(name string) string {
	return filepath.Join(d.Dir, tenantsDir, name+".creds")
}

// AccountJWTs returns every account's JWT by account public key (a copy).
func (d *Deployment) AccountJWTs() map[string]string {
	m := make(map[string]string, len(d.accounts))
	for k, v := range d.accounts {
		m[k] = v
	}
	return m
}

// AccountJWT returns the JWT of the account with public key pub.
func (d *Deployment) AccountJWT(pub string) (string, bool) {
	j, ok := d.accounts[pub]
	return j, ok
}

// TenantNames returns the tenant names, sorted.
func (d *Deployment) TenantNames() []string {
	names := make([]string, 0, len(d.Tenants))
	for n := range d.Tenants {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// trustedIssuer reports whether key may sign this deployment's accounts:
// the operator or one of its signing keys.
func (d *Deployment) trustedIssuer(key string) bool {
	return key == d.Operator.Subject || d.Operator.SigningKeys.Contains(key)
}

// InitOptions configures [Init].
type InitOptions struct {
	// Prefix is the subject prefix of the decide service (default "rl").
	Prefix string
	// Tenants are the tenant accounts to create (each [ValidTenantName]).
	Tenants []string
	// Force replaces a deployment already in the directory: the files and
	// directories of the layout are removed first (nothing else is).
	Force bool
	// ShareIdentity makes tenant imports share the caller's whole
	// identity in Nats-Request-Info (see [Deployment.ShareIdentity]).
	ShareIdentity bool
}

// Init writes a new secured deployment into dir: an operator; the system
// account with a user (sys.creds); LIMITER with JetStream (no limits),
// exporting the decide service, with the node and admin users (node.creds,
// admin.creds); and one account and user per tenant
// (tenants/<name>.creds). dir is created if missing; a directory that
// already holds files is refused with [ErrExists] unless o.Force.
func Init(dir string, o InitOptions) (*Deployment, error) {
	if o.Prefix == "" {
		o.Prefix = "rl"
	}
	if !validPrefix(o.Prefix) {
		return nil, fmt.Errorf("auth: prefix %q: must match [a-z][a-z0-9_-]{0,31}", o.Prefix)
	}
	seen := map[string]bool{}
	for _, t := range o.Tenants {
		if err := checkTenantName(t); err != nil {
			return nil, err
		}
		if seen[t] {
			return nil, fmt.Errorf("auth: tenant %q is listed twice", t)
		}
		seen[t] = true
	}
	if err := prepareDir(dir, o.Force); err != nil {
		return nil, err
	}

	opKP, err := nkeys.CreateOperator()
	if err != nil {
		return nil, err
	}
	sys, err := newKey(nkeys.CreateAccount)
	if err != nil {
		return nil, err
	}
	lim, err := newKey(nkeys.CreateAccount)
	if err != nil {
		return nil, err
	}
	opPub, _ := opKP.PublicKey()
	oc := jwt.NewOperatorClaims(opPub)
	oc.Name = "limitmesh"
	oc.SystemAccount = sys.pub
	opJWT, err := oc.Encode(opKP)
	if err != nil {
		return nil, fmt.Errorf("auth: operator JWT: %w", err)
	}
	sysJWT, err := systemAccountClaims(sys.pub).Encode(opKP)
	if err != nil {
		return nil, fmt.Errorf("auth: system account JWT: %w", err)
	}
	limJWT, err := limiterAccountClaims(lim.pub, sys.pub, o.Prefix).Encode(opKP)
	if err != nil {
		return nil, fmt.Errorf("auth: LIMITER account JWT: %w", err)
	}
	d := &Deployment{
		Dir: dir, Prefix: o.Prefix, OperatorJWT: opJWT,
		SystemAccount: sys.pub, LimiterAccount: lim.pub, ShareIdentity: o.ShareIdentity,
		Tenants:  map[string]string{},
		accounts: map[string]string{sys.pub: sysJWT, lim.pub: limJWT},
	}
	if d.Operator, err = jwt.DecodeOperatorClaims(opJWT); err != nil {
		return nil, fmt.Errorf("auth: operator JWT: %w", err)
	}
	m := manifest{Version: manifestVersion, Prefix: o.Prefix, Operator: opPub,
		SystemAccount: sys.pub, LimiterAccount: lim.pub, ShareIdentity: o.ShareIdentity}
	mb, _ := json.MarshalIndent(m, "", "  ")

	opSeed, _ := opKP.Seed()
	files := []file{
		{filepath.Join(keysDir, "operator.nk"), opSeed},
		{filepath.Join(keysDir, SystemAccountName+".nk"), sys.seed},
		{filepath.Join(keysDir, LimiterAccountName+".nk"), lim.seed},
		{OperatorJWTFile, []byte(opJWT)},
		{filepath.Join(accountsDir, SystemAccountName+".jwt"), []byte(sysJWT)},
		{filepath.Join(accountsDir, LimiterAccountName+".jwt"), []byte(limJWT)},
	}
	for _, u := range []struct {
		file, name string
		acct       key
	}{
		{SystemCredsFile, "sys", sys},
		{NodeCredsFile, "node", lim},
		{AdminCredsFile, "admin", lim},
	} {
		creds, err := userCreds(u.acct.kp, u.name, nil)
		if err != nil {
			return nil, err
		}
		files = append(files, file{u.file, creds})
	}
	for _, t := range o.Tenants {
		tf, tpub, tjwt, err := newTenant(opKP, d, t)
		if err != nil {
			return nil, err
		}
		files = append(files, tf...)
		d.Tenants[t] = tpub
		d.accounts[tpub] = tjwt
	}
	// The manifest goes last: a directory without one is not a deployment,
	// so an interrupted Init is never loaded as one.
	files = append(files, file{ManifestFile, append(mb, '\n')})
	for _, f := range files {
		if err := writeFile(dir, f, false); err != nil {
			return nil, err
		}
	}
	return d, nil
}

// AddTenant adds tenant name to the deployment in dir: it writes the
// tenant's account (signed with the operator key in dir/keys) and user,
// and returns the updated deployment and the new account's JWT, which a
// running server must still be given ([PushAccount]). A tenant the
// deployment already has is refused with [ErrExists].
func AddTenant(dir, name string) (*Deployment, string, error) {
	if err := checkTenantName(name); err != nil {
		return nil, "", err
	}
	d, err := Load(dir)
	if err != nil {
		return nil, "", err
	}
	if _, ok := d.Tenants[name]; ok {
		return nil, "", fmt.Errorf("%w: tenant %q", ErrExists, name)
	}
	seed, err := os.ReadFile(filepath.Join(dir, keysDir, "operator.nk"))
	if err != nil {
		return nil, "", fmt.Errorf("%w: operator key: %v", ErrDeployment, err)
	}
	opKP, err := nkeys.FromSeed(seed)
	if err != nil {
		return nil, "", fmt.Errorf("%w: %s: not an operator seed", ErrDeployment, filepath.Join(keysDir, "operator.nk"))
	}
	if pub, _ := opKP.PublicKey(); !d.trustedIssuer(pub) {
		return nil, "", fmt.Errorf("%w: %s is not the key of %s", ErrDeployment, filepath.Join(keysDir, "operator.nk"), OperatorJWTFile)
	}
	files, pub, tjwt, err := newTenant(opKP, d, name)
	if err != nil {
		return nil, "", err
	}
	// The seed is created exclusively: of two concurrent additions of one
	// name, one fails here before writing anything else.
	for i, f := range files {
		if err := writeFile(dir, f, i == 0); err != nil {
			if errors.Is(err, fs.ErrExist) {
				return nil, "", fmt.Errorf("%w: tenant %q", ErrExists, name)
			}
			return nil, "", err
		}
	}
	d.Tenants[name] = pub
	d.accounts[pub] = tjwt
	return d, tjwt, nil
}

// Load reads the deployment in dir and checks it: every account JWT is
// signed by the operator (or one of its signing keys) and names the
// account its file and the manifest say. Errors wrap [ErrDeployment].
func Load(dir string) (*Deployment, error) {
	bad := func(what string, err any) error {
		return fmt.Errorf("%w: %s: %v", ErrDeployment, filepath.Join(dir, what), err)
	}
	mb, err := os.ReadFile(filepath.Join(dir, ManifestFile))
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("%w: %s has no %s (create one with `limitmesh auth init`)", ErrDeployment, dir, ManifestFile)
		}
		return nil, bad(ManifestFile, err)
	}
	var m manifest
	if err := json.Unmarshal(mb, &m); err != nil {
		return nil, bad(ManifestFile, err)
	}
	if m.Version != manifestVersion {
		return nil, bad(ManifestFile, fmt.Sprintf("version %d, this build reads %d", m.Version, manifestVersion))
	}
	if !validPrefix(m.Prefix) {
		return nil, bad(ManifestFile, fmt.Sprintf("prefix %q", m.Prefix))
	}
	ob, err := os.ReadFile(filepath.Join(dir, OperatorJWTFile))
	if err != nil {
		return nil, bad(OperatorJWTFile, err)
	}
	op, err := jwt.DecodeOperatorClaims(strings.TrimSpace(string(ob)))
	if err != nil {
		return nil, bad(OperatorJWTFile, err)
	}
	if op.Subject != m.Operator || op.SystemAccount != m.SystemAccount {
		return nil, bad(OperatorJWTFile, "operator or system account differs from "+ManifestFile)
	}
	d := &Deployment{
		Dir: dir, Prefix: m.Prefix, Operator: op, OperatorJWT: strings.TrimSpace(string(ob)),
		SystemAccount: m.SystemAccount, LimiterAccount: m.LimiterAccount, ShareIdentity: m.ShareIdentity,
		Tenants: map[string]string{}, accounts: map[string]string{},
	}
	readAccount := func(rel, name, wantPub string) (string, error) {
		b, err := os.ReadFile(filepath.Join(dir, rel))
		if err != nil {
			return "", bad(rel, err)
		}
		text := strings.TrimSpace(string(b))
		ac, err := jwt.DecodeAccountClaims(text)
		switch {
		case err != nil:
			return "", bad(rel, err)
		case !d.trustedIssuer(ac.Issuer):
			return "", bad(rel, "not signed by the operator")
		case ac.Name != name:
			return "", bad(rel, fmt.Sprintf("account name %q, want %q", ac.Name, name))
		case wantPub != "" && ac.Subject != wantPub:
			return "", bad(rel, "account key differs from "+ManifestFile)
		case d.accounts[ac.Subject] != "":
			return "", bad(rel, "a second JWT of account "+ac.Subject)
		}
		d.accounts[ac.Subject] = text
		return ac.Subject, nil
	}
	if _, err := readAccount(filepath.Join(accountsDir, SystemAccountName+".jwt"), SystemAccountName, m.SystemAccount); err != nil {
		return nil, err
	}
	if _, err := readAccount(filepath.Join(accountsDir, LimiterAccountName+".jwt"), LimiterAccountName, m.LimiterAccount); err != nil {
		return nil, err
	}
	entries, err := os.ReadDir(filepath.Join(dir, accountsDir, tenantsDir))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, bad(filepath.Join(accountsDir, tenantsDir), err)
	}
	for _, e := range entries {
		name, ok := strings.CutSuffix(e.Name(), ".jwt")
		if !ok || e.IsDir() {
			continue
		}
		if !ValidTenantName(name) {
			return nil, bad(filepath.Join(accountsDir, tenantsDir, e.Name()), "not a tenant name")
		}
		pub, err := readAccount(filepath.Join(accountsDir, tenantsDir, e.Name()), name, "")
		if err != nil {
			return nil, err
		}
		d.Tenants[name] = pub
	}
	return d, nil
}

// key is a new nkey pair with its public key and seed.
type key struct {
	kp   nkeys.KeyPair
	pub  string
	seed []byte
}

func newKey(create func() (nkeys.KeyPair, error)) (key, error) {
	kp, err := create()
	if err != nil {
		return key{}, err
	}
	pub, _ := kp.PublicKey()
	seed, _ := kp.Seed()
	return key{kp: kp, pub: pub, seed: seed}, nil
}

// systemAccountClaims is SYS: it exports the account JWT lookup, so the
// nodes (in LIMITER) can read a calling account's JWT from the resolver.
func systemAccountClaims(pub string) *jwt.AccountClaims {
	ac := jwt.NewAccountClaims(pub)
	ac.Name = SystemAccountName
	ac.Exports.Add(&jwt.Export{Name: "account JWT lookup", Subject: lookupSubjects, Type: jwt.Service})
	return ac
}

// lookupSubjects are the resolver's account JWT lookups
// ($SYS.REQ.ACCOUNT.<account public key>.CLAIMS.LOOKUP).
const lookupSubjects = "$SYS.REQ.ACCOUNT.*.CLAIMS.LOOKUP"

// limiterAccountClaims is LIMITER: JetStream without limits, the decide
// and reservation endpoints exported to every account as services, the
// account lookup imported from SYS.
func limiterAccountClaims(pub, sysPub, prefix string) *jwt.AccountClaims {
	ac := jwt.NewAccountClaims(pub)
	ac.Name = LimiterAccountName
	ac.Limits.JetStreamLimits = jwt.JetStreamLimits{
		MemoryStorage: jwt.NoLimit, DiskStorage: jwt.NoLimit,
		Streams: jwt.NoLimit, Consumer: jwt.NoLimit, MaxAckPending: jwt.NoLimit,
	}
	for _, ep := range ServiceEndpoints {
		ac.Exports.Add(&jwt.Export{Name: "limitmesh " + ep, Subject: jwt.Subject(ServiceSubject(prefix, ep)), Type: jwt.Service})
	}
	ac.Imports.Add(&jwt.Import{Name: "account JWT lookup", Subject: lookupSubjects, Account: sysPub, Type: jwt.Service})
	return ac
}

// tenantAccountClaims is a tenant's account: its only imports are the
// decide and reservation endpoints; no JetStream, no exports.
func tenantAccountClaims(pub, name string, d *Deployment) *jwt.AccountClaims {
	ac := jwt.NewAccountClaims(pub)
	ac.Name = name
	for _, ep := range ServiceEndpoints {
		ac.Imports.Add(&jwt.Import{Name: "limitmesh " + ep, Subject: jwt.Subject(ServiceSubject(d.Prefix, ep)),
			Account: d.LimiterAccount, Type: jwt.Service, Share: d.ShareIdentity})
	}
	return ac
}

// newTenant makes tenant name's account and user: the files to write
// (the account seed first), the account's public key and JWT.
func newTenant(opKP nkeys.KeyPair, d *Deployment, name string) ([]file, string, string, error) {
	acct, err := newKey(nkeys.CreateAccount)
	if err != nil {
		return nil, "", "", err
	}
	ajwt, err := tenantAccountClaims(acct.pub, name, d).Encode(opKP)
	if err != nil {
		return nil, "", "", fmt.Errorf("auth: tenant %q account JWT: %w", name, err)
	}
	creds, err := userCreds(acct.kp, name, func(uc *jwt.UserClaims) {
		for _, ep := range ServiceEndpoints {
			uc.Permissions.Pub.Allow.Add(ServiceSubject(d.Prefix, ep))
		}
		uc.Permissions.Sub.Allow.Add("_INBOX.>")
	})
	if err != nil {
		return nil, "", "", err
	}
	return []file{
		{filepath.Join(keysDir, tenantsDir, name+".nk"), acct.seed},
		{filepath.Join(accountsDir, tenantsDir, name+".jwt"), []byte(ajwt)},
		{filepath.Join(tenantsDir, name+".creds"), creds},
	}, acct.pub, ajwt, nil
}

// userCreds makes a user of the account acct and returns its creds file
// (the user JWT and seed).
func userCreds(acct nkeys.KeyPair, name string, edit func(*jwt.UserClaims)) ([]byte, error) {
	u, err := newKey(nkeys.CreateUser)
	if err != nil {
		return nil, err
	}
	uc := jwt.NewUserClaims(u.pub)
	uc.Name = name
	if edit != nil {
		edit(uc)
	}
	ujwt, err := uc.Encode(acct)
	if err != nil {
		return nil, fmt.Errorf("auth: user %q JWT: %w", name, err)
	}
	return jwt.FormatUserConfig(ujwt, u.seed)
}

// file is one file of a deployment directory: its path relative to the
// directory and its contents.
type file struct {
	rel  string
	data []byte
}

// writeFile writes f under dir owner-only, creating its directories
// (0700). Exclusive: fail with fs.ErrExist if the file exists; otherwise
// the file is replaced whole (a temporary file renamed over it).
func writeFile(dir string, f file, exclusive bool) error {
	path := filepath.Join(dir, f.rel)
	if err := mkdirs(dir, filepath.Dir(f.rel)); err != nil {
		return err
	}
	if exclusive {
		fh, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, fileMode)
		if err != nil {
			return err
		}
		_, err = fh.Write(f.data)
		if cerr := fh.Close(); err == nil {
			err = cerr
		}
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".tmp-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if err := tmp.Chmod(fileMode); err != nil {
		tmp.Close()
		return err
	}
	if _, err := tmp.Write(f.data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// mkdirs creates the directories of rel under dir, each 0700.
func mkdirs(dir, rel string) error {
	if rel == "." {
		return nil
	}
	p := dir
	for _, part := range strings.Split(filepath.ToSlash(rel), "/") {
		p = filepath.Join(p, part)
		if err := os.Mkdir(p, dirMode); err != nil && !errors.Is(err, fs.ErrExist) {
			return err
		}
	}
	return nil
}

// prepareDir makes dir ready for [Init]: created (0700) if missing;
// refused if it holds files, unless force, which removes the layout's own
// files and directories from it first.
func prepareDir(dir string, force bool) error {
	entries, err := os.ReadDir(dir)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return os.MkdirAll(dir, dirMode)
	case err != nil:
		return err
	case len(entries) > 0 && !force:
		return fmt.Errorf("%w: %s is not empty (--force replaces the deployment in it)", ErrExists, dir)
	}
	if force {
		for _, name := range []string{ManifestFile, OperatorJWTFile, SystemCredsFile, NodeCredsFile, AdminCredsFile,
			accountsDir, keysDir, tenantsDir} {
			if err := os.RemoveAll(filepath.Join(dir, name)); err != nil {
				return err
			}
		}
	}
	return os.Chmod(dir, dirMode)
}
