package cli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/limitmesh/limitmesh/mesh"
	"github.com/limitmesh/limitmesh/mesh/envoy"
)

// envoyBridge is `serve --envoy-listen`: Envoy's rate limit service over
// gRPC (CONTRACT.md §12, package mesh/envoy), deciding through the node's
// own decide service on a NATS connection of its own ("limitmesh-envoy",
// with the node's credentials).
type envoyBridge struct {
	srv  *envoy.Server
	nc   *nats.Conn
	done chan error
}

// startEnvoy serves the bridge on l (already bound) for node, whose subject
// prefix and decision timeout are prefix and decision; connect opens its
// NATS connection. `limitmesh serve` and `bench --rls embedded` run it.
func startEnvoy(l net.Listener, connect func(name string) (*nats.Conn, error), node *mesh.Node,
	prefix string, decision time.Duration, reg prometheus.Registerer, log *slog.Logger) (*envoyBridge, error) {
	nc, err := connect("limitmesh-envoy")
	if err != nil {
		return nil, fmt.Errorf("--envoy-listen: %v", err)
	}
	srv, err := envoy.New(envoy.Config{
		Conn:     nc,
		Prefix:   prefix,
		Timeout:  envoyTimeout(decision),
		Policy:   node.Policy,
		Ready:    node.Ready,
		Registry: reg,
		Logger:   log,
	})
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("--envoy-listen: %v", err)
	}
	b := &envoyBridge{srv: srv, nc: nc, done: make(chan error, 1)}
	go func() { b.done <- srv.Serve(l) }()
	log.Info("envoy rate limit service serving", "listen", l.Addr().String(), "service", envoy.ServiceName)
	return b, nil
}

// envoyTimeout is the bridge's wait for a decide reply when the RPC has no
// deadline: the node's decision timeout and a margin, so that a node's 503
// comes back before the bridge gives up.
func envoyTimeout(decision time.Duration) time.Duration { return decision + 500*time.Millisecond }

// stop answers NOT_SERVING, lets the calls in flight finish (bounded by
// ctx) and closes the bridge's connection; the node stops after it.
func (b *envoyBridge) stop(ctx context.Context, log *slog.Logger) {
	if err := b.srv.Shutdown(ctx); err != nil {
		log.Warn("envoy drain incomplete", "err", err)
	}
	if err := <-b.done; err != nil && !errors.Is(err, net.ErrClosed) {
		log.Warn("envoy server stopped", "err", err)
	}
	_ = b.nc.Drain()
}
