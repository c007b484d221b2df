package cli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/limitmesh/limitmesh/mesh"
	"github.com/nats-io/nats.go"
)

// regionNames are the names `limitmesh bench --regions R` and the demo
// give the regions of an embedded supercluster.
var regionNames = []string{"eu", "us", "ap", "sa", "af", "me", "oc", "an"}

// embeddedRegions is a supercluster in this process: one embedded NATS
// server (its own cluster, named after the region) and one node per
// region, gateways between the regions. The first region's node starts
// first, so every bucket and stream lives there.
type embeddedRegions struct {
	names   []string
	servers []*mesh.Embedded
	undo    []func()
}

// startRegions starts n regions (1 <= n <= len(regionNames)); one region
// is a plain single server. stop undoes everything.
func startRegions(ctx context.Context, n int, prefix string, log *slog.Logger) (*embeddedRegions, error) {
	if n < 1 || n > len(regionNames) {
		return nil, fmt.Errorf("--regions %d: want 1..%d", n, len(regionNames))
	}
	er := &embeddedRegions{names: regionNames[:n]}
	ok := false
	defer func() {
		if !ok {
			er.stop()
		}
	}()
	dir, err := os.MkdirTemp("", "limitmesh-regions-")
	if err != nil {
		return nil, err
	}
	er.undo = append(er.undo, func() { os.RemoveAll(dir) })
	cfgs := make([]mesh.EmbeddedConfig, n)
	for i, name := range er.names {
		cfgs[i] = mesh.EmbeddedConfig{DataDir: filepath.Join(dir, name), ServerName: "limitmesh-" + name, Logger: log}
		if n > 1 {
			// A server of a cluster needs a client listener (with none, its
			// route listener never reports ready): a free port on loopback.
			cfgs[i].Listen = "127.0.0.1:-1"
		}
	}
	if n > 1 {
		ports, err := freeTCPPorts(2 * n)
		if err != nil {
			return nil, err
		}
		gateways := map[string][]string{}
		for i, name := range er.names {
			gateways[name] = []string{fmt.Sprintf("nats://127.0.0.1:%d", ports[n+i])}
		}
		for i, name := range er.names {
			cfgs[i].ClusterListen = fmt.Sprintf("127.0.0.1:%d", ports[i])
			cfgs[i].Routes = []string{fmt.Sprintf("nats://127.0.0.1:%d", ports[i])}
			cfgs[i].Region = name
			cfgs[i].GatewayListen = fmt.Sprintf("127.0.0.1:%d", ports[n+i])
			cfgs[i].Gateways = gateways
		}
	}
	er.servers = make([]*mesh.Embedded, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range cfgs {
		wg.Go(func() { er.servers[i], errs[i] = mesh.StartEmbedded(cfgs[i]) })
	}
	wg.Wait()
	for i, s := range er.servers {
		if s != nil {
			er.undo = append(er.undo, s.Shutdown)
		}
		if errs[i] != nil {
			return nil, fmt.Errorf("embedded NATS of region %s: %v", er.names[i], errs[i])
		}
	}
	// Gateways connect on a one-second cycle; the JetStream meta group of
	// all the regions elects a leader after that (the node's start waits
	// for JetStream: it retries while JetStream is not ready).
	for n > 1 {
		up := true
		for _, s := range er.servers {
			up = up && s.Server().NumOutboundGateways() == n-1
		}
		if up {
			break
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("waiting for the regions' gateways: %w", ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
	for i, s := range er.servers {
		nc, err := s.Connect(nats.Name("limitmesh-node-" + er.names[i]))
		if err != nil {
			return nil, err
		}
		er.undo = append(er.undo, nc.Close)
		node, err := mesh.NewNode(nc, mesh.NodeConfig{Prefix: prefix, Logger: log, NodeID: er.names[i]})
		if err != nil {
			return nil, err
		}
		sctx, cancel := context.WithTimeout(ctx, 60*time.Second)
		err = node.Start(sctx)
		cancel()
		if err != nil {
			return nil, fmt.Errorf("start the node of region %s: %v", er.names[i], err)
		}
		er.undo = append(er.undo, func() {
			sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = node.Stop(sctx)
		})
	}
	ok = true
	return er, nil
}

// connect opens an in-process connection to region i's server.
func (er *embeddedRegions) connect(i int, name string) (*nats.Conn, error) {
	return er.servers[i%len(er.servers)].Connect(nats.Name(name))
}

// stop stops the nodes and servers and removes their data.
func (er *embeddedRegions) stop() {
	for i := len(er.undo) - 1; i >= 0; i-- {
		er.undo[i]()
	}
	er.undo = nil
}

// freeTCPPorts returns n ports free on 127.0.0.1 now.
func freeTCPPorts(n int) ([]int, error) {
	ports := make([]int, 0, n)
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			_ = l.Close()
		}
	}()
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, errors.Join(errors.New("finding free ports"), err)
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}
