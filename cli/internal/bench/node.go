package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/limitmesh/limitmesh/mesh"
)

// startBenchNode starts an embedded NATS server and a node on it; stop
// undoes both. In the reserve modes the node's /metrics is served on a
// loopback port, at metricsURL, for the leak check (reserve_check.go).
func startBenchNode(ctx context.Context, c *Config) (_ *mesh.Embedded, metricsURL string, _ func(), _ error) {
	var undo []func()
	stop := func() {
		for i := len(undo) - 1; i >= 0; i-- {
			undo[i]()
		}
	}
	dir, err := os.MkdirTemp("", "limitmesh-bench-")
	if err != nil {
		return nil, "", nil, err
	}
	undo = append(undo, func() { os.RemoveAll(dir) })
	level := new(slog.LevelVar)
	level.Set(slog.LevelWarn)
	if c.Verbose {
		level.Set(slog.LevelInfo)
	}
	log := slog.New(slog.NewTextHandler(c.logWriter(), &slog.HandlerOptions{Level: level}))
	emb, err := mesh.StartEmbedded(mesh.EmbeddedConfig{DataDir: dir, ServerName: "limitmesh-bench", Logger: log})
	if err != nil {
		stop()
		return nil, "", nil, fmt.Errorf("embedded NATS: %v", err)
	}
	undo = append(undo, emb.Shutdown)
	nodeConn, err := emb.Connect(nats.Name("limitmesh-node"))
	if err != nil {
		stop()
		return nil, "", nil, err
	}
	undo = append(undo, nodeConn.Close)
	var roles mesh.Roles // the default: all (also with --usage=false)
	if c.Roles != mesh.AllRoles.String() {
		roles, _ = mesh.ParseRoles(c.Roles) // validated
	}
	node, err := mesh.NewNode(nodeConn, mesh.NodeConfig{Prefix: c.Prefix, Logger: log, NoUsage: !c.Usage, Roles: roles})
	if err != nil {
		stop()
		return nil, "", nil, err
	}
	startCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	err = node.Start(startCtx)
	cancel()
	if err != nil {
		stop()
		return nil, "", nil, fmt.Errorf("start node: %v", err)
	}
	undo = append(undo, func() {
		if !c.Verbose {
			// The node and its data are thrown away: what its stop cannot
			// finish in time (checkpoints after a run over many keys, a
			// watch ended by the shutdown) is no warning to the user.
			level.Set(slog.LevelError)
		}
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = node.Stop(sctx)
	})
	if c.onNode != nil {
		undoHook, err := c.onNode(emb, node, log)
		if err != nil {
			stop()
			return nil, "", nil, err
		}
		undo = append(undo, undoHook)
	}
	if c.Mode.Reserves() {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			stop()
			return nil, "", nil, err
		}
		srv := &http.Server{Handler: node.HTTPHandler(), ReadHeaderTimeout: 5 * time.Second}
		go func() { _ = srv.Serve(ln) }()
		undo = append(undo, func() { _ = srv.Close() })
		metricsURL = "http://" + ln.Addr().String() + "/metrics"
	}
	return emb, metricsURL, stop, nil
}

// waitForBenchPolicy polls with dry runs until the node decides with the
// plan's policy at revision rev or later, and returns that reply (its size
// is the echo payload's).
func waitForBenchPolicy(ctx context.Context, nc *nats.Conn, plan *benchPlan, rev uint64, timeout time.Duration) ([]byte, error) {
	body := fmt.Appendf(nil, `{"descriptor":{"bench_run":%q,"key":"k0"},"dry_run":true}`, plan.run)
	deadline := time.Now().Add(5 * time.Second)
	for {
		msg, err := nc.Request(plan.decideSubj, body, timeout)
		switch {
		case errors.Is(err, nats.ErrNoResponders):
			return nil, fmt.Errorf("no limitmesh node answers on %s", plan.decideSubj)
		case err == nil:
			var r decideReply
			if json.Unmarshal(msg.Data, &r) == nil && r.Policy == plan.policyName && r.Revision >= rev {
				return bytes.Clone(msg.Data), nil
			}
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("no node applied policy %s within 5s", plan.policyName)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// putBenchPolicy puts the run's policy into the policy bucket over admin;
// undo deletes it again.
func putBenchPolicy(ctx context.Context, admin *nats.Conn, c *Config, plan *benchPlan) (js jetstream.JetStream, kv jetstream.KeyValue, rev uint64, undo func(), err error) {
	if js, err = jetstream.New(admin); err != nil {
		return nil, nil, 0, nil, err
	}
	if kv, err = js.KeyValue(ctx, c.Prefix+"_policies"); err != nil {
		return nil, nil, 0, nil, fmt.Errorf("open %s_policies: %v (is a node running?)", c.Prefix, err)
	}
	if rev, err = kv.Put(ctx, plan.policyName, plan.policyDoc); err != nil {
		return nil, nil, 0, nil, fmt.Errorf("put policy %s: %v", plan.policyName, err)
	}
	return js, kv, rev, func() {
		dctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = kv.Delete(dctx, plan.policyName)
	}, nil
}
