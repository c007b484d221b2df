package mesh

import (
	"context"
	"fmt"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/ownership"
	"github.com/limitmesh/limitmesh/mesh/internal/policyset"
	"github.com/limitmesh/limitmesh/usage"
	"github.com/nats-io/nats.go/jetstream"
)

// The node's start, in the order start calls its steps: the buckets, the
// policy watch, the node's metrics, the usage stream with the publisher,
// the ledger and the shadow evaluator (usage.go), then the decide role
// (decider.start, decide.go): the journal, the member (keys, ownership),
// leased mode, the service, the partition owners, the endpoints.

// Start creates missing buckets, applies the current policies, starts the
// policy watch and the usage publisher, and then what the node's roles
// call for: the ledger's reconciler and the shadow evaluator (each under
// its elector), and, with RoleDecide, this node's share of the partitions
// and the decide service. It returns once the node serves. ctx bounds the
// start; the node keeps running after it returns.
func (n *Node) Start(ctx context.Context) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.stopped {
		return ErrStopped
	}
	if n.started {
		return fmt.Errorf("%w: already started", ErrConfig)
	}
	bgctx, cancel := context.WithCancel(context.Background())
	if err := n.start(ctx, bgctx); err != nil {
		cancel()
		n.bg.Wait()
		if n.dec != nil && n.dec.member != nil {
			n.dec.member.Stop()
		}
		return err
	}
	n.cancel = cancel
	n.started = true
	n.ready.Store(true)
	attrs := []any{"node", n.cfg.NodeID, "roles", n.cfg.Roles.String(), "policies", n.policies.Snapshot().Len()}
	if n.cfg.Roles.Has(RoleDecide) {
		attrs = append(attrs, "subject", n.decideSubject(), "partitions", n.cfg.Partitions, "partitions_owned", n.route.Owned())
	}
	n.log.Info("node serving", attrs...)
	return nil
}

// start runs the steps of Start; bgctx is the background work's (it ends
// at Stop).
func (n *Node) start(ctx, bgctx context.Context) error {
	js, err := jetstream.New(n.nc)
	if err != nil {
		return fmt.Errorf("mesh: jetstream: %w", err)
	}
	setup := jsSetup{js: js, log: n.log}
	b, err := n.openBuckets(ctx, setup)
	if err != nil {
		return err
	}
	watcher, err := n.watchPolicies(ctx, bgctx, js, b.policies)
	if err != nil {
		return err
	}
	if err := registerNodeInfo(n.reg, n.cfg.NodeID, n.cfg.Roles); err != nil {
		return fmt.Errorf("%w: registering metrics: %v", ErrConfig, err)
	}
	om, err := newOwnershipMetrics(n.reg)
	if err != nil {
		return fmt.Errorf("%w: registering metrics: %v", ErrConfig, err)
	}
	boot := usage.NewBoot()
	var sink usageSink
	if !n.cfg.NoUsage {
		if n.pub, err = n.startUsage(ctx, bgctx, setup, boot); err != nil {
			return err
		}
		sink = usageSink{n.pub}
	}
	// A node without decide owns no partition and takes no request: no
	// journal, keys, ownership, lease handling or service.
	if !n.cfg.Roles.Has(RoleDecide) {
		return nil
	}
	n.dec = &decider{base: &n.base, pub: n.pub,
		subs: newPartitionSubs(n.nc, n.cfg.Prefix, n.route, n.cfg.Partitions, n.log)}
	return n.dec.start(ctx, bgctx, decideParts{js: js, buckets: b, watcher: watcher, boot: boot, sink: sink, metrics: om})
}

// buckets are the KV buckets every node binds at start.
type buckets struct {
	policies  jetstream.KeyValue
	state     *kvstate.JetStreamStore
	retention keyrec.Retention // of the state bucket's writes (stateRetention)
	shards    jetstream.KeyValue
}

// openBuckets binds the policy, state and shards buckets, creating those
// that are missing, and checks the partition count the shards bucket
// records.
func (n *Node) openBuckets(ctx context.Context, s jsSetup) (b buckets, err error) {
	b.policies, err = s.ensureBucket(ctx, jetstream.KeyValueConfig{
		Bucket:      n.policyBucket(),
		Description: "limitmesh policies",
		History:     policyHistory,
		Storage:     jetstream.FileStorage,
		Replicas:    n.cfg.Replicas,
	})
	if err != nil {
		return b, err
	}
	if _, err := s.ensureBucket(ctx, jetstream.KeyValueConfig{
		Bucket:      n.stateBucket(),
		Description: "limitmesh limiter state",
		History:     1,
		TTL:         n.horizon(),
		Storage:     jetstream.FileStorage,
		Replicas:    n.cfg.Replicas,
	}); err != nil {
		return b, err
	}
	if b.retention, err = n.stateRetention(ctx, s); err != nil {
		return b, fmt.Errorf("mesh: state bucket: %w", err)
	}
	if b.state, err = kvstate.NewJetStreamStore(ctx, s.js, n.stateBucket()); err != nil {
		return b, err
	}
	b.shards, err = s.ensureBucket(ctx, jetstream.KeyValueConfig{
		Bucket:      n.shardBucket(),
		Description: "limitmesh partition ownership",
		History:     1,
		Storage:     jetstream.FileStorage,
		Replicas:    n.cfg.Replicas,
	})
	if err != nil {
		return b, err
	}
	err = s.retry(ctx, "partition count", func(ctx context.Context) error {
		return ownership.CheckConfig(ctx, b.shards, n.cfg.Partitions)
	})
	return b, err
}

// watchPolicies starts the watch of the policy bucket and returns once the
// initial values are applied (before anything decides).
func (n *Node) watchPolicies(ctx, bgctx context.Context, js jetstream.JetStream, pkv jetstream.KeyValue) (*policyset.Watcher, error) {
	pm, err := policyset.NewMetrics(n.reg)
	if err != nil {
		return nil, fmt.Errorf("%w: registering metrics: %v", ErrConfig, err)
	}
	watcher := policyset.NewWatcher(pkv, n.policies, n.log, pm)
	// Not pkv.WatchAll, whose marker can come before a policy's entry
	// while another is rewritten.
	w, err := kvstate.WatchAll(bgctx, js, pkv.Bucket())
	if err != nil {
		return nil, fmt.Errorf("mesh: watching %s: %w", n.policyBucket(), err)
	}
	ready := make(chan struct{})
	n.bg.Go(func() { watcher.Run(bgctx, w, ready) })
	select {
	case <-ready:
		return watcher, nil
	case <-ctx.Done():
		return nil, fmt.Errorf("mesh: waiting for the initial policies: %w", ctx.Err())
	}
}
