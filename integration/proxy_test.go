package integration

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/jstest"
	"github.com/limitmesh/limitmesh/mesh"
	natsserver "github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
)

// proxy forwards TCP connections from its loopback listener to a target.
// Cut closes every connection it carries and refuses new ones until Heal.
// Hold keeps what the target sends from reaching the clients until
// Release (a Cut in between drops it). It is safe for concurrent use.
type proxy struct {
	l      net.Listener
	target string

	mu       sync.Mutex
	cut      bool
	held     bool
	released *sync.Cond // broadcast when held or cut changes
	conns    map[net.Conn]struct{}
	wg       sync.WaitGroup
}

// newProxy listens on a free loopback port and forwards to target; it
// stops at cleanup.
func newProxy(t testing.TB, target string) *proxy {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &proxy{l: l, target: target, conns: map[net.Conn]struct{}{}}
	p.released = sync.NewCond(&p.mu)
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.close)
	return p
}

// Addr is the proxy's host:port.
func (p *proxy) Addr() string { return p.l.Addr().String() }

func (p *proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.l.Accept()
		if err != nil {
			return
		}
		p.wg.Add(1)
		go func() { defer p.wg.Done(); p.serve(c) }()
	}
}

// serve pipes c to a new connection to the target, both ways.
func (p *proxy) serve(c net.Conn) {
	if !p.track(c) {
		c.Close()
		return
	}
	defer p.untrack(c)
	d, err := net.DialTimeout("tcp", p.target, time.Second)
	if err != nil {
		return
	}
	if !p.track(d) {
		d.Close()
		return
	}
	defer p.untrack(d)
	done := make(chan struct{}, 2)
	pipe := func(dst, src net.Conn, copy func(dst, src net.Conn)) {
		copy(dst, src)
		// Either side ending ends both.
		dst.Close()
		src.Close()
		done <- struct{}{}
	}
	go pipe(d, c, func(dst, src net.Conn) { _, _ = io.Copy(dst, src) })
	go pipe(c, d, p.copyHeld)
	<-done
	<-done
}

// copyHeld copies src to dst, each chunk once the proxy is not held; a
// chunk waiting when the proxy is cut is dropped.
func (p *proxy) copyHeld(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			p.mu.Lock()
			for p.held && !p.cut {
				p.released.Wait()
			}
			cut := p.cut
			p.mu.Unlock()
			if cut {
				return
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// Hold stops forwarding what the target sends: it waits in the proxy
// (and in the target's socket buffers) until Release.
func (p *proxy) Hold() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.held = true
}

// Release forwards what the target sends again, what waited first.
func (p *proxy) Release() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.held = false
	p.released.Broadcast()
}

// track registers a connection; false if the proxy is cut.
func (p *proxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cut {
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

func (p *proxy) untrack(c net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.conns, c)
	c.Close()
}

// Cut closes all connections and refuses new ones.
func (p *proxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = true
	p.released.Broadcast()
	for c := range p.conns {
		c.Close()
	}
}

// Heal accepts and forwards connections again.
func (p *proxy) Heal() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = false
}

func (p *proxy) close() {
	p.Cut()
	p.l.Close()
	p.wg.Wait()
}

// proxiedCluster is a JetStream cluster of in-process servers whose routes
// all pass through proxies, one per ordered pair of servers, so a test can
// cut a server off from the others and heal it again.
type proxiedCluster struct {
	servers []*natsserver.Server
	opts    []*natsserver.Options
	// proxies[i][j] carries the routes server i dials to server j.
	proxies [][]*proxy
}

// startProxiedCluster starts n servers named p0..p(n-1), each with its
// routes through the proxies and Cluster.NoAdvertise set; gossiped route
// addresses point at a closed port, so no server reaches another around
// the proxies. It waits for a JetStream meta leader.
func startProxiedCluster(t *testing.T, n int) *proxiedCluster {
	t.Helper()
	clusterPorts := freePorts(t, n)
	deadPort := freePorts(t, 1)[0] // nothing listens here
	pc := &proxiedCluster{proxies: make([][]*proxy, n)}
	for i := 0; i < n; i++ {
		pc.proxies[i] = make([]*proxy, n)
		for j := 0; j < n; j++ {
			if i != j {
				pc.proxies[i][j] = newProxy(t, fmt.Sprintf("127.0.0.1:%d", clusterPorts[j]))
			}
		}
	}
	for i := 0; i < n; i++ {
		o := &natsserver.Options{
			ServerName: fmt.Sprintf("p%d", i),
			Host:       "127.0.0.1",
			Port:       -1,
			JetStream:  true,
			StoreDir:   t.TempDir(),
			NoSigs:     true,
			NoLog:      true,
			Cluster: natsserver.ClusterOpts{
				Name:        "lm",
				Host:        "127.0.0.1",
				Port:        clusterPorts[i],
				NoAdvertise: true,
				Advertise:   fmt.Sprintf("127.0.0.1:%d", deadPort),
			},
		}
		for j := 0; j < n; j++ {
			if i != j {
				o.Routes = append(o.Routes, natsserver.RoutesFromStr("nats://"+pc.proxies[i][j].Addr())...)
			}
		}
		pc.opts = append(pc.opts, o)
	}
	pc.servers = make([]*natsserver.Server, n)
	for i := range pc.servers {
		pc.start(t, i)
	}
	waitFor(t, "JetStream meta leader", func() bool {
		for _, s := range pc.servers {
			if s.JetStreamIsLeader() {
				return true
			}
		}
		return false
	})
	return pc
}

// start (re)starts server i with its options.
func (pc *proxiedCluster) start(t *testing.T, i int) {
	t.Helper()
	pc.servers[i] = jstest.Run(t, pc.opts[i])
}

// URL is server i's client URL.
func (pc *proxiedCluster) URL(i int) string { return pc.servers[i].ClientURL() }

// Isolate cuts every route between server k and the others and waits
// until k has no routes left.
func (pc *proxiedCluster) Isolate(t *testing.T, k int) {
	t.Helper()
	for i := range pc.proxies {
		if i != k {
			pc.proxies[i][k].Cut()
			pc.proxies[k][i].Cut()
		}
	}
	waitFor(t, fmt.Sprintf("server %d cut off", k), func() bool {
		return pc.servers[k].NumRoutes() == 0
	})
}

// Heal re-enables server k's routes and waits until it has routes to all
// others again.
func (pc *proxiedCluster) Heal(t *testing.T, k int) {
	t.Helper()
	for i := range pc.proxies {
		if i != k {
			pc.proxies[i][k].Heal()
			pc.proxies[k][i].Heal()
		}
	}
	waitFor(t, fmt.Sprintf("server %d rejoined", k), func() bool {
		return pc.peersConnected(k)
	})
}

// peersConnected reports whether server k has a route to every other.
func (pc *proxiedCluster) peersConnected(k int) bool {
	rz, err := pc.servers[k].Routez(nil)
	if err != nil {
		return false
	}
	seen := map[string]bool{}
	for _, r := range rz.Routes {
		seen[r.RemoteName] = true
	}
	return len(seen) == len(pc.servers)-1
}

// TestProxyCutAndHeal: the proxy forwards, Cut closes open connections
// and refuses new ones, Heal forwards again.
func TestProxyCutAndHeal(t *testing.T) {
	e := server(t, t.TempDir())
	p := newProxy(t, e.Server().Addr().String())
	nc, err := nats.Connect("nats://"+p.Addr(), nats.NoReconnect())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	p.Cut()
	waitFor(t, "connection through the cut proxy closed", nc.IsClosed)
	if _, err := nats.Connect("nats://"+p.Addr(), nats.Timeout(time.Second)); err == nil {
		t.Fatal("connected through a cut proxy")
	}
	p.Heal()
	nc2, err := nats.Connect("nats://" + p.Addr())
	if err != nil {
		t.Fatalf("connect after heal: %v", err)
	}
	nc2.Close()
}

// TestProxiedClusterIsolate: with every route through the proxies, cutting
// one server leaves it without routes while the other two stay connected;
// healing reconnects it.
func TestProxiedClusterIsolate(t *testing.T) {
	pc := startProxiedCluster(t, 3)
	for k := range pc.servers {
		waitFor(t, "full mesh", func() bool { return pc.peersConnected(k) })
	}
	pc.Isolate(t, 2)
	for _, k := range []int{0, 1} {
		waitFor(t, "majority routes only to each other", func() bool {
			names := mustRoutez(t, pc.servers[k])
			return len(names) > 0 && !slices.Contains(names, "p2")
		})
	}
	pc.Heal(t, 2)
}

func mustRoutez(t *testing.T, s *natsserver.Server) []string {
	t.Helper()
	rz, err := s.Routez(nil)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, r := range rz.Routes {
		names = append(names, r.RemoteName)
	}
	return names
}

// embeddedCluster starts n servers (mesh.StartEmbedded, names e0..) in one
// JetStream cluster with direct routes and waits for a meta leader.
func embeddedCluster(t *testing.T, n int) []*mesh.Embedded {
	t.Helper()
	ports := freePorts(t, n)
	var routes []string
	for _, p := range ports {
		routes = append(routes, fmt.Sprintf("nats://127.0.0.1:%d", p))
	}
	servers := make([]*mesh.Embedded, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range servers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			servers[i], errs[i] = mesh.StartEmbedded(mesh.EmbeddedConfig{
				Listen: "127.0.0.1:-1", DataDir: t.TempDir(), ServerName: fmt.Sprintf("e%d", i),
				ClusterName: "lm", ClusterListen: fmt.Sprintf("127.0.0.1:%d", ports[i]), Routes: routes,
			})
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("server %d: %v", i, err)
		}
		t.Cleanup(servers[i].Shutdown)
	}
	waitFor(t, "JetStream meta leader", func() bool {
		for _, s := range servers {
			if s.Server().JetStreamIsLeader() {
				return true
			}
		}
		return false
	})
	return servers
}

// startNodeRetry starts a node on a connection to urls (reconnecting to
// any of them), retrying the start while the cluster cannot create R3
// buckets yet, and serves its HTTPHandler; the node stops at cleanup. A
// node without a NodeID is named as runNode names it.
func startNodeRetry(t *testing.T, cfg mesh.NodeConfig, urls ...string) *testNode {
	t.Helper()
	if cfg.NodeID == "" {
		cfg.NodeID = "node" + strconv.FormatInt(nodeSeq.Add(1), 10)
	}
	var tn *testNode
	waitFor(t, "node started", func() bool {
		nc, err := nats.Connect(strings.Join(urls, ","), nats.DontRandomize(),
			nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
		if err != nil {
			return false
		}
		node, err := mesh.NewNode(nc, cfg)
		if err != nil {
			t.Fatalf("NewNode: %v", err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
		err = node.Start(ctx)
		cancel()
		if err != nil {
			ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
			_ = node.Stop(ctx)
			cancel()
			nc.Close()
			return false
		}
		tn = &testNode{node: node, id: cfg.NodeID, nc: nc, http: httptest.NewServer(node.HTTPHandler())}
		return true
	})
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
		defer cancel()
		_ = tn.node.Stop(ctx)
		tn.nc.Close()
		tn.http.Close()
	})
	return tn
}
