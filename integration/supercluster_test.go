package integration

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
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
	"github.com/nats-io/nats.go/jetstream"
)

// A supercluster in one process: one NATS cluster per region (routes
// direct, within the region), gateways between the regions. Every gateway
// connection passes through a proxy, one per (source region, target
// server), and every server advertises a gateway address nobody listens
// on, so no gateway connection reaches another region around the proxies
// (gossiped gateway URLs lead nowhere; only the configured proxy URLs
// work). IsolateRegion cuts a region's links to all others; HealRegion
// restores them.
//
// Every server lists, for each other region, one gateway URL per server of
// that region (a proxy to it): nats-server sizes the JetStream meta group
// it expects at first start from its routes plus those URLs, so each
// server expects all the supercluster's servers (deploy/nats/supercluster
// does the same). One JetStream spans the regions, its meta group all the
// servers of all of them.

// regionSpec names a region and its number of servers.
type regionSpec struct {
	name    string
	servers int
}

// scRegion is one region (one NATS cluster) of a supercluster.
type scRegion struct {
	name    string
	servers []*natsserver.Server
	opts    []*natsserver.Options
}

// supercluster is a NATS supercluster of in-process servers with
// JetStream, its gateway links through proxies.
type supercluster struct {
	regions []*scRegion
	// proxies[src][dst] carries the gateway connections that region src's
	// servers open to region dst's server i at index i.
	proxies map[string]map[string][]*proxy
}

// superclusterFormTimeout bounds the wait for a supercluster to form or to
// come back after a heal: gateways (re)connect on a 1 s cycle and the
// JetStream meta group of all the regions elects a leader after that.
const superclusterFormTimeout = 45 * time.Second

// startSupercluster starts the regions' servers (named <region>-<i>), each
// with JetStream, routes to the servers of its region and gateways to the
// others, and waits until the supercluster has formed (waitFormed).
func startSupercluster(t *testing.T, specs ...regionSpec) *supercluster {
	t.Helper()
	sc := &supercluster{proxies: map[string]map[string][]*proxy{}}
	deadPort := freePorts(t, 1)[0] // nothing listens here
	routePorts := map[string][]int{}
	gwPorts := map[string][]int{}
	for _, sp := range specs {
		routePorts[sp.name] = freePorts(t, sp.servers)
		gwPorts[sp.name] = freePorts(t, sp.servers)
	}
	for _, src := range specs {
		sc.proxies[src.name] = map[string][]*proxy{}
		for _, dst := range specs {
			if dst.name == src.name {
				continue
			}
			for _, p := range gwPorts[dst.name] {
				sc.proxies[src.name][dst.name] = append(sc.proxies[src.name][dst.name],
					newProxy(t, fmt.Sprintf("127.0.0.1:%d", p)))
			}
		}
	}
	for _, sp := range specs {
		r := &scRegion{name: sp.name}
		var routes []string
		for _, p := range routePorts[sp.name] {
			routes = append(routes, fmt.Sprintf("nats://127.0.0.1:%d", p))
		}
		var remotes []*natsserver.RemoteGatewayOpts
		for _, dst := range specs {
			if dst.name == sp.name {
				continue
			}
			var urls []string
			for _, p := range sc.proxies[sp.name][dst.name] {
				urls = append(urls, "nats://"+p.Addr())
			}
			remotes = append(remotes, &natsserver.RemoteGatewayOpts{
				Name: dst.name, URLs: natsserver.RoutesFromStr(strings.Join(urls, ",")),
			})
		}
		for i := range sp.servers {
			r.opts = append(r.opts, &natsserver.Options{
				ServerName: fmt.Sprintf("%s-%d", sp.name, i),
				Host:       "127.0.0.1",
				Port:       -1,
				JetStream:  true,
				StoreDir:   t.TempDir(),
				NoSigs:     true,
				NoLog:      true,
				Cluster: natsserver.ClusterOpts{
					Name: sp.name,
					Host: "127.0.0.1",
					Port: routePorts[sp.name][i],
				},
				Routes: natsserver.RoutesFromStr(strings.Join(routes, ",")),
				Gateway: natsserver.GatewayOpts{
					Name:      sp.name,
					Host:      "127.0.0.1",
					Port:      gwPorts[sp.name][i],
					Advertise: fmt.Sprintf("127.0.0.1:%d", deadPort),
					Gateways:  remotes,
				},
			})
		}
		r.servers = make([]*natsserver.Server, sp.servers)
		sc.regions = append(sc.regions, r)
	}
	for _, r := range sc.regions {
		for i := range r.servers {
			r.start(t, i)
		}
	}
	sc.waitFormed(t)
	return sc
}

// start (re)starts server i of the region with its options.
func (r *scRegion) start(t *testing.T, i int) {
	t.Helper()
	r.servers[i] = jstest.Run(t, r.opts[i])
}

// region returns the region named name (the test fails without one).
func (sc *supercluster) region(t *testing.T, name string) *scRegion {
	t.Helper()
	for _, r := range sc.regions {
		if r.name == name {
			return r
		}
	}
	t.Fatalf("no region %q", name)
	return nil
}

// URLs are the client URLs of the region's servers.
func (r *scRegion) URLs() []string {
	urls := make([]string, len(r.servers))
	for i, s := range r.servers {
		urls[i] = s.ClientURL()
	}
	return urls
}

// serverNames are the region's server names.
func (r *scRegion) serverNames() []string {
	names := make([]string, len(r.opts))
	for i, o := range r.opts {
		names[i] = o.ServerName
	}
	return names
}

// servers returns every server of every region.
func (sc *supercluster) servers() []*natsserver.Server {
	var all []*natsserver.Server
	for _, r := range sc.regions {
		all = append(all, r.servers...)
	}
	return all
}

// gatewaysUp reports whether every server has an outbound gateway to
// every other region and each region receives one inbound gateway
// connection from every server of every other region.
func (sc *supercluster) gatewaysUp() bool {
	for _, r := range sc.regions {
		inbound := map[string]int{}
		for _, s := range r.servers {
			if s.NumOutboundGateways() != len(sc.regions)-1 {
				return false
			}
			gz, err := s.Gatewayz(nil)
			if err != nil {
				return false
			}
			for name, conns := range gz.InboundGateways {
				inbound[name] += len(conns)
			}
		}
		for _, o := range sc.regions {
			if o != r && inbound[o.name] != len(o.servers) {
				return false
			}
		}
	}
	return true
}

// metaLeader returns the name of the server that leads the JetStream meta
// group ("" while none does).
func (sc *supercluster) metaLeader() string {
	for _, s := range sc.servers() {
		if s.JetStreamIsLeader() {
			return s.Name()
		}
	}
	return ""
}

// metaLeaders returns the names of every server that believes it leads
// the JetStream meta group (more than one only while a cut-off leader has
// not noticed that it lost its quorum).
func (sc *supercluster) metaLeaders() []string {
	var names []string
	for _, s := range sc.servers() {
		if s.JetStreamIsLeader() {
			names = append(names, s.Name())
		}
	}
	return names
}

// jetStreamUp reports whether the meta group has a leader that sees every
// server of the supercluster as a peer, and every server is current with
// it.
func (sc *supercluster) jetStreamUp() bool {
	var peers []string
	for _, s := range sc.servers() {
		if s.JetStreamIsLeader() {
			peers = s.JetStreamClusterPeers()
		}
	}
	all := sc.servers()
	if len(peers) != len(all) {
		return false
	}
	for _, s := range all {
		if !s.JetStreamIsCurrent() {
			return false
		}
	}
	return true
}

// waitFormed waits until every gateway is connected and JetStream is up
// across the supercluster (bounded by superclusterFormTimeout).
func (sc *supercluster) waitFormed(t *testing.T) {
	t.Helper()
	start := time.Now()
	waitWithin(t, superclusterFormTimeout, "gateways between every pair of regions", sc.gatewaysUp)
	gw := time.Since(start)
	waitWithin(t, superclusterFormTimeout, "a JetStream meta leader with every server as a peer", sc.jetStreamUp)
	t.Logf("supercluster formed: gateways after %s, JetStream meta leader %s with all %d peers after %s",
		gw.Round(time.Millisecond), sc.metaLeader(), len(sc.servers()), time.Since(start).Round(time.Millisecond))
}

// IsolateRegion cuts every gateway link between region name and the
// others and waits until no server on either side has a gateway
// connection across the cut.
func (sc *supercluster) IsolateRegion(t *testing.T, name string) {
	t.Helper()
	sc.setLinks(name, (*proxy).Cut)
	r := sc.region(t, name)
	waitFor(t, "region "+name+" cut off", func() bool {
		for _, o := range sc.regions {
			for _, s := range o.servers {
				gz, err := s.Gatewayz(nil)
				if err != nil {
					return false
				}
				if o == r && (len(gz.OutboundGateways) > 0 || len(gz.InboundGateways) > 0) {
					return false
				}
				if o != r && (gz.OutboundGateways[name] != nil || len(gz.InboundGateways[name]) > 0) {
					return false
				}
			}
		}
		return true
	})
}

// HealRegion restores region name's gateway links and waits until the
// supercluster has formed again (the time it took is logged).
func (sc *supercluster) HealRegion(t *testing.T, name string) {
	t.Helper()
	sc.setLinks(name, (*proxy).Heal)
	sc.waitFormed(t)
}

// setLinks applies f to every proxy into or out of region name.
func (sc *supercluster) setLinks(name string, f func(*proxy)) {
	for src, byDst := range sc.proxies {
		for dst, ps := range byDst {
			if src == name || dst == name {
				for _, p := range ps {
					f(p)
				}
			}
		}
	}
}

// connectRegion opens a client connection to the region's servers (first
// server first; it reconnects within the region only), closed at cleanup.
func (sc *supercluster) connectRegion(t *testing.T, name string) *nats.Conn {
	t.Helper()
	return connectURLs(t, sc.region(t, name).URLs()...)
}

// startRegionNode starts a node on a connection to the region's servers,
// starting with server i (so nodes can be spread over a region's
// servers), retrying while JetStream cannot create its buckets yet; it
// stops at cleanup. Buckets a node creates are placed in the region of
// the server its connection is on, so the first node to start decides
// where the buckets live.
func (sc *supercluster) startRegionNode(t *testing.T, name string, i int, cfg mesh.NodeConfig) *testNode {
	t.Helper()
	urls := sc.region(t, name).URLs()
	i %= len(urls)
	return startNodeRetry(t, cfg, append(slices.Clone(urls[i:]), urls[:i]...)...)
}

// TestSuperclusterJetStream: what JetStream does across a two-region
// supercluster (one JetStream, no domains; the meta group spans all six
// servers) when a region is cut off, the facts leased quota is built on:
//
//   - a bucket is placed in the region of the server its creator is
//     connected to, all three replicas there, unless its placement names
//     a region (cluster);
//   - while cut, each region reads and writes its own region's buckets as
//     before, and cannot reach the other region's (a put gets no response,
//     a get no responders);
//   - while cut, no stream or consumer can be created on either side: the
//     meta group needs 4 of its 6 peers. (A cut-off meta leader keeps
//     believing it leads for a while, up to ~20 s measured, but commits
//     nothing.) A KV watch from the cut-off region on the other region's
//     bucket stalls; its ordered consumer is re-created after the heal;
//   - after the heal every bucket is reachable from both regions again and
//     the stalled watch delivers again, within bounded polls (logged).
func TestSuperclusterJetStream(t *testing.T) {
	if testing.Short() {
		t.Skip("supercluster test")
	}
	sc := startSupercluster(t, regionSpec{"eu", 3}, regionSpec{"us", 3})
	ncs := map[string]*nats.Conn{"eu": sc.connectRegion(t, "eu"), "us": sc.connectRegion(t, "us")}
	kvs := map[string]map[string]jetstream.KeyValue{"eu": {}, "us": {}} // [client region][bucket region]
	for _, r := range []string{"eu", "us"} {
		js, _ := jetstream.New(ncs[r])
		waitWithin(t, superclusterFormTimeout, "an R3 bucket created from "+r, func() bool {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			_, err := js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "b_" + r, Replicas: 3})
			return err == nil
		})
		info := streamInfo(t, ncs[r], "KV_b_"+r)
		names := sc.region(t, r).serverNames()
		peers := []string{info.Cluster.Leader}
		for _, p := range info.Cluster.Replicas {
			peers = append(peers, p.Name)
		}
		slices.Sort(peers)
		if info.Cluster.Name != r || !slices.Equal(peers, names) {
			t.Fatalf("bucket created from %s: cluster %q on %v, want %q on %v", r, info.Cluster.Name, peers, r, names)
		}
	}
	// A placement names the region explicitly, whoever creates the bucket.
	jsEU, _ := jetstream.New(ncs["eu"])
	waitWithin(t, superclusterFormTimeout, "a bucket placed in us created from eu", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_, err := jsEU.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{
			Bucket: "placed", Replicas: 3, Placement: &jetstream.Placement{Cluster: "us"}})
		return err == nil
	})
	if c := streamInfo(t, ncs["eu"], "KV_placed").Cluster; c.Name != "us" {
		t.Fatalf("bucket placed in us from eu lives in %q", c.Name)
	}
	for _, c := range []string{"eu", "us"} {
		js, _ := jetstream.New(ncs[c])
		for _, b := range []string{"eu", "us"} {
			ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
			kv, err := js.KeyValue(ctx, "b_"+b)
			cancel()
			if err != nil {
				t.Fatal(err)
			}
			kvs[c][b] = kv
		}
	}
	// putGet writes and reads a key of bucket b through region c's client,
	// each bounded by a second.
	putGet := func(c, b string) (putErr, getErr error) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_, putErr = kvs[c][b].Put(ctx, "k", []byte(c))
		_, getErr = kvs[c][b].Get(ctx, "k")
		return putErr, getErr
	}
	for _, c := range []string{"eu", "us"} {
		for _, b := range []string{"eu", "us"} {
			if pe, ge := putGet(c, b); pe != nil || ge != nil {
				t.Fatalf("%s client, %s bucket before the cut: put %v, get %v", c, b, pe, ge)
			}
		}
	}
	w, err := kvs["us"]["eu"].Watch(context.Background(), "watched", jetstream.UpdatesOnly())
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()

	sc.IsolateRegion(t, "us")
	for _, r := range []string{"eu", "us"} {
		if pe, ge := putGet(r, r); pe != nil || ge != nil {
			t.Errorf("cut: %s client, its own region's bucket: put %v, get %v; want both to work", r, pe, ge)
		}
		o := map[string]string{"eu": "us", "us": "eu"}[r]
		pe, ge := putGet(r, o)
		t.Logf("cut: %s client, %s bucket: put %v; get %v", r, o, pe, ge)
		if pe == nil || ge == nil {
			t.Errorf("cut: %s client reached the %s bucket across the cut (put %v, get %v)", r, o, pe, ge)
		}
		js, _ := jetstream.New(ncs[r])
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "new_" + r})
		cancel()
		t.Logf("cut: creating a bucket from %s: %v", r, err)
		if err == nil {
			t.Errorf("cut: a bucket was created from %s without a meta quorum", r)
		}
	}
	t.Logf("cut: servers that believe they lead the meta group: %v", sc.metaLeaders())

	healAt := time.Now()
	sc.HealRegion(t, "us")
	waitWithin(t, superclusterFormTimeout, "every bucket reachable from both regions", func() bool {
		for _, c := range []string{"eu", "us"} {
			for _, b := range []string{"eu", "us"} {
				if pe, ge := putGet(c, b); pe != nil || ge != nil {
					return false
				}
			}
		}
		return true
	})
	t.Logf("healed: every bucket reachable from both regions %s after the heal", time.Since(healAt).Round(time.Millisecond))
	waitWithin(t, superclusterFormTimeout, "the stalled watch delivers again", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := kvs["eu"]["eu"].Put(ctx, "watched", []byte("after"))
		cancel()
		if err != nil {
			return false
		}
		for {
			select {
			case e := <-w.Updates():
				if e != nil && string(e.Value()) == "after" {
					return true
				}
			case <-time.After(100 * time.Millisecond):
				return false
			}
		}
	})
	t.Logf("healed: the watch from us on the eu bucket delivers again %s after the heal", time.Since(healAt).Round(time.Millisecond))
}

// TestEmbeddedSupercluster: mesh.StartEmbedded with Region, GatewayListen
// and Gateways makes two one-server regions a supercluster: each server's
// cluster is named after its region, the gateways connect both ways (each
// server is given the same map, its own region's entry included), core
// requests cross them, JetStream forms one meta group of both servers and
// places a bucket in the region it was created from.
func TestEmbeddedSupercluster(t *testing.T) {
	if testing.Short() {
		t.Skip("supercluster test")
	}
	routePorts, gwPorts := freePorts(t, 2), freePorts(t, 2)
	names := []string{"eu", "us"}
	gateways := map[string][]string{}
	for i, r := range names {
		gateways[r] = []string{fmt.Sprintf("nats://127.0.0.1:%d", gwPorts[i])}
	}
	servers := make([]*mesh.Embedded, 2)
	errs := make([]error, 2)
	var wg sync.WaitGroup
	for i, r := range names {
		wg.Go(func() {
			servers[i], errs[i] = mesh.StartEmbedded(mesh.EmbeddedConfig{
				Listen: "127.0.0.1:-1", DataDir: t.TempDir(), ServerName: r + "-0",
				ClusterListen: fmt.Sprintf("127.0.0.1:%d", routePorts[i]),
				Routes:        []string{fmt.Sprintf("nats://127.0.0.1:%d", routePorts[i])},
				Region:        r,
				GatewayListen: fmt.Sprintf("127.0.0.1:%d", gwPorts[i]),
				Gateways:      gateways,
			})
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("%s: %v", names[i], err)
		}
		t.Cleanup(servers[i].Shutdown)
	}
	for i, e := range servers {
		if got := e.Server().ClusterName(); got != names[i] {
			t.Errorf("%s: cluster name %q, want the region's", names[i], got)
		}
		if want := gateways[names[i]][0]; e.GatewayURL() != want {
			t.Errorf("%s: GatewayURL %q, want %q", names[i], e.GatewayURL(), want)
		}
	}
	waitWithin(t, superclusterFormTimeout, "gateways both ways", func() bool {
		return servers[0].Server().NumOutboundGateways() == 1 && servers[1].Server().NumOutboundGateways() == 1
	})
	eu, us := connect(t, servers[0]), connect(t, servers[1])
	sub, err := eu.Subscribe("probe", func(m *nats.Msg) { _ = m.Respond([]byte("eu")) })
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	waitFor(t, "a request from us answered in eu", func() bool {
		m, err := us.Request("probe", nil, 200*time.Millisecond)
		return err == nil && string(m.Data) == "eu"
	})
	js, _ := jetstream.New(us)
	waitWithin(t, superclusterFormTimeout, "a bucket created from us", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_, err := js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "probe"})
		return err == nil
	})
	if c := streamInfo(t, eu, "KV_probe").Cluster; c == nil || c.Name != "us" || c.Leader != "us-0" {
		t.Fatalf("bucket created from us placed at %+v, want cluster us on us-0", c)
	}
}

// TestEmbeddedGatewayConfigErrors: invalid supercluster settings are
// refused with mesh.ErrConfig before any server starts.
func TestEmbeddedGatewayConfigErrors(t *testing.T) {
	base := func() mesh.EmbeddedConfig {
		return mesh.EmbeddedConfig{
			DataDir: t.TempDir(), ClusterListen: "127.0.0.1:-1", Region: "eu",
			GatewayListen: "127.0.0.1:-1", Gateways: map[string][]string{"us": {"nats://127.0.0.1:7222"}},
		}
	}
	cases := []struct {
		name string
		edit func(*mesh.EmbeddedConfig)
		want string
	}{
		{"bad region", func(c *mesh.EmbeddedConfig) { c.Region = "EU West" }, "region"},
		{"cluster name differs", func(c *mesh.EmbeddedConfig) { c.ClusterName = "lm" }, "differ"},
		{"gateway without a cluster", func(c *mesh.EmbeddedConfig) { c.ClusterListen = "" }, "needs a cluster"},
		{"gateway without a region", func(c *mesh.EmbeddedConfig) { c.Region = "" }, "needs a region"},
		{"gateways without a listener", func(c *mesh.EmbeddedConfig) { c.GatewayListen = "" }, "gateway listen"},
		{"bad gateway listen", func(c *mesh.EmbeddedConfig) { c.GatewayListen = "127.0.0.1" }, "gateway listen"},
		{"bad remote name", func(c *mesh.EmbeddedConfig) { c.Gateways = map[string][]string{"u.s": {"nats://h:1"}} }, "region"},
		{"remote without URLs", func(c *mesh.EmbeddedConfig) { c.Gateways = map[string][]string{"us": nil} }, "no URL"},
		{"remote URL without port", func(c *mesh.EmbeddedConfig) { c.Gateways = map[string][]string{"us": {"nats://h"}} }, "port"},
		{"remote URL scheme", func(c *mesh.EmbeddedConfig) { c.Gateways = map[string][]string{"us": {"http://h:1"}} }, "nats://"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := base()
			tc.edit(&cfg)
			e, err := mesh.StartEmbedded(cfg)
			if err == nil {
				e.Shutdown()
				t.Fatal("started")
			}
			if !errors.Is(err, mesh.ErrConfig) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q: want mesh.ErrConfig mentioning %q", err, tc.want)
			}
		})
	}
}

// superclusterDeploy are the regions of deploy/nats/supercluster, each
// with its servers' config files <region>-1.conf..<region>-3.conf.
var superclusterDeploy = []string{"eu", "us"}

// superclusterConfs returns the parsed configs of deploy/nats/supercluster
// by region, in server order (the test fails if one is missing).
func superclusterConfs(t *testing.T) map[string][]*natsserver.Options {
	t.Helper()
	confs := loadConfs(t)
	out := map[string][]*natsserver.Options{}
	for _, r := range superclusterDeploy {
		for i := 1; i <= 3; i++ {
			path := fmt.Sprintf("nats/supercluster/%s-%d.conf", r, i)
			o := confs[path]
			if o == nil {
				t.Fatalf("deploy/%s missing or invalid", path)
			}
			out[r] = append(out[r], o)
		}
	}
	return out
}

// TestDeploySupercluster: the two-region configs parse with nats-server's
// own parser; each region is a cluster named after it whose servers route
// to exactly its three servers; the gateway of every server has the
// region's name and lists, for each region, exactly that region's servers
// at their gateway ports; no server sets a JetStream domain (one
// JetStream spans the supercluster); and the meta group size each server
// expects at first start (routes plus the other regions' gateway URLs) is
// all six servers.
func TestDeploySupercluster(t *testing.T) {
	byRegion := superclusterConfs(t)
	members := func(r string, port func(*natsserver.Options) int) []string {
		var hp []string
		for _, o := range byRegion[r] {
			hp = append(hp, net.JoinHostPort(o.ServerName, strconv.Itoa(port(o))))
		}
		slices.Sort(hp)
		return hp
	}
	hosts := func(us []*url.URL) []string {
		var hp []string
		for _, u := range us {
			hp = append(hp, u.Host)
		}
		slices.Sort(hp)
		return hp
	}
	total := 0
	for _, r := range superclusterDeploy {
		total += len(byRegion[r])
	}
	for _, r := range superclusterDeploy {
		for i, o := range byRegion[r] {
			name := fmt.Sprintf("%s-%d.conf", r, i+1)
			if o.Cluster.Name != r || o.Gateway.Name != r {
				t.Errorf("%s: cluster %q, gateway %q: want both named %q", name, o.Cluster.Name, o.Gateway.Name, r)
			}
			if o.Cluster.Port <= 0 || o.Gateway.Port <= 0 {
				t.Errorf("%s: cluster port %d, gateway port %d", name, o.Cluster.Port, o.Gateway.Port)
			}
			if o.JetStreamDomain != "" {
				t.Errorf("%s: JetStream domain %q: a supercluster shares one JetStream, without a domain", name, o.JetStreamDomain)
			}
			want := members(r, func(o *natsserver.Options) int { return o.Cluster.Port })
			if got := hosts(o.Routes); !slices.Equal(got, want) {
				t.Errorf("%s: routes %v, want the region's servers %v", name, got, want)
			}
			expected := len(o.Routes)
			listed := map[string]bool{}
			for _, g := range o.Gateway.Gateways {
				listed[g.Name] = true
				if !slices.Contains(superclusterDeploy, g.Name) {
					t.Errorf("%s: gateway to unknown region %q", name, g.Name)
					continue
				}
				want := members(g.Name, func(o *natsserver.Options) int { return o.Gateway.Port })
				if got := hosts(g.URLs); !slices.Equal(got, want) {
					t.Errorf("%s: gateway %s URLs %v, want that region's servers %v", name, g.Name, got, want)
				}
				if g.Name != r {
					expected += len(g.URLs)
				}
			}
			for _, other := range superclusterDeploy {
				if other != r && !listed[other] {
					t.Errorf("%s: no gateway to region %s", name, other)
				}
			}
			if expected != total {
				t.Errorf("%s: expects a meta group of %d servers (routes plus other regions' gateway URLs), the supercluster has %d",
					name, expected, total)
			}
		}
	}
}

// TestDeploySuperclusterRuns: the six configs of deploy/nats/supercluster,
// with every host name moved to loopback, free ports and temporary
// directories, form the supercluster: gateways connect both ways, one
// JetStream meta group of all six servers elects a leader, and an R3
// bucket created from us is placed on the three us servers.
func TestDeploySuperclusterRuns(t *testing.T) {
	if testing.Short() {
		t.Skip("supercluster test")
	}
	byRegion := superclusterConfs(t)
	// New loopback ports by config host:port (server name and port).
	moved := map[string]int{}
	at := func(o *natsserver.Options, port int) string {
		return net.JoinHostPort(o.ServerName, strconv.Itoa(port))
	}
	for _, r := range superclusterDeploy {
		for _, o := range byRegion[r] {
			ports := freePorts(t, 2)
			moved[at(o, o.Cluster.Port)], moved[at(o, o.Gateway.Port)] = ports[0], ports[1]
		}
	}
	move := func(us []*url.URL) []*url.URL {
		out := make([]*url.URL, len(us))
		for i, u := range us {
			p, ok := moved[u.Host]
			if !ok {
				t.Fatalf("%s names no server of the supercluster", u)
			}
			m := *u
			m.Host = fmt.Sprintf("127.0.0.1:%d", p)
			out[i] = &m
		}
		return out
	}
	sc := &supercluster{}
	for _, r := range superclusterDeploy {
		reg := &scRegion{name: r, servers: make([]*natsserver.Server, len(byRegion[r]))}
		for _, o := range byRegion[r] {
			c := o.Clone()
			c.Host, c.Port = "127.0.0.1", -1
			c.HTTPHost, c.HTTPPort = "127.0.0.1", -1
			c.StoreDir = t.TempDir()
			c.NoSigs, c.NoLog = true, true
			c.Cluster.Host, c.Cluster.Port = "127.0.0.1", moved[at(o, o.Cluster.Port)]
			c.Gateway.Host, c.Gateway.Port = "127.0.0.1", moved[at(o, o.Gateway.Port)]
			c.Routes = move(o.Routes)
			c.Gateway.Gateways = nil
			for _, g := range o.Gateway.Gateways {
				c.Gateway.Gateways = append(c.Gateway.Gateways, &natsserver.RemoteGatewayOpts{Name: g.Name, URLs: move(g.URLs)})
			}
			reg.opts = append(reg.opts, c)
		}
		sc.regions = append(sc.regions, reg)
	}
	for _, r := range sc.regions {
		for i := range r.servers {
			r.start(t, i)
		}
	}
	sc.waitFormed(t)
	us := sc.connectRegion(t, "us")
	js, _ := jetstream.New(us)
	waitWithin(t, superclusterFormTimeout, "an R3 bucket created from us", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_, err := js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "probe", Replicas: 3})
		return err == nil
	})
	info := streamInfo(t, us, "KV_probe")
	peers := []string{info.Cluster.Leader}
	for _, p := range info.Cluster.Replicas {
		peers = append(peers, p.Name)
	}
	slices.Sort(peers)
	if want := sc.region(t, "us").serverNames(); info.Cluster.Name != "us" || !slices.Equal(peers, want) {
		t.Fatalf("bucket created from us: cluster %q on %v, want us on %v", info.Cluster.Name, peers, want)
	}
}
