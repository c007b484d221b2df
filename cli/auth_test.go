package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nats-io/jwt/v2"

	"github.com/limitmesh/limitmesh/auth"
	"github.com/limitmesh/limitmesh/mesh"
)

// secrets returns every secret a deployment directory holds: the seeds of
// keys/ and of the creds files.
func secrets(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(dir, func(p string, e fs.DirEntry, err error) error {
		if err != nil || e.IsDir() {
			return err
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		switch {
		case strings.HasSuffix(p, ".nk"):
			out = append(out, strings.TrimSpace(string(b)))
		case strings.HasSuffix(p, ".creds"):
			kp, err := jwt.ParseDecoratedNKey(b)
			if err != nil {
				return err
			}
			seed, _ := kp.Seed()
			out = append(out, string(seed))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func TestAuthInitCommand(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "deploy")
	code, out, errs := run(t, nil, "auth", "init", dir, "--tenants", "acme,birch")
	if code != 0 {
		t.Fatalf("auth init: exit %d %q", code, errs)
	}
	d, err := auth.Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	// What was written: paths and public keys.
	for _, want := range []string{d.Operator.Subject, d.SystemAccount, d.LimiterAccount, d.Tenants["acme"], d.Tenants["birch"],
		d.NodeCreds(), d.AdminCreds(), d.SystemCreds(), d.TenantCreds("acme"), d.TenantCreds("birch"), "limitmesh serve --auth " + dir} {
		if !strings.Contains(out, want) {
			t.Errorf("stdout does not mention %s:\n%s", want, out)
		}
	}
	// Nothing secret, nor any JWT, on either stream.
	seeds := secrets(t, dir)
	if len(seeds) != 10 { // the operator, 4 accounts, 5 users
		t.Fatalf("%d secrets found in %s", len(seeds), dir)
	}
	for _, s := range append(seeds, "eyJ", "BEGIN") {
		if strings.Contains(out+errs, s) {
			t.Errorf("output holds %.6s…", s)
		}
	}

	// An existing deployment is kept; --force replaces it.
	if code, _, errs := run(t, nil, "auth", "init", dir); code != 1 || !strings.Contains(errs, "already exists") || strings.Contains(errs, "auth: auth:") {
		t.Errorf("second init: exit %d %q", code, errs)
	}
	if code, _, errs := run(t, nil, "auth", "init", "--force", "--tenants", "cypress", dir); code != 0 {
		t.Errorf("forced init: exit %d %q", code, errs)
	}
	if d, err := auth.Load(dir); err != nil || len(d.Tenants) != 1 || d.Tenants["cypress"] == "" {
		t.Errorf("after --force: %v, %v", d, err)
	}
	for _, c := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"auth", "init", filepath.Join(t.TempDir(), "x"), "--tenants", "Acme"}, 1, "invalid tenant name"},
		{[]string{"auth", "init"}, 2, "usage: limitmesh auth init"},
		{[]string{"auth", "frob"}, 2, "usage: limitmesh auth init"},
		{[]string{"auth", "add-tenant", dir}, 2, "usage:"},
		{[]string{"auth", "add-tenant", t.TempDir(), "x", "--no-push"}, 1, "auth init"},
	} {
		if code, _, errs := run(t, nil, c.args...); code != c.code || !strings.Contains(errs, c.want) {
			t.Errorf("%q: exit %d %q; want %d and %q", c.args, code, errs, c.code, c.want)
		}
	}
}

// TestServeSecuredEndToEnd runs `limitmesh serve --auth DIR` and uses it as
// the README's secured deployment section does.
func TestServeSecuredEndToEnd(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "deploy")
	if code, _, errs := run(t, nil, "auth", "init", dir, "--tenants", "acme,birch"); code != 0 {
		t.Fatalf("auth init: %q", errs)
	}
	natsAddr, httpAddr := freeAddr(t), freeAddr(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var serveErr syncBuffer
	exit := make(chan int, 1)
	go func() {
		exit <- Main(ctx, []string{"serve", "--auth", dir, "--data", t.TempDir(), "--http", httpAddr, "--nats-listen", natsAddr},
			nil, strings.NewReader(""), &bytes.Buffer{}, &serveErr)
	}()
	waitFor(t, "/readyz", func() bool {
		resp, err := http.Get("http://" + httpAddr + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == 200
	})
	url := "LIMITMESH_NATS_URL=nats://" + natsAddr
	admin := []string{url, "LIMITMESH_CREDS=" + filepath.Join(dir, "admin.creds")}
	policy := filepath.Join(t.TempDir(), "acme.json")
	os.WriteFile(policy, []byte(`{"match":{"tenant":"acme"},"key":["tenant"],"limits":[{"algorithm":"token_bucket","rate":"1/h","burst":5}]}`), 0o644)

	if code, _, errs := run(t, []string{url}, "policy", "put", "acme", policy); code != 1 || !strings.Contains(errs, "Authorization Violation") {
		t.Fatalf("policy put without creds: exit %d %q", code, errs)
	}
	if code, out, errs := run(t, admin, "policy", "put", "acme", policy); code != 0 || !strings.Contains(out, "put acme at revision") {
		t.Fatalf("policy put as admin: exit %d %q %q", code, out, errs)
	}
	decideAs := func(creds string, dims ...string) map[string]any {
		t.Helper()
		args := []string{"decide", "--creds", creds}
		for _, d := range dims {
			args = append(args, "-d", d)
		}
		code, out, errs := run(t, []string{url}, args...)
		if code != 0 {
			t.Fatalf("decide: exit %d %q %q", code, out, errs)
		}
		var reply map[string]any
		if err := json.Unmarshal([]byte(out), &reply); err != nil {
			t.Fatalf("decide printed %q: %v", out, err)
		}
		return reply
	}
	acme := filepath.Join(dir, "tenants", "acme.creds")
	waitFor(t, "the policy to apply", func() bool { return decideAs(acme, "tenant=acme")["policy"] == "acme" })
	if code, _, errs := run(t, []string{url, "LIMITMESH_CREDS=" + acme}, "policy", "list", "--timeout", "500ms"); code != 1 {
		t.Fatalf("policy list as a tenant: exit %d %q", code, errs)
	}

	// A tenant added to the running deployment calls at once.
	code, out, errs := run(t, []string{url}, "auth", "add-tenant", dir, "cypress")
	if code != 0 || !strings.Contains(out, "pushed to nats://"+natsAddr) {
		t.Fatalf("add-tenant: exit %d %q %q", code, out, errs)
	}
	if r := decideAs(filepath.Join(dir, "tenants", "cypress.creds"), "tenant=cypress"); r["allowed"] != true {
		t.Fatalf("cypress: %v", r)
	}
	if code, out, errs := run(t, []string{url}, "auth", "push", dir); code != 0 || !strings.Contains(out, "pushed 4 accounts") {
		t.Fatalf("auth push: exit %d %q %q", code, out, errs)
	}

	// A second node joins with --nats-url and only its creds: it learns its
	// account and binds tenants too.
	http2 := freeAddr(t)
	ctx2, cancel2 := context.WithCancel(context.Background())
	defer cancel2()
	var joinErr syncBuffer
	exit2 := make(chan int, 1)
	go func() {
		exit2 <- Main(ctx2, []string{"serve", "--nats-url", "nats://" + natsAddr, "--creds", filepath.Join(dir, "node.creds"), "--http", http2},
			nil, strings.NewReader(""), &bytes.Buffer{}, &joinErr)
	}()
	waitFor(t, "the joining node's /readyz", func() bool {
		resp, err := http.Get("http://" + http2 + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == 200
	})
	cancel2()
	if code := <-exit2; code != 0 || !strings.Contains(joinErr.String(), "secured") {
		t.Fatalf("joining serve exit %d: %s", code, joinErr.String())
	}

	cancel()
	if code := <-exit; code != 0 || !strings.Contains(serveErr.String(), "secured") {
		t.Fatalf("serve exit %d: %s", code, serveErr.String())
	}
}

func TestServeAuthFlags(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "deploy")
	if code, _, errs := run(t, nil, "auth", "init", dir, "--prefix", "lm"); code != 0 {
		t.Fatalf("auth init: %q", errs)
	}
	s := stdio{err: new(bytes.Buffer), env: parseEnv(nil)}
	c, parse := serveFlags(s)
	if err := parse([]string{"--auth", dir}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.loadAuth(); err != nil || c.prefix != "lm" || c.creds != filepath.Join(dir, "node.creds") {
		t.Errorf("--auth alone: prefix %q creds %q, %v", c.prefix, c.creds, err)
	}
	c, parse = serveFlags(s)
	if err := parse([]string{"--auth", dir, "--prefix", "rl", "--creds", "x.creds"}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.loadAuth(); err == nil || !strings.Contains(err.Error(), `serves prefix "lm"`) {
		t.Errorf("--prefix rl with a deployment of lm: %v", err)
	}
	if code, _, errs := run(t, nil, "serve", "--auth", t.TempDir(), "--http", "127.0.0.1:0"); code != 1 || !strings.Contains(errs, "auth init") {
		t.Errorf("serve --auth with an empty directory: exit %d %q", code, errs)
	}
	// Creds for a deployment that cannot tell the node its callers: refused.
	emb, err := mesh.StartEmbedded(mesh.EmbeddedConfig{Listen: "127.0.0.1:-1", DataDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer emb.Shutdown()
	code, _, errs := run(t, nil, "serve", "--nats-url", emb.ClientURL(), "--creds", filepath.Join(dir, "node.creds"), "--http", "127.0.0.1:0")
	if code != 1 || !strings.Contains(errs, "cannot bind tenants") {
		t.Errorf("serve --creds against an unsecured server: exit %d %q", code, errs)
	}
}
