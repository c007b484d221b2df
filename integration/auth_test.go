package integration

import (
	"bufio"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/auth"
	"github.com/limitmesh/limitmesh/mesh"
	"github.com/limitmesh/limitmesh/mesh/client"
	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// secured is a running secured deployment: an embedded server in operator
// mode configured from a deployment directory, as `serve --auth` runs it.
type secured struct {
	d       *auth.Deployment
	emb     *mesh.Embedded
	dataDir string
}

// startSecured writes a deployment with tenants acme and birch and starts
// an embedded server with it (TCP on a random port).
func startSecured(t *testing.T) *secured {
	t.Helper()
	d, err := auth.Init(t.TempDir(), auth.InitOptions{Tenants: []string{"acme", "birch"}})
	if err != nil {
		t.Fatalf("auth.Init: %v", err)
	}
	dataDir := t.TempDir()
	return &secured{d: d, emb: securedServer(t, d, dataDir), dataDir: dataDir}
}

func securedServer(t *testing.T, d *auth.Deployment, dataDir string) *mesh.Embedded {
	t.Helper()
	e, err := mesh.StartEmbedded(mesh.EmbeddedConfig{Listen: "127.0.0.1:-1", DataDir: dataDir, Configure: d.Configure})
	if err != nil {
		t.Fatalf("StartEmbedded with the deployment: %v", err)
	}
	t.Cleanup(e.Shutdown)
	return e
}

// violations collects the asynchronous errors (permission violations) of
// a connection.
type violations struct {
	mu   sync.Mutex
	errs []string
}

func (v *violations) handler(_ *nats.Conn, _ *nats.Subscription, err error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.errs = append(v.errs, err.Error())
}

// has reports whether an error containing all of parts was seen.
func (v *violations) has(parts ...string) bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	for _, e := range v.errs {
		all := true
		for _, p := range parts {
			all = all && strings.Contains(e, p)
		}
		if all {
			return true
		}
	}
	return false
}

// dial connects to s with a creds file; its async errors go to v (if set).
func (s *secured) dial(t *testing.T, creds string, v *violations) *nats.Conn {
	t.Helper()
	opts := []nats.Option{nats.UserCredentials(creds), nats.Timeout(testTimeout)}
	if v != nil {
		opts = append(opts, nats.ErrorHandler(v.handler))
	}
	nc, err := nats.Connect(s.emb.ClientURL(), opts...)
	if err != nil {
		t.Fatalf("connect with %s: %v", creds, err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// responder answers on the decide subject in LIMITER (as a node does) with
// the Nats-Request-Info values each request arrived with.
func (s *secured) responder(t *testing.T) *nats.Conn {
	t.Helper()
	nc := s.dial(t, s.d.NodeCreds(), nil)
	_, err := nc.Subscribe(auth.DecideSubject(s.d.Prefix), func(m *nats.Msg) {
		b, _ := json.Marshal(m.Header.Values(auth.RequestInfoHeader))
		_ = m.Respond(b)
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	return nc
}

// infos sends a request on the decide subject and returns the
// Nats-Request-Info values the responder saw.
func infos(t *testing.T, nc *nats.Conn, hdr nats.Header) []string {
	t.Helper()
	m, err := nc.RequestMsg(&nats.Msg{Subject: "rl.v1.decide", Header: hdr, Data: []byte("{}")}, testTimeout)
	if err != nil {
		t.Fatalf("request through the import: %v", err)
	}
	var got []string
	if err := json.Unmarshal(m.Data, &got); err != nil {
		t.Fatalf("responder reply %q: %v", m.Data, err)
	}
	return got
}

func binder(t *testing.T, s *secured, nc *nats.Conn) *auth.Binder {
	t.Helper()
	b, err := s.d.Binder(nc, testTimeout)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestSecuredTenantCallsThroughImport: a tenant's request reaches the
// responder in LIMITER through the import, stamped with the tenant's
// account; a forged Nats-Request-Info is replaced; the Binder maps the
// stamp to the tenant and applies the rules.
func TestSecuredTenantCallsThroughImport(t *testing.T) {
	s := startSecured(t)
	node := s.responder(t)
	b := binder(t, s, node)
	acme := s.dial(t, s.d.TenantCreds("acme"), nil)
	admin := s.dial(t, s.d.AdminCreds(), nil)

	got := infos(t, acme, nil)
	if len(got) != 1 {
		t.Fatalf("the responder saw %d Nats-Request-Info values %q, want 1", len(got), got)
	}
	acc, err := auth.RequestInfoAccount(got[0])
	if err != nil || acc != s.d.Tenants["acme"] {
		t.Fatalf("Nats-Request-Info account = %q, %v; want acme's %s", acc, err, s.d.Tenants["acme"])
	}
	for _, c := range []struct {
		tenant, want string
		forbidden    bool
	}{{"", "acme", false}, {"acme", "acme", false}, {"birch", "", true}} {
		bound, err := bind(b, got, c.tenant)
		if bound != c.want || errors.Is(err, auth.ErrForbidden) != c.forbidden {
			t.Errorf("acme's request with tenant %q: Bind = %q, %v; want %q (forbidden %v)", c.tenant, bound, err, c.want, c.forbidden)
		}
	}

	// Forgeries: a header naming another account (birch's, LIMITER's) is
	// replaced by the server; so is one under a second name the server
	// removes too, and one hidden behind a bare line feed is left in place
	// but makes two values, which the Binder refuses.
	for _, forged := range []nats.Header{
		{auth.RequestInfoHeader: {`{"acc":"` + s.d.Tenants["birch"] + `"}`}},
		{auth.RequestInfoHeader: {`{"acc":"` + s.d.LimiterAccount + `"}`}},
		{auth.RequestInfoHeader: {`{"acc":"` + s.d.LimiterAccount + `"}`, `{"acc":"x"}`}},
	} {
		got := infos(t, acme, forged)
		bound, err := bind(b, got, "")
		if len(got) != 1 || bound != "acme" || err != nil {
			t.Errorf("forged %q arrived as %q: Bind = %q, %v; want one value bound to acme", forged, got, bound, err)
		}
	}
	// A raw client can end a header line with a bare line feed, which
	// nats.go splits on but the server does not: the smuggled value stays
	// next to the server's, and the Binder refuses the pair.
	got = rawRequest(t, s.emb.ClientURL(), s.d.TenantCreds("acme"),
		"X-A: b\n"+auth.RequestInfoHeader+`: {"acc":"`+s.d.LimiterAccount+`"}`+"\r\n")
	t.Logf("smuggled: %q", got)
	if bound, err := bind(b, got, "birch"); len(got) != 2 || !errors.Is(err, auth.ErrForbidden) {
		t.Errorf("a smuggled header arrived as %q: Bind = %q, %v; want two values, forbidden", got, bound, err)
	}

	// LIMITER's own requests cross no import: no header, trusted.
	got = infos(t, admin, nil)
	if bound, err := bind(b, got, "birch"); len(got) != 0 || bound != "birch" || err != nil {
		t.Errorf("admin's request arrived with %q: Bind = %q, %v; want no header, birch", got, bound, err)
	}
	birch := s.dial(t, s.d.TenantCreds("birch"), nil)
	if bound, err := bind(b, infos(t, birch, nil), ""); bound != "birch" || err != nil {
		t.Errorf("birch's request: Bind = %q, %v", bound, err)
	}
}

// TestSecuredTenantIsolation: a tenant can use only the decide service.
func TestSecuredTenantIsolation(t *testing.T) {
	s := startSecured(t)
	node := s.dial(t, s.d.NodeCreds(), nil)
	var v violations
	acme := s.dial(t, s.d.TenantCreds("acme"), &v)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()

	// LIMITER's JetStream works; it is invisible to the tenant.
	js, err := jetstream.New(node)
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range []string{"rl_policies", "rl_state", "rl_ledger"} {
		if _, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: b}); err != nil {
			t.Fatalf("node creates %s: %v", b, err)
		}
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "RL_USAGE", Subjects: []string{"rl.usage.>"}}); err != nil {
		t.Fatalf("node creates RL_USAGE: %v", err)
	}

	// Node-side subscribers on the subjects a tenant must not reach.
	seen := make(chan string, 16)
	for _, subj := range []string{"rl.v1.shard.*", "$JS.API.>", "rl.usage.>", "$KV.>"} {
		if _, err := node.Subscribe(subj, func(m *nats.Msg) { seen <- m.Subject }); err != nil {
			t.Fatal(err)
		}
	}
	if err := node.Flush(); err != nil {
		t.Fatal(err)
	}

	// Publishing outside the decide subject is refused.
	for _, subj := range []string{"rl.v1.shard.3", "$JS.API.STREAM.INFO.KV_rl_policies", "$KV.rl_policies.x", "rl.usage.acme"} {
		if err := acme.Publish(subj, []byte("x")); err != nil {
			t.Fatal(err)
		}
	}
	// Subscribing to the shard subjects (impersonating a node) is refused.
	if _, err := acme.SubscribeSync("rl.v1.shard.*"); err != nil {
		t.Fatal(err)
	}
	if _, err := acme.SubscribeSync(">"); err != nil {
		t.Fatal(err)
	}
	if err := acme.Flush(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the tenant's permission violations", func() bool {
		return v.has("Publish", "rl.v1.shard.3") && v.has("Publish", "$JS.API.STREAM.INFO.KV_rl_policies") &&
			v.has("Publish", "$KV.rl_policies.x") && v.has("Publish", "rl.usage.acme") &&
			v.has("Subscription", "rl.v1.shard.*") && v.has("Subscription", `">"`)
	})
	// Nothing reached LIMITER: a marker sent after the tenant's publishes
	// were processed (its flush) arrives first.
	if err := node.Publish("rl.v1.shard.marker", nil); err != nil {
		t.Fatal(err)
	}
	select {
	case subj := <-seen:
		if subj != "rl.v1.shard.marker" {
			t.Fatalf("a tenant's publish reached LIMITER on %s", subj)
		}
	case <-time.After(testTimeout):
		t.Fatal("the marker did not arrive")
	}

	// The tenant's JetStream API is not LIMITER's (and is disabled).
	tjs, err := jetstream.New(acme)
	if err != nil {
		t.Fatal(err)
	}
	short, cancelShort := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancelShort()
	if _, err := tjs.KeyValue(short, "rl_policies"); err == nil {
		t.Fatal("the tenant opened rl_policies")
	}

	// Another account's traffic is invisible: acme's inbox subscription
	// (allowed) sees nothing of birch's or LIMITER's inboxes.
	inbox, err := acme.SubscribeSync("_INBOX.>")
	if err != nil {
		t.Fatal(err)
	}
	if err := acme.Flush(); err != nil {
		t.Fatal(err)
	}
	s.responder(t)
	birch := s.dial(t, s.d.TenantCreds("birch"), nil)
	infos(t, birch, nil)
	if err := node.Publish("_INBOX.limiter", []byte("x")); err != nil {
		t.Fatal(err)
	}
	if err := node.Flush(); err != nil {
		t.Fatal(err)
	}
	if err := acme.Publish("rl.v1.decide", []byte("{}")); err != nil { // a request whose reply has no inbox
		t.Fatal(err)
	}
	if err := acme.Flush(); err != nil {
		t.Fatal(err)
	}
	if m, err := inbox.NextMsg(200 * time.Millisecond); err == nil {
		t.Fatalf("acme received %s: %q", m.Subject, m.Data)
	}
}

// TestSecuredRefusesUnauthenticated: connections need valid credentials.
func TestSecuredRefusesUnauthenticated(t *testing.T) {
	s := startSecured(t)
	if nc, err := nats.Connect(s.emb.ClientURL(), nats.Timeout(testTimeout)); err == nil {
		nc.Close()
		t.Fatal("a connection without credentials was accepted")
	} else if !strings.Contains(strings.ToLower(err.Error()), "authorization violation") {
		t.Fatalf("connection without credentials: %v, want an authorization violation", err)
	}
	// Creds of another operator's deployment are refused too.
	other, err := auth.Init(t.TempDir(), auth.InitOptions{Tenants: []string{"acme"}})
	if err != nil {
		t.Fatal(err)
	}
	if nc, err := nats.Connect(s.emb.ClientURL(), nats.UserCredentials(other.TenantCreds("acme")), nats.Timeout(testTimeout)); err == nil {
		nc.Close()
		t.Fatal("a foreign operator's creds were accepted")
	}
}

// TestSecuredAdminPolicies: the admin user puts and reads policies.
func TestSecuredAdminPolicies(t *testing.T) {
	s := startSecured(t)
	node := s.dial(t, s.d.NodeCreds(), nil)
	startNodeOn(t, node, mesh.NodeConfig{})
	admin := s.dial(t, s.d.AdminCreds(), nil)
	doc := `{"match":{"tenant":"acme"},"key":["tenant"],"limits":[{"name":"rate","algorithm":"token_bucket","rate":"1/h","burst":2}]}`
	rev := putPolicy(t, admin, "rl_policies", "acme", doc)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	js, _ := jetstream.New(admin)
	kv, err := js.KeyValue(ctx, "rl_policies")
	if err != nil {
		t.Fatal(err)
	}
	e, err := kv.Get(ctx, "acme")
	if err != nil || string(e.Value()) != doc || e.Revision() != rev {
		t.Fatalf("admin reads back %v, %v", e, err)
	}
	// The node, in operator mode, decides for a tenant through its import.
	acme := s.dial(t, s.d.TenantCreds("acme"), nil)
	waitFor(t, "the policy on the node", func() bool {
		return decide(t, acme, "rl.v1.decide", req(map[string]string{"tenant": "acme"}, `"dry_run":true`)).Policy == "acme"
	})
	for i, want := range []bool{true, true, false} {
		if r := decide(t, acme, "rl.v1.decide", req(map[string]string{"tenant": "acme"}, "")); r.Allowed != want || r.Code != "" {
			t.Fatalf("decision %d of acme: %+v, want allowed=%v", i, r, want)
		}
	}
	// The Go SDK works for a tenant when it sends every request to the
	// decide subject: a tenant may not publish to the shard subjects its
	// partition hints would use.
	c, err := client.New(acme, client.PartitionHints(0))
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 3; i++ {
		if r, err := c.Decide(ctx, map[string]string{"tenant": "acme"}, 1, client.DryRun()); err != nil || r.Policy != "acme" {
			t.Fatalf("SDK decision %d: %+v, %v", i, r, err)
		}
	}
}

// startNodeOn starts a node on an existing connection; Stop at cleanup.
func startNodeOn(t *testing.T, nc *nats.Conn, cfg mesh.NodeConfig) *mesh.Node {
	t.Helper()
	n, err := mesh.NewNode(nc, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	if err := n.Start(ctx); err != nil {
		t.Fatalf("node start on the secured server: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
		defer cancel()
		_ = n.Stop(ctx)
	})
	return n
}

// TestSecuredAddTenantLive: a tenant added to a running server connects
// and calls at once; after a restart from the same data directory it
// still can.
func TestSecuredAddTenantLive(t *testing.T) {
	s := startSecured(t)
	node := s.responder(t)
	b := binder(t, s, node) // made before the tenant existed: it looks cypress up from the server
	if _, err := nats.Connect(s.emb.ClientURL(), nats.UserCredentials(s.d.TenantCreds("cypress")), nats.Timeout(time.Second)); err == nil {
		t.Fatal("cypress connected before it was added")
	}
	d, accountJWT, err := auth.AddTenant(s.d.Dir, "cypress")
	if err != nil {
		t.Fatal(err)
	}
	sys := s.dial(t, d.SystemCreds(), nil)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	if err := auth.PushAccount(ctx, sys, accountJWT); err != nil {
		t.Fatalf("push: %v", err)
	}
	cypress := s.dial(t, d.TenantCreds("cypress"), nil)
	got := infos(t, cypress, nil)
	if bound, err := bind(b, got, ""); bound != "cypress" || err != nil {
		t.Fatalf("cypress: Bind = %q, %v", bound, err)
	}
	if _, err := bind(b, got, "acme"); !errors.Is(err, auth.ErrForbidden) {
		t.Fatalf("cypress naming acme: %v, want forbidden", err)
	}

	// A push of garbage is refused. The resolver stores an account JWT of
	// another operator (it checks the JWT, not its signer) but the server
	// lets none of its users in.
	if err := auth.PushAccount(ctx, sys, "not a jwt"); !errors.Is(err, auth.ErrPush) {
		t.Fatalf("push of garbage: %v, want ErrPush", err)
	}
	foreign, err := auth.Init(t.TempDir(), auth.InitOptions{Tenants: []string{"mallory"}})
	if err != nil {
		t.Fatal(err)
	}
	fj, _ := foreign.AccountJWT(foreign.Tenants["mallory"])
	_ = auth.PushAccount(ctx, sys, fj)
	if nc, err := nats.Connect(s.emb.ClientURL(), nats.UserCredentials(foreign.TenantCreds("mallory")), nats.Timeout(time.Second)); err == nil {
		nc.Close()
		t.Fatal("a user of a pushed foreign account connected")
	}

	// A restart from the same data directory, configured from the
	// deployment as it was before cypress: the resolver kept the push.
	s.emb.Shutdown()
	s.emb = securedServer(t, s.d, s.dataDir)
	s.responder(t)
	cypress = s.dial(t, d.TenantCreds("cypress"), nil)
	b = binder(t, s, s.dial(t, s.d.NodeCreds(), nil))
	if bound, err := bind(b, infos(t, cypress, nil), ""); bound != "cypress" || err != nil {
		t.Fatalf("cypress after a restart: Bind = %q, %v", bound, err)
	}
}

// TestSecuredClusterAddTenant: two servers in one cluster, both configured
// from the deployment: a tenant pushed to one connects to the other and
// reaches a responder on the first.
func TestSecuredClusterAddTenant(t *testing.T) {
	if testing.Short() {
		t.Skip("cluster test")
	}
	d, err := auth.Init(t.TempDir(), auth.InitOptions{Tenants: []string{"acme"}})
	if err != nil {
		t.Fatal(err)
	}
	ports := freePorts(t, 2)
	routes := []string{fmt.Sprintf("nats://127.0.0.1:%d", ports[0]), fmt.Sprintf("nats://127.0.0.1:%d", ports[1])}
	var servers []*secured
	for i := range 2 {
		e, err := mesh.StartEmbedded(mesh.EmbeddedConfig{
			Listen: "127.0.0.1:-1", DataDir: t.TempDir(), ServerName: fmt.Sprintf("s%d", i), Configure: d.Configure,
			ClusterName: "lm", ClusterListen: fmt.Sprintf("127.0.0.1:%d", ports[i]), Routes: routes,
		})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(e.Shutdown)
		servers = append(servers, &secured{d: d, emb: e})
	}
	waitFor(t, "the route", func() bool {
		return servers[0].emb.Server().NumRoutes() > 0 && servers[1].emb.Server().NumRoutes() > 0
	})
	// Both accounts are loaded on s1 before the responder subscribes on
	// s0, as in a deployment (a node on every server): interest learnt
	// over a route for an account a server has not loaded yet goes on an
	// incomplete account that a later fetch completes (nats-server's
	// processRemoteSub), a path this test, about a pushed tenant, does
	// not depend on.
	servers[1].dial(t, d.NodeCreds(), nil)
	acme := servers[1].dial(t, d.TenantCreds("acme"), nil)
	b := binder(t, servers[0], servers[0].responder(t))
	// The responder's interest reaches the second server.
	waitFor(t, "the responder's interest on s1", func() bool {
		_, err := acme.Request("rl.v1.decide", nil, 100*time.Millisecond)
		return err == nil
	})

	d2, accountJWT, err := auth.AddTenant(d.Dir, "cypress")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	if err := auth.PushAccount(ctx, servers[0].dial(t, d2.SystemCreds(), nil), accountJWT); err != nil {
		t.Fatal(err)
	}
	var cypress *nats.Conn
	waitFor(t, "cypress accepted by s1", func() bool {
		nc, err := nats.Connect(servers[1].emb.ClientURL(), nats.UserCredentials(d2.TenantCreds("cypress")))
		if err != nil {
			return false
		}
		t.Cleanup(nc.Close)
		cypress = nc
		return true
	})
	if bound, err := bind(b, infos(t, cypress, nil), ""); bound != "cypress" || err != nil {
		t.Fatalf("cypress through s1: Bind = %q, %v", bound, err)
	}
}

// TestSecuredLookupFromLimiter: the node's connection reads any account's
// JWT from the resolver (the import of the lookup from SYS).
func TestSecuredLookupFromLimiter(t *testing.T) {
	s := startSecured(t)
	node := s.dial(t, s.d.NodeCreds(), nil)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	text, err := auth.ServerLookup(node)(ctx, s.d.Tenants["birch"])
	if err != nil {
		t.Fatal(err)
	}
	ac, err := jwt.DecodeAccountClaims(text)
	if err != nil || ac.Name != "birch" {
		t.Fatalf("lookup of birch: %v, %v", ac, err)
	}
	b, err := auth.DiscoverBinder(ctx, node, s.d.NodeCreds(), testTimeout)
	if err != nil {
		t.Fatal(err)
	}
	s.responder(t)
	birch := s.dial(t, s.d.TenantCreds("birch"), nil)
	if bound, err := bind(b, infos(t, birch, nil), ""); bound != "birch" || err != nil {
		t.Fatalf("discovered binder: %q, %v", bound, err)
	}
}

// rawRequest sends one request on rl.v1.decide over the raw NATS protocol
// with the header lines hdr (each ending in CRLF, written as given) and
// returns the responder's reply: the Nats-Request-Info values it saw.
func rawRequest(t *testing.T, url, creds, hdr string) []string {
	t.Helper()
	b, err := os.ReadFile(creds)
	if err != nil {
		t.Fatal(err)
	}
	userJWT, err := jwt.ParseDecoratedJWT(b)
	if err != nil {
		t.Fatal(err)
	}
	kp, err := jwt.ParseDecoratedNKey(b)
	if err != nil {
		t.Fatal(err)
	}
	conn, err := net.DialTimeout("tcp", strings.TrimPrefix(url, "nats://"), testTimeout)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(testTimeout))
	r := bufio.NewReader(conn)
	line, err := r.ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "INFO ") {
		t.Fatalf("INFO: %q, %v", line, err)
	}
	var info struct {
		Nonce string `json:"nonce"`
	}
	if err := json.Unmarshal([]byte(strings.TrimPrefix(line, "INFO ")), &info); err != nil {
		t.Fatal(err)
	}
	sig, err := kp.Sign([]byte(info.Nonce))
	if err != nil {
		t.Fatal(err)
	}
	connect, _ := json.Marshal(map[string]any{"verbose": false, "pedantic": false, "protocol": 1, "headers": true,
		"jwt": userJWT, "sig": base64.RawURLEncoding.EncodeToString(sig)})
	block := "NATS/1.0\r\n" + hdr + "\r\n"
	payload := "{}"
	fmt.Fprintf(conn, "CONNECT %s\r\nSUB _INBOX.raw.* 1\r\nHPUB rl.v1.decide _INBOX.raw.1 %d %d\r\n%s%s\r\nPING\r\n",
		connect, len(block), len(block)+len(payload), block, payload)
	for {
		line, err := r.ReadString('\n')
		if err != nil {
			t.Fatalf("raw client: %v", err)
		}
		switch f := strings.Fields(line); {
		case len(f) == 0:
		case f[0] == "PING":
			fmt.Fprint(conn, "PONG\r\n")
		case f[0] == "-ERR":
			t.Fatalf("raw client: %s", line)
		case f[0] == "MSG" && len(f) == 4:
			n, _ := strconv.Atoi(f[3])
			buf := make([]byte, n+2)
			if _, err := io.ReadFull(r, buf); err != nil {
				t.Fatal(err)
			}
			var got []string
			if err := json.Unmarshal(buf[:n], &got); err != nil {
				t.Fatalf("reply %q: %v", buf[:n], err)
			}
			return got
		}
	}
}

// BenchmarkSecuredDecide compares a tenant's decisions through the decide
// service's import (secured; "share": the import shares the caller's whole
// identity, user JWT included, in Nats-Request-Info) with the same load on
// an unsecured server: 64 requests in flight over 64 keys, one node. Two
// raw NATS echoes answer the same requests, unsecured and through the same
// import, so the paired run also gives what the import costs NATS alone
// (echo-secured/echo) next to what it costs a decision (secured/unsecured).
func BenchmarkSecuredDecide(b *testing.B) {
	keys := make([][]byte, 64)
	for i := range keys {
		keys[i] = fmt.Appendf(nil, `{"descriptor":{"tenant":"acme","user":"u%d"}}`, i)
	}
	body := func(i int64) []byte { return keys[i%64] }

	unsecured, _ := benchSetup(b)
	// securedServer starts a secured embedded server (tenant acme) and
	// returns its deployment and a dialer of its users.
	securedServer := func(share bool) (*auth.Deployment, func(creds string) *nats.Conn) {
		d, err := auth.Init(b.TempDir(), auth.InitOptions{Tenants: []string{"acme"}, ShareIdentity: share})
		if err != nil {
			b.Fatal(err)
		}
		e, err := mesh.StartEmbedded(mesh.EmbeddedConfig{Listen: "127.0.0.1:-1", DataDir: b.TempDir(), Configure: d.Configure})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(e.Shutdown)
		return d, func(creds string) *nats.Conn {
			nc, err := nats.Connect(e.ClientURL(), nats.UserCredentials(creds))
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(nc.Close)
			return nc
		}
	}
	tenant := func(share bool) *nats.Conn {
		d, dial := securedServer(share)
		node := dial(d.NodeCreds())
		n, err := mesh.NewNode(node, mesh.NodeConfig{})
		if err != nil {
			b.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
		defer cancel()
		if err := n.Start(ctx); err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = n.Stop(context.Background()) })
		rev := putPolicy(b, dial(d.AdminCreds()), "rl_policies", "bench", benchPolicy)
		nc := dial(d.TenantCreds("acme"))
		waitFor(b, "bench policy", func() bool {
			return decide(b, nc, "rl.v1.decide", `{"descriptor":{"tenant":"t","user":"u"},"dry_run":true}`).Revision == rev
		})
		return nc
	}
	secured, shared := tenant(false), tenant(true)
	// The same requests answered by a raw NATS echo on rl.v1.decide (a
	// responder on the node's connection, no node), unsecured and through
	// the secured import: what the import costs NATS itself.
	echo := func(nc *nats.Conn) {
		reply := []byte(`{"allowed":true,"policy":"bench","revision":1,"remaining":999999999,"retry_after_ms":0,"reset_after_ms":1}`)
		if _, err := nc.QueueSubscribe("rl.v1.decide", "echo", func(m *nats.Msg) { _ = m.Respond(reply) }); err != nil {
			b.Fatal(err)
		}
		if err := nc.Flush(); err != nil {
			b.Fatal(err)
		}
	}
	echoPlain := func() *nats.Conn {
		e := server(b, b.TempDir())
		echo(connect(b, e))
		return connect(b, e)
	}
	echoSecured := func() *nats.Conn {
		d, dial := securedServer(false)
		echo(dial(d.NodeCreds()))
		return dial(d.TenantCreds("acme"))
	}
	modes := []struct {
		name string
		nc   *nats.Conn
	}{{"unsecured", unsecured}, {"secured", secured}, {"secured-share", shared},
		{"echo", echoPlain()}, {"echo-secured", echoSecured()}}
	for _, c := range modes {
		b.Run(c.name, func(b *testing.B) { runRequests(b, c.nc, "rl.v1.decide", body, 64) })
	}
	// Paired: the modes alternate in short slices, so that a busy machine
	// slows them alike; the ratios are throughputs against unsecured.
	b.Run("paired", func(b *testing.B) {
		const rounds, slice = 6, time.Second
		done := make([]int64, len(modes))
		for r := 0; r < rounds; r++ {
			// Each round in the other order: no mode always follows
			// the same one (whose node may still be busy with its
			// usage records).
			for k := range modes {
				i := k
				if r%2 == 1 {
					i = len(modes) - 1 - k
				}
				done[i] += drive(b, modes[i].nc, body, 64, slice)
			}
		}
		for i, c := range modes[1:3] {
			b.ReportMetric(float64(done[i+1])/float64(done[0]), c.name+"/unsecured")
		}
		b.ReportMetric(float64(done[4])/float64(done[3]), "echo-secured/echo")
		b.ReportMetric(float64(done[0])/float64(done[3]), "unsecured/echo")
		b.ReportMetric(float64(done[1])/float64(done[4]), "secured/echo-secured")
	})
}

// drive sends requests with inflight in flight on nc for d and returns
// how many were answered.
func drive(b *testing.B, nc *nats.Conn, body func(int64) []byte, inflight int, d time.Duration) int64 {
	var n atomic.Int64
	stop := time.Now().Add(d)
	var wg sync.WaitGroup
	for g := 0; g < inflight; g++ {
		wg.Go(func() {
			for time.Now().Before(stop) {
				i := n.Add(1)
				if _, err := nc.Request("rl.v1.decide", body(i), testTimeout); err != nil {
					b.Errorf("request: %v", err)
					return
				}
			}
		})
	}
	wg.Wait()
	return n.Load()
}

// TestAuthImportsNothingOfTheProject: auth sits below mesh (mesh calls its
// Binder) and must not import mesh or any other limitmesh package, except
// the module's primitives (internal/..., themselves importing nothing of
// the project: internal/wire).
func TestAuthImportsNothingOfTheProject(t *testing.T) {
	const module = "github.com/limitmesh/limitmesh/"
	deps := func(pkg string) []string {
		out, err := exec.Command("go", "list", "-deps", pkg).Output()
		if err != nil {
			t.Fatalf("go list %s: %v", pkg, err)
		}
		var own []string
		for _, p := range strings.Fields(string(out)) {
			if strings.HasPrefix(p, module) && p != pkg {
				own = append(own, p)
			}
		}
		return own
	}
	for _, p := range deps(module + "auth") {
		if !strings.HasPrefix(p, module+"internal/") {
			t.Errorf("auth imports %s", p)
			continue
		}
		if sub := deps(p); len(sub) > 0 {
			t.Errorf("auth imports %s, which imports %v", p, sub)
		}
	}
}

// bind binds a request as the node does: its caller, then the tenant.
func bind(b *auth.Binder, infos []string, tenant string) (string, error) {
	caller, err := b.Caller(infos)
	if err != nil {
		return "", err
	}
	return auth.BindTenant(caller, tenant)
}
