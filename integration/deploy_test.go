package integration

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/jstest"
	natsserver "github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"
)

// deployDir is the repository's deploy/ directory.
const deployDir = "../deploy"

// loadConfs parses every *.conf under deploy/ with nats-server's own
// parser and returns the options by path relative to deploy/.
func loadConfs(t *testing.T) map[string]*natsserver.Options {
	t.Helper()
	confs := map[string]*natsserver.Options{}
	err := filepath.WalkDir(deployDir, func(path string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, ".conf") {
			return err
		}
		opts, err := natsserver.ProcessConfigFile(path)
		if err != nil {
			t.Errorf("%s: %v", path, err)
			return nil
		}
		rel, _ := filepath.Rel(deployDir, path)
		confs[filepath.ToSlash(rel)] = opts
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return confs
}

// TestDeployConfigs: every NATS config in deploy/ parses, runs JetStream
// with a store directory and has a server name of its own; the three
// cluster configs agree on the cluster and route to exactly the three
// servers, each at its cluster port.
func TestDeployConfigs(t *testing.T) {
	confs := loadConfs(t)
	for _, want := range []string{"nats/single.conf", "nats/cluster-1.conf", "nats/cluster-2.conf", "nats/cluster-3.conf"} {
		if confs[want] == nil {
			t.Errorf("deploy/%s missing or invalid", want)
		}
	}
	names := map[string]string{}
	for path, o := range confs {
		if !o.JetStream || o.StoreDir == "" {
			t.Errorf("%s: JetStream %v, store_dir %q: want JetStream with a store_dir", path, o.JetStream, o.StoreDir)
		}
		if o.ServerName == "" {
			t.Errorf("%s: no server_name", path)
		} else if other, dup := names[o.ServerName]; dup {
			t.Errorf("%s and %s both name their server %q", other, path, o.ServerName)
		}
		names[o.ServerName] = path
	}

	var cluster []*natsserver.Options
	for i := 1; i <= 3; i++ {
		if o := confs["nats/cluster-"+strconv.Itoa(i)+".conf"]; o != nil {
			cluster = append(cluster, o)
		}
	}
	if len(cluster) != 3 {
		t.FailNow()
	}
	// The route targets, as host:port, every config must list.
	var members []string
	for _, o := range cluster {
		members = append(members, net.JoinHostPort(o.ServerName, strconv.Itoa(o.Cluster.Port)))
	}
	slices.Sort(members)
	for i, o := range cluster {
		if o.Cluster.Name != cluster[0].Cluster.Name || o.Cluster.Name == "" {
			t.Errorf("cluster-%d.conf: cluster name %q, cluster-1.conf has %q", i+1, o.Cluster.Name, cluster[0].Cluster.Name)
		}
		if o.Cluster.Port <= 0 {
			t.Errorf("cluster-%d.conf: no cluster listen port", i+1)
		}
		var routes []string
		for _, u := range o.Routes {
			routes = append(routes, u.Host)
		}
		slices.Sort(routes)
		if !slices.Equal(routes, members) {
			t.Errorf("cluster-%d.conf routes %v, want the three members %v", i+1, routes, members)
		}
	}

	compose, err := os.ReadFile(filepath.Join(deployDir, "compose.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for i := 1; i <= 3; i++ {
		for _, want := range []string{
			"nats/cluster-" + strconv.Itoa(i) + ".conf:",
			"nats-" + strconv.Itoa(i) + ":",
			"limitmesh-" + strconv.Itoa(i) + ":",
		} {
			if !strings.Contains(string(compose), want) {
				t.Errorf("compose.yaml does not mention %q", want)
			}
		}
	}
	if !strings.Contains(string(compose), "--replicas=3") {
		t.Error("compose.yaml: the nodes should create buckets with --replicas=3")
	}
}

// TestDeploySingleConfRuns: deploy/nats/single.conf starts a server (ports
// and store moved to free ones and a temporary directory) on which a KV
// bucket can be created.
func TestDeploySingleConfRuns(t *testing.T) {
	opts, err := natsserver.ProcessConfigFile(filepath.Join(deployDir, "nats", "single.conf"))
	if err != nil {
		t.Fatal(err)
	}
	opts.Host, opts.Port = "127.0.0.1", -1
	opts.HTTPHost, opts.HTTPPort = "127.0.0.1", -1
	opts.StoreDir = t.TempDir()
	opts.NoSigs, opts.NoLog = true, true
	s := jstest.Run(t, opts)
	js := jstest.JetStream(t, jstest.Connect(t, s))
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	if _, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "probe", TTL: time.Minute}); err != nil {
		t.Fatalf("create a bucket on single.conf: %v", err)
	}
}
