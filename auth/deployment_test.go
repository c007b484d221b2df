package auth

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nkeys"
)

// readClaims decodes the account JWT at rel under dir.
func readAccount(t *testing.T, dir, rel string) *jwt.AccountClaims {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, rel))
	if err != nil {
		t.Fatal(err)
	}
	ac, err := jwt.DecodeAccountClaims(string(b))
	if err != nil {
		t.Fatalf("%s: %v", rel, err)
	}
	return ac
}

// readCreds decodes a creds file's user JWT and checks its seed matches.
func readCreds(t *testing.T, path string) *jwt.UserClaims {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	text, err := jwt.ParseDecoratedJWT(b)
	if err != nil {
		t.Fatal(err)
	}
	uc, err := jwt.DecodeUserClaims(text)
	if err != nil {
		t.Fatal(err)
	}
	kp, err := jwt.ParseDecoratedUserNKey(b)
	if err != nil {
		t.Fatal(err)
	}
	if pub, _ := kp.PublicKey(); pub != uc.Subject {
		t.Fatalf("%s: seed of %s, JWT of %s", path, pub, uc.Subject)
	}
	return uc
}

func TestInitWritesDeployment(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "auth")
	d, err := Init(dir, InitOptions{Prefix: "lm", Tenants: []string{"acme", "birch"}})
	if err != nil {
		t.Fatal(err)
	}
	// Owner-only permissions throughout.
	var files []string
	err = filepath.WalkDir(dir, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		info, _ := e.Info()
		want := fileMode
		if e.IsDir() {
			want = dirMode
		}
		if info.Mode().Perm() != want {
			t.Errorf("%s has mode %v, want %v", p, info.Mode().Perm(), want)
		}
		if !e.IsDir() {
			rel, _ := filepath.Rel(dir, p)
			files = append(files, filepath.ToSlash(rel))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"accounts/LIMITER.jwt", "accounts/SYS.jwt", "accounts/tenants/acme.jwt", "accounts/tenants/birch.jwt",
		"admin.creds", "deployment.json", "keys/LIMITER.nk", "keys/SYS.nk", "keys/operator.nk",
		"keys/tenants/acme.nk", "keys/tenants/birch.nk", "node.creds", "operator.jwt", "sys.creds",
		"tenants/acme.creds", "tenants/birch.creds"}
	slices.Sort(files)
	if !slices.Equal(files, want) {
		t.Errorf("files %q, want %q", files, want)
	}

	op := d.Operator
	if op.SystemAccount != d.SystemAccount || op.Subject == "" {
		t.Errorf("operator %+v", op)
	}
	sys := readAccount(t, dir, "accounts/SYS.jwt")
	lim := readAccount(t, dir, "accounts/LIMITER.jwt")
	if sys.Subject != d.SystemAccount || sys.Issuer != op.Subject || lim.Subject != d.LimiterAccount || lim.Issuer != op.Subject {
		t.Errorf("SYS %s by %s, LIMITER %s by %s", sys.Subject, sys.Issuer, lim.Subject, lim.Issuer)
	}
	if !lim.Limits.IsJSEnabled() || !lim.Limits.JetStreamLimits.IsUnlimited() {
		t.Errorf("LIMITER JetStream limits %+v, want enabled and unlimited", lim.Limits.JetStreamLimits)
	}
	// The JWTs keep exports and imports sorted by subject.
	services := jwt.StringList{"lm.v1.decide", "lm.v1.release", "lm.v1.renew", "lm.v1.reserve", "lm.v1.settle"}
	if len(lim.Exports) != len(services) {
		t.Errorf("LIMITER exports %d services, want %v", len(lim.Exports), services)
	}
	for i, e := range lim.Exports {
		if string(e.Subject) != services[i] || e.Type != jwt.Service {
			t.Errorf("LIMITER export %d: %s (%v), want the service %s", i, e.Subject, e.Type, services[i])
		}
	}
	for _, name := range []string{"acme", "birch"} {
		ac := readAccount(t, dir, "accounts/tenants/"+name+".jwt")
		if ac.Name != name || ac.Subject != d.Tenants[name] || ac.Issuer != op.Subject || ac.Limits.IsJSEnabled() || len(ac.Exports) != 0 {
			t.Errorf("tenant %s account %+v", name, ac)
		}
		if len(ac.Imports) != len(services) {
			t.Errorf("tenant %s imports %d services, want %v", name, len(ac.Imports), services)
		}
		for i, im := range ac.Imports {
			if string(im.Subject) != services[i] || im.Account != d.LimiterAccount || im.Type != jwt.Service {
				t.Errorf("tenant %s import %d: %+v, want the service %s of LIMITER", name, i, im, services[i])
			}
		}
		uc := readCreds(t, d.TenantCreds(name))
		if uc.Issuer != ac.Subject || uc.Name != name ||
			!slices.Equal(slices.Sorted(slices.Values(uc.Pub.Allow)), []string(services)) || len(uc.Pub.Deny) != 0 ||
			!slices.Equal(uc.Sub.Allow, jwt.StringList{"_INBOX.>"}) {
			t.Errorf("tenant %s user %+v", name, uc.Permissions)
		}
	}
	for path, acct := range map[string]string{d.NodeCreds(): d.LimiterAccount, d.AdminCreds(): d.LimiterAccount, d.SystemCreds(): d.SystemAccount} {
		if uc := readCreds(t, path); uc.Issuer != acct || !uc.Permissions.Pub.Empty() || !uc.Permissions.Sub.Empty() {
			t.Errorf("%s: user issued by %s with %+v", path, uc.Issuer, uc.Permissions)
		}
	}

	// Load reads back the same deployment.
	l, err := Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	if l.Prefix != "lm" || l.LimiterAccount != d.LimiterAccount || len(l.AccountJWTs()) != 4 ||
		!slices.Equal(l.TenantNames(), []string{"acme", "birch"}) || l.Tenants["acme"] != d.Tenants["acme"] {
		t.Errorf("Load: %+v", l)
	}
}

func TestInitRefuses(t *testing.T) {
	dir := t.TempDir()
	for _, o := range []InitOptions{
		{Tenants: []string{"Acme"}}, {Tenants: []string{"-x"}}, {Tenants: []string{""}}, {Tenants: []string{strings.Repeat("a", 65)}},
		{Tenants: []string{"a", "a"}}, {Prefix: "1x"}, {Prefix: "a.b"},
	} {
		if _, err := Init(filepath.Join(dir, "x"), o); err == nil {
			t.Errorf("Init(%+v) succeeded", o)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "x")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a refused Init left %s behind", filepath.Join(dir, "x"))
	}

	// An existing deployment is kept unless forced; force replaces it and
	// leaves other files alone.
	if _, err := Init(dir, InitOptions{Tenants: []string{"acme"}}); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "notes.txt"), []byte("mine"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Init(dir, InitOptions{}); !errors.Is(err, ErrExists) {
		t.Fatalf("second Init: %v, want ErrExists", err)
	}
	d, err := Init(dir, InitOptions{Tenants: []string{"birch"}, Force: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(d.TenantCreds("acme")); !errors.Is(err, fs.ErrNotExist) {
		t.Error("forced Init kept the old tenant")
	}
	if b, err := os.ReadFile(filepath.Join(dir, "notes.txt")); err != nil || string(b) != "mine" {
		t.Error("forced Init removed a file it did not write")
	}
	if l, err := Load(dir); err != nil || !slices.Equal(l.TenantNames(), []string{"birch"}) {
		t.Errorf("after force: %v, %v", l, err)
	}
}

func TestAddTenant(t *testing.T) {
	dir := t.TempDir()
	d0, err := Init(dir, InitOptions{Tenants: []string{"acme"}})
	if err != nil {
		t.Fatal(err)
	}
	d, j, err := AddTenant(dir, "cypress")
	if err != nil {
		t.Fatal(err)
	}
	ac, err := jwt.DecodeAccountClaims(j)
	if err != nil || ac.Name != "cypress" || ac.Issuer != d0.Operator.Subject || ac.Subject != d.Tenants["cypress"] {
		t.Fatalf("new account %+v, %v", ac, err)
	}
	if uc := readCreds(t, d.TenantCreds("cypress")); uc.Issuer != ac.Subject {
		t.Errorf("cypress user issued by %s", uc.Issuer)
	}
	for _, rel := range []string{"keys/tenants/cypress.nk", "accounts/tenants/cypress.jwt", "tenants/cypress.creds"} {
		if st, err := os.Stat(filepath.Join(dir, rel)); err != nil || st.Mode().Perm() != fileMode {
			t.Errorf("%s: %v %v", rel, st, err)
		}
	}
	l, err := Load(dir)
	if err != nil || !slices.Equal(l.TenantNames(), []string{"acme", "cypress"}) {
		t.Fatalf("Load after AddTenant: %v, %v", l, err)
	}
	for _, name := range []string{"cypress", "acme"} {
		if _, _, err := AddTenant(dir, name); !errors.Is(err, ErrExists) {
			t.Errorf("AddTenant(%s) again: %v, want ErrExists", name, err)
		}
	}
	if _, _, err := AddTenant(dir, "Bad Name"); !errors.Is(err, ErrInvalidName) {
		t.Errorf("AddTenant(bad name): %v", err)
	}
	if _, _, err := AddTenant(t.TempDir(), "x"); !errors.Is(err, ErrDeployment) {
		t.Errorf("AddTenant in an empty directory: %v", err)
	}
}

// TestLoadRefusesTampering: an account JWT not signed by the operator, or
// filed under another name, makes the directory invalid.
func TestLoadRefusesTampering(t *testing.T) {
	for _, c := range []struct {
		name   string
		tamper func(t *testing.T, dir string, d *Deployment)
	}{
		{"foreign signer", func(t *testing.T, dir string, d *Deployment) {
			op, _ := nkeys.CreateOperator()
			ac := jwt.NewAccountClaims(d.Tenants["acme"])
			ac.Name = "acme"
			j, _ := ac.Encode(op)
			write(t, filepath.Join(dir, "accounts/tenants/acme.jwt"), j)
		}},
		{"renamed", func(t *testing.T, dir string, d *Deployment) {
			if err := os.Rename(filepath.Join(dir, "accounts/tenants/acme.jwt"), filepath.Join(dir, "accounts/tenants/birch.jwt")); err != nil {
				t.Fatal(err)
			}
		}},
		{"not a JWT", func(t *testing.T, dir string, d *Deployment) {
			write(t, filepath.Join(dir, "accounts/LIMITER.jwt"), "x")
		}},
		{"manifest", func(t *testing.T, dir string, d *Deployment) {
			write(t, filepath.Join(dir, ManifestFile), `{"version":1,"prefix":"rl"}`)
		}},
		{"missing", func(t *testing.T, dir string, d *Deployment) {
			if err := os.Remove(filepath.Join(dir, OperatorJWTFile)); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			d, err := Init(dir, InitOptions{Tenants: []string{"acme"}})
			if err != nil {
				t.Fatal(err)
			}
			c.tamper(t, dir, d)
			if _, err := Load(dir); !errors.Is(err, ErrDeployment) {
				t.Fatalf("Load: %v, want ErrDeployment", err)
			}
		})
	}
}

func write(t *testing.T, path, s string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(s), fileMode); err != nil {
		t.Fatal(err)
	}
}

func TestValidTenantName(t *testing.T) {
	for name, want := range map[string]bool{
		"acme": true, "a": true, "0": true, "a-b_c9": true, strings.Repeat("a", 64): true,
		"": false, "A": false, "-a": false, "_a": false, "a.b": false, "a b": false, strings.Repeat("a", 65): false, "é": false,
	} {
		if ValidTenantName(name) != want {
			t.Errorf("ValidTenantName(%q) = %v", name, !want)
		}
	}
}
