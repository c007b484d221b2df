package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/limitmesh/limitmesh/internal/jstest"
	"github.com/nats-io/nats-server/v2/server"
)

// TestAuthNATSConfigServer: a nats-server of its own, configured as
// deploy/kubernetes/secured configures its servers (JetStream, and the
// include of `limitmesh auth nats-config`), runs the secured deployment:
// a node joins it with --nats-url and the node's creds, a tenant decides
// through the service import, and a connection without creds is refused.
func TestAuthNATSConfigServer(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "secure")
	if code, _, errs := run(t, nil, "auth", "init", dir, "--tenants", "acme"); code != 0 {
		t.Fatalf("auth init: %q", errs)
	}
	conf := t.TempDir()
	code, out, errs := run(t, nil, "auth", "nats-config", dir, "--resolver-dir", filepath.Join(conf, "jwt"))
	if code != 0 {
		t.Fatalf("auth nats-config: exit %d %q", code, errs)
	}
	for _, secret := range secrets(t, dir) {
		if strings.Contains(out, secret) {
			t.Fatal("nats-config printed a secret")
		}
	}
	natsAddr := freeAddr(t)
	host, port, _ := net.SplitHostPort(natsAddr)
	if err := os.WriteFile(filepath.Join(conf, "auth.conf"), []byte(out), 0o600); err != nil {
		t.Fatal(err)
	}
	main := "listen: " + host + ":" + port + "\njetstream { store_dir: " + strconv.Quote(filepath.Join(conf, "js")) + " }\ninclude auth.conf\n"
	if err := os.WriteFile(filepath.Join(conf, "nats.conf"), []byte(main), 0o600); err != nil {
		t.Fatal(err)
	}
	opts, err := server.ProcessConfigFile(filepath.Join(conf, "nats.conf"))
	if err != nil {
		t.Fatalf("nats-server rejects the configuration: %v\n%s", err, out)
	}
	jstest.Run(t, opts)

	httpAddr := freeAddr(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var serveErr syncBuffer
	exit := make(chan int, 1)
	go func() {
		exit <- Main(ctx, []string{"serve", "--nats-url", "nats://" + natsAddr, "--http", httpAddr},
			[]string{"LIMITMESH_CREDS=" + filepath.Join(dir, "node.creds")}, strings.NewReader(""), &bytes.Buffer{}, &serveErr)
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
	policy := filepath.Join(t.TempDir(), "acme.json")
	os.WriteFile(policy, []byte(`{"match":{"tenant":"acme"},"key":["tenant"],"limits":[{"algorithm":"token_bucket","rate":"1/h","burst":5}]}`), 0o644)
	if code, out, errs := run(t, []string{url, "LIMITMESH_CREDS=" + filepath.Join(dir, "admin.creds")}, "policy", "put", "acme", policy); code != 0 {
		t.Fatalf("policy put as admin: exit %d %q %q", code, out, errs)
	}
	if code, _, errs := run(t, []string{url}, "policy", "list"); code != 1 || !strings.Contains(errs, "Authorization Violation") {
		t.Fatalf("policy list without creds: exit %d %q", code, errs)
	}
	acme := []string{url, "LIMITMESH_CREDS=" + filepath.Join(dir, "tenants", "acme.creds")}
	waitFor(t, "the tenant's decision by its policy", func() bool {
		code, out, _ := run(t, acme, "decide", "-d", "operation=search")
		var reply map[string]any
		return code == 0 && json.Unmarshal([]byte(out), &reply) == nil && reply["policy"] == "acme" && reply["allowed"] == true
	})

	cancel()
	if code := <-exit; code != 0 || !strings.Contains(serveErr.String(), "secured") {
		t.Fatalf("serve exit %d: %s", code, serveErr.String())
	}
}
