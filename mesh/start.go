package mesh

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/limitmesh/limitmesh/internal/elector"
	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/journal"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/keys"
	"github.com/limitmesh/limitmesh/mesh/internal/leasing"
	"github.com/limitmesh/limitmesh/mesh/internal/member"
	"github.com/limitmesh/limitmesh/mesh/internal/ownership"
	"github.com/limitmesh/limitmesh/mesh/internal/policyset"
	"github.com/limitmesh/limitmesh/mesh/internal/service"
	"github.com/limitmesh/limitmesh/shadow"
	"github.com/limitmesh/limitmesh/usage"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nats.go/micro"
)

// The node's start: buckets, streams, the policy watch, the usage ledger
// and the shadow evaluator, then (the decide role) ownership, the journal
// and the service.

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
		if n.member != nil {
			n.member.Stop()
		}
		return err
	}
	n.cancel = cancel
	n.started = true
	n.ready.Store(true)
	attrs := []any{"node", n.cfg.NodeID, "roles", n.cfg.Roles.String(), "policies", n.policies.Snapshot().Len()}
	if n.cfg.Roles.Has(RoleDecide) {
		attrs = append(attrs, "subject", n.DecideSubject(), "partitions", n.cfg.Partitions, "partitions_owned", n.route.Owned())
	}
	n.log.Info("node serving", attrs...)
	return nil
}

func (n *Node) start(ctx, bgctx context.Context) error {
	js, err := jetstream.New(n.nc)
	if err != nil {
		return fmt.Errorf("mesh: jetstream: %w", err)
	}
	pkv, err := n.ensureBucket(ctx, js, jetstream.KeyValueConfig{
		Bucket:      n.PolicyBucket(),
		Description: "limitmesh policies",
		History:     policyHistory,
		Storage:     jetstream.FileStorage,
		Replicas:    n.cfg.Replicas,
	})
	if err != nil {
		return err
	}
	if _, err := n.ensureBucket(ctx, js, jetstream.KeyValueConfig{
		Bucket:      n.StateBucket(),
		Description: "limitmesh limiter state",
		History:     1,
		TTL:         n.horizon(),
		Storage:     jetstream.FileStorage,
		Replicas:    n.cfg.Replicas,
	}); err != nil {
		return err
	}
	retention, err := n.stateRetention(ctx, js)
	if err != nil {
		return fmt.Errorf("mesh: state bucket: %w", err)
	}
	store, err := kvstate.NewJetStreamStore(ctx, js, n.StateBucket())
	if err != nil {
		return err
	}
	skv, err := n.ensureBucket(ctx, js, jetstream.KeyValueConfig{
		Bucket:      n.ShardBucket(),
		Description: "limitmesh partition ownership",
		History:     1,
		Storage:     jetstream.FileStorage,
		Replicas:    n.cfg.Replicas,
	})
	if err != nil {
		return err
	}
	if err := n.retryJS(ctx, "partition count", func(ctx context.Context) error {
		return ownership.CheckConfig(ctx, skv, n.cfg.Partitions)
	}); err != nil {
		return err
	}

	// Policies: the initial values are applied before anything decides.
	pm, err := policyset.NewMetrics(n.reg)
	if err != nil {
		return fmt.Errorf("%w: registering metrics: %v", ErrConfig, err)
	}
	watcher := policyset.NewWatcher(pkv, n.policies, n.log, pm)
	w, err := pkv.WatchAll(bgctx)
	if err != nil {
		return fmt.Errorf("mesh: watching %s: %w", n.PolicyBucket(), err)
	}
	ready := make(chan struct{})
	n.bg.Go(func() { watcher.Run(bgctx, w, ready) })
	select {
	case <-ready:
	case <-ctx.Done():
		return fmt.Errorf("mesh: waiting for the initial policies: %w", ctx.Err())
	}

	if err := registerNodeInfo(n.reg, n.cfg.NodeID, n.cfg.Roles); err != nil {
		return fmt.Errorf("%w: registering metrics: %v", ErrConfig, err)
	}
	om, err := newOwnershipMetrics(n.reg)
	if err != nil {
		return fmt.Errorf("%w: registering metrics: %v", ErrConfig, err)
	}

	// Usage: the stream, this node's publisher, the ledger and the shadow
	// evaluator (each one active across the nodes with its role, under a
	// lease).
	var sink usageSink
	boot := usage.NewBoot()
	if !n.cfg.NoUsage {
		if err := n.retryJS(ctx, "stream "+usage.StreamName(n.cfg.Prefix), func(ctx context.Context) error {
			_, err := usage.EnsureStream(ctx, js, usage.StreamConfig{Prefix: n.cfg.Prefix, Replicas: n.cfg.Replicas,
				Retention: n.cfg.UsageRetention, MaxBytes: n.cfg.UsageMaxBytes})
			return err
		}); err != nil {
			return fmt.Errorf("mesh: usage stream: %w", err)
		}
		pub, err := usage.NewPublisher(js, usage.PublisherConfig{Prefix: n.cfg.Prefix, Node: n.cfg.NodeID, Boot: boot,
			Interval: n.cfg.UsageInterval, Registerer: n.reg, Logger: n.log})
		if err != nil {
			return fmt.Errorf("mesh: usage publisher: %w", err)
		}
		n.pub, sink = pub, usageSink{pub}
		if err := n.startLedger(ctx, bgctx, js); err != nil {
			return err
		}
		if n.cfg.Roles.Has(RoleShadow) {
			if err := n.startShadow(bgctx, js); err != nil {
				return err
			}
		}
	}

	// A node without decide owns no partition and takes no request: no
	// journal, keys, ownership, lease handling or service.
	if !n.cfg.Roles.Has(RoleDecide) {
		return nil
	}
	return n.startDecide(ctx, bgctx, decideParts{js: js, store: store, shards: skv, watcher: watcher,
		retention: retention, boot: boot, sink: sink, metrics: om})
}

// decideParts is what the start of the decide role takes from the start
// of the node.
type decideParts struct {
	js        jetstream.JetStream
	store     *kvstate.JetStreamStore
	shards    jetstream.KeyValue
	watcher   *policyset.Watcher
	retention keyrec.Retention
	boot      string
	sink      usageSink
	metrics   *ownershipMetrics
}

// startDecide starts the decide role: the member (journal, keys,
// ownership), leased mode, the service and its subjects; it returns once
// every partition has an owner (or two leases have passed) and the micro
// service is subscribed.
func (n *Node) startDecide(ctx, bgctx context.Context, d decideParts) error {
	var err error

	// The member: journal, keys, ownership.
	var jr *journal.Journal
	var m *member.Member
	if !n.cfg.NoJournal {
		jr, err = journal.Open(ctx, bgctx, journal.OpenConfig{
			Config: journal.Config{
				Self:               n.cfg.NodeID,
				Prefix:             n.cfg.Prefix,
				Parts:              n.cfg.Partitions,
				View:               n.route,
				OnFenced:           func(p int, by string) { m.FencedBy(p, by) },
				Runtime:            n.rt,
				Timeout:            n.cfg.DecisionTimeout,
				CheckpointInterval: min(n.cfg.CheckpointInterval, n.cfg.StateTTL/4),
				ReadCache:          2 * n.cfg.LeaseTime,
				Boot:               d.boot,
				Retention:          d.retention,
				// Adopted keys with open reservations are swept here.
				OnAdopted: func(key string, rec []byte) {
					if svc := n.svc; svc != nil {
						svc.NoteRecord(key, rec)
					}
				},
				Log: n.log,
			},
			JS:       d.js,
			Store:    d.store,
			Bucket:   n.StateBucket(),
			Replicas: n.cfg.Replicas,
			MaxAge:   n.horizon(),
			Retry:    n.retryJS,
		})
		if err != nil {
			return err
		}
		if n.pub != nil {
			jr.SetUsage(d.sink)
		}
		for _, c := range jr.Collectors() {
			if err := n.reg.Register(c); err != nil {
				return fmt.Errorf("%w: registering metrics: %v", ErrConfig, err)
			}
		}
	}
	var keyTable *keys.Table
	km, err := keys.NewMetrics(n.reg, func() float64 {
		if keyTable == nil {
			return 0
		}
		return float64(keyTable.Len())
	})
	if err != nil {
		return fmt.Errorf("%w: registering metrics: %v", ErrConfig, err)
	}
	m = member.New(member.Config{
		Self:            n.cfg.NodeID,
		Lease:           n.cfg.LeaseTime,
		DecisionTimeout: n.cfg.DecisionTimeout,
		Runtime:         n.rt,
		Route:           n.route,
		Journal:         jr,
		Store:           member.BucketStore{Bucket: d.store, Usage: d.sink.directOf, Retention: d.retention, Now: n.rt.Now},
		Keys: keys.Config{
			Env:           n.policies,
			Versions:      versionFetcher{d.watcher},
			MaxConflicts:  n.cfg.MaxConflicts,
			TTL:           n.cfg.StateTTL,
			AsyncInterval: n.cfg.AsyncInterval,
			LostUsage:     d.sink.lost,
			OnReservations: func(policy, key string, open int, next int64) {
				if svc := n.svc; svc != nil {
					svc.NoteReservations(policy, key, open, next)
				}
			},
			Log:     n.log,
			Metrics: km,
		},
		Shards:  ownership.NewJetStreamKV(bgctx, d.shards),
		OnServe: n.onServe,
		Metrics: d.metrics,
		Log:     n.log,
	})
	keyTable = m.Keys
	n.member = m
	sm, err := service.NewMetrics(n.reg)
	if err != nil {
		return fmt.Errorf("%w: registering metrics: %v", ErrConfig, err)
	}
	n.leasing, err = leasing.New(leasing.Config{
		Conn:       n.nc,
		Prefix:     n.cfg.Prefix,
		Self:       n.cfg.NodeID,
		Policies:   n.policies,
		Keys:       m.Keys,
		Route:      n.route,
		Runtime:    n.rt,
		Timeout:    n.cfg.DecisionTimeout,
		Log:        n.log,
		Registerer: n.reg,
	})
	if err != nil {
		return fmt.Errorf("%w: %v", ErrConfig, err)
	}
	n.bg.Go(func() { n.leasing.Run(bgctx) })
	nodeSub, err := n.nc.Subscribe(leasing.NodeSubject(n.cfg.Prefix, n.cfg.NodeID), n.leasing.HandleNode)
	if err != nil {
		return fmt.Errorf("mesh: subscribing to the node's lease subject: %w", err)
	}
	_ = nodeSub.SetPendingLimits(-1, -1)
	n.subMu.Lock()
	n.nodeSub = nodeSub
	n.subMu.Unlock()
	n.svc = service.New(service.Config{
		Conn:            n.nc,
		Policies:        n.policies,
		Keys:            m.Keys,
		Route:           n.route,
		Runtime:         n.rt,
		DecisionTimeout: n.cfg.DecisionTimeout,
		Binder:          n.cfg.Binder,
		Usage:           n.pub,
		Leases:          n.leasing,
		Prefix:          n.cfg.Prefix,
		Log:             n.log,
		Metrics:         sm,
	})
	m.Start()
	// Cached keys go well before their records may expire from the bucket
	// (at least StateTTL after their last write, and never before they
	// are at rest): an idle key then starts from its durable record.
	idle := max(min(n.cfg.StateTTL/2, time.Minute), 500*time.Millisecond)
	n.bg.Go(func() { n.sweep(bgctx, idle) })
	n.bg.Go(func() { n.svc.Sweep(bgctx) })

	// Ownership: watch the shards bucket, claim this node's partitions, and
	// wait (at most two leases) until no partition waits for an owner.
	n.bg.Go(func() { ownership.Drive(bgctx, m.Owner, d.shards) })
	settle := time.NewTimer(2*n.cfg.LeaseTime + time.Second)
	defer settle.Stop()
	select {
	case <-m.Owner.Settled():
	case <-settle.C:
		n.log.Warn("starting before every partition has an owner")
	case <-ctx.Done():
		return fmt.Errorf("mesh: waiting for partition owners: %w", ctx.Err())
	}

	svc, err := micro.AddService(n.nc, micro.Config{
		Name:        ServiceName,
		Version:     Version,
		Description: "limitmesh rate-limit decisions",
		QueueGroup:  QueueGroup,
		Metadata:    map[string]string{MetadataNode: n.cfg.NodeID, MetadataRoles: n.cfg.Roles.String()},
	})
	if err != nil {
		return fmt.Errorf("mesh: adding micro service: %w", err)
	}
	if err := svc.AddEndpoint("decide", micro.HandlerFunc(n.svc.Handle),
		micro.WithEndpointSubject(n.DecideSubject()),
		micro.WithEndpointQueueGroup(QueueGroup),
		micro.WithEndpointPendingLimits(-1, -1)); err != nil {
		_ = svc.Stop()
		return fmt.Errorf("mesh: adding decide endpoint: %w", err)
	}
	// Gateways (the Go SDK) ask for grants of leased keys here; their
	// region's nodes answer (docs/protocol.md, "Leased mode").
	if err := svc.AddEndpoint("lease", micro.HandlerFunc(n.leasing.HandleGateway),
		micro.WithEndpointSubject(n.LeaseSubject()),
		micro.WithEndpointQueueGroup(QueueGroup),
		micro.WithEndpointPendingLimits(-1, -1)); err != nil {
		_ = svc.Stop()
		return fmt.Errorf("mesh: adding lease endpoint: %w", err)
	}
	// Reservations (CONTRACT §10).
	for _, ep := range []struct {
		name string
		h    func(micro.Request)
		subj string
	}{{"reserve", n.svc.HandleReserve, "reserve"}, {"settle", n.svc.HandleSettle, "settle"}, {"release", n.svc.HandleRelease, "release"},
		{"renew", n.svc.HandleRenew, "renew"},
		// Several descriptors all or nothing (layers; the Envoy bridge).
		{"decide_all", n.svc.HandleDecideAll, "decide.all"}} {
		if err := svc.AddEndpoint(ep.name, micro.HandlerFunc(ep.h),
			micro.WithEndpointSubject(n.cfg.Prefix+".v1."+ep.subj),
			micro.WithEndpointQueueGroup(QueueGroup),
			micro.WithEndpointPendingLimits(-1, -1)); err != nil {
			_ = svc.Stop()
			return fmt.Errorf("mesh: adding %s endpoint: %w", ep.name, err)
		}
	}
	if err := n.nc.FlushWithContext(ctx); err != nil {
		_ = svc.Stop()
		return fmt.Errorf("mesh: flushing subscriptions: %w", err)
	}
	n.micro = svc
	return nil
}

// sweep drops idle keys every idle/2 until ctx ends.
func (n *Node) sweep(ctx context.Context, idle time.Duration) {
	tk := time.NewTicker(idle / 2)
	defer tk.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tk.C:
			n.member.Keys.Sweep(n.rt.Now().UnixNano(), idle)
		}
	}
}

// onServe subscribes partition p's subjects (decide and lease) while this
// node holds p.
func (n *Node) onServe(p int, held bool) {
	n.subMu.Lock()
	defer n.subMu.Unlock()
	if held {
		if n.subs[p] == nil {
			n.subs[p] = n.subscribe(n.route.Subject(p), n.svc.HandleMsg)
		}
		if n.leaseSubs[p] == nil {
			n.leaseSubs[p] = n.subscribe(leasing.OwnerSubject(n.cfg.Prefix, p), n.leasing.HandleOwner)
		}
		return
	}
	// Drain: requests already delivered are still handled (decisions
	// forwarded, lease requests answered "not_owner": the slot no longer
	// serves).
	for _, subs := range [][]*nats.Subscription{n.subs, n.leaseSubs} {
		if subs[p] != nil {
			_ = subs[p].Drain()
			subs[p] = nil
		}
	}
}

// subscribe subscribes a partition subject, in the queue group
// PartitionQueue, with no pending limits; nil (logged) when it fails.
//
// A queue group, because two nodes are subscribed to a partition's
// subjects for a moment whenever it changes hands (the new owner
// subscribes when it starts serving, the old one unsubscribes when it
// stops). With plain subscriptions both received every forwarded request
// of that moment: the one that no longer served answered "not owner",
// the forwarder, seeing that answer first, sent the request again, and
// the owner decided it twice (the first reply was dropped: an admission
// no client saw, spent and billed). In the group each request reaches
// one node, and "not owner" means that node decided nothing.
func (n *Node) subscribe(subject string, h nats.MsgHandler) *nats.Subscription {
	sub, err := n.nc.QueueSubscribe(subject, PartitionQueue, h)
	if err != nil {
		n.log.Warn("subscribing to a partition subject", "subject", subject, "error", err.Error())
		return nil
	}
	_ = sub.SetPendingLimits(-1, -1)
	return sub
}

// versionFetcher fetches old policy versions for the key owners.
type versionFetcher struct{ w *policyset.Watcher }

func (v versionFetcher) Missing(name string, rev uint64) bool { return v.w.Set().Missing(name, rev) }

func (v versionFetcher) Fetch(name string, rev uint64, timeout time.Duration, done func(error)) {
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		done(v.w.FetchVersion(ctx, name, rev))
	}()
}

// ensureBucket binds to the bucket if it exists (as it is: never updated or
// narrowed) and creates it otherwise.
//
// A JetStream cluster that is still forming (no meta leader yet, or a
// stream leader being elected) may leave a request unanswered or answer
// "temporarily unavailable": such attempts are retried, each bounded by
// bucketAttempt, until ctx ends.
func (n *Node) ensureBucket(ctx context.Context, js jetstream.JetStream, cfg jetstream.KeyValueConfig) (jetstream.KeyValue, error) {
	var kv jetstream.KeyValue
	err := n.retryJS(ctx, "bucket "+cfg.Bucket, func(ctx context.Context) (err error) {
		kv, err = n.ensureBucketOnce(ctx, js, cfg)
		return err
	})
	return kv, err
}

// retryJS runs op, each attempt bounded by bucketAttempt, until it succeeds,
// fails in a way retryableJS does not retry, or ctx ends.
func (n *Node) retryJS(ctx context.Context, what string, op func(context.Context) error) error {
	for {
		actx, cancel := context.WithTimeout(ctx, bucketAttempt)
		err := op(actx)
		cancel()
		if err == nil || ctx.Err() != nil || !retryableJS(err) {
			return err
		}
		n.log.Debug("JetStream not ready, retrying", "what", what, "err", err)
		select {
		case <-ctx.Done():
			return err
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// bucketAttempt bounds one attempt of retryJS.
const bucketAttempt = 2 * time.Second

// retryableJS reports whether a JetStream request failed in a way a forming
// or electing cluster causes: no reply in time, no responders, or the
// "JetStream system temporarily unavailable" API error.
func retryableJS(err error) bool {
	var apiErr *jetstream.APIError
	switch {
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, nats.ErrTimeout),
		errors.Is(err, nats.ErrNoResponders), errors.Is(err, jetstream.ErrNoStreamResponse):
		return true
	case errors.As(err, &apiErr):
		return apiErr.Code == 503
	}
	return false
}

func (n *Node) ensureBucketOnce(ctx context.Context, js jetstream.JetStream, cfg jetstream.KeyValueConfig) (jetstream.KeyValue, error) {
	kv, err := js.KeyValue(ctx, cfg.Bucket)
	if err == nil {
		return kv, nil
	}
	if !errors.Is(err, jetstream.ErrBucketNotFound) {
		return nil, fmt.Errorf("mesh: binding bucket %s: %w", cfg.Bucket, err)
	}
	kv, err = js.CreateKeyValue(ctx, cfg)
	if errors.Is(err, jetstream.ErrBucketExists) {
		// Another node created it between our look-up and create.
		kv, err = js.KeyValue(ctx, cfg.Bucket)
	}
	if err != nil {
		return nil, fmt.Errorf("mesh: creating bucket %s: %w", cfg.Bucket, err)
	}
	n.log.Info("bucket created", "bucket", cfg.Bucket, "replicas", cfg.Replicas)
	return kv, nil
}

// startLedger creates the ledger bucket if it is missing and, on a node
// with RoleLedger, starts the usage ledger's reconciler under its lease:
// every such node runs an elector, one reconciler is active at a time.
func (n *Node) startLedger(ctx, bgctx context.Context, js jetstream.JetStream) error {
	if err := n.retryJS(ctx, "bucket "+usage.LedgerBucket(n.cfg.Prefix), func(ctx context.Context) error {
		_, err := usage.EnsureLedger(ctx, js, n.cfg.Prefix, n.cfg.Replicas)
		return err
	}); err != nil {
		return fmt.Errorf("mesh: usage ledger: %w", err)
	}
	if !n.cfg.Roles.Has(RoleLedger) {
		return nil
	}
	rec, err := usage.NewReconciler(ctx, js, usage.ReconcilerConfig{Prefix: n.cfg.Prefix, Node: n.cfg.NodeID,
		Replicas: n.cfg.Replicas, QuotaLimits: quotaLimits(n.policies),
		QuotaState: quotaState(js, n.cfg.Prefix, n.policies), Registerer: n.reg, Logger: n.log})
	if err != nil {
		return fmt.Errorf("mesh: usage ledger: %w", err)
	}
	el := elector.New(rec.KV(), usage.LedgerLeaderKey, n.cfg.NodeID, n.cfg.LeaseTime, n.log)
	n.bg.Go(func() { _ = el.Run(bgctx, rec.Run) })
	return nil
}

// startShadow starts the shadow evaluator of a node with RoleShadow: every
// such node runs one, and its elector keeps one of them active at a time.
func (n *Node) startShadow(bgctx context.Context, js jetstream.JetStream) error {
	ev, err := shadow.NewEvaluator(js, shadow.Config{Prefix: n.cfg.Prefix, NodeID: n.cfg.NodeID,
		Replicas: n.cfg.Replicas, Lease: n.cfg.LeaseTime, Registerer: n.reg, Logger: n.log})
	if err != nil {
		return fmt.Errorf("mesh: shadow evaluator: %w", err)
	}
	n.bg.Go(func() { _ = ev.Run(bgctx) })
	return nil
}
