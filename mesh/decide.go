package mesh

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/limitmesh/limitmesh/mesh/internal/journal"
	"github.com/limitmesh/limitmesh/mesh/internal/keys"
	"github.com/limitmesh/limitmesh/mesh/internal/leasing"
	"github.com/limitmesh/limitmesh/mesh/internal/member"
	"github.com/limitmesh/limitmesh/mesh/internal/ownership"
	"github.com/limitmesh/limitmesh/mesh/internal/policyset"
	"github.com/limitmesh/limitmesh/mesh/internal/service"
	"github.com/limitmesh/limitmesh/usage"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nats.go/micro"
)

// decider is the decide role of a node: the member (journal, keys,
// ownership), leased mode (leasing), the decide service, the micro
// service that takes requests, and the subscriptions of the partitions
// the node serves. A node without RoleDecide has none.
type decider struct {
	*base
	pub *usage.Publisher // nil with NoUsage

	member  *member.Member   // nil until built
	leasing *leasing.Leasing // nil until built
	svc     *service.Service // nil until built
	micro   micro.Service    // nil until the start succeeds
	subs    *partitionSubs
}

// decideParts is what the start of the decide role takes from the start
// of the node.
type decideParts struct {
	js      jetstream.JetStream
	buckets buckets
	watcher *policyset.Watcher
	boot    string
	sink    usageSink
	metrics *ownershipMetrics
}

// start starts the decide role: the member (journal, keys, ownership),
// leased mode, the service and its subjects; it returns once every
// partition has an owner (or two leases have passed) and the micro
// service is subscribed.
func (d *decider) start(ctx, bgctx context.Context, p decideParts) error {
	jr, err := d.openJournal(ctx, bgctx, p)
	if err != nil {
		return err
	}
	if err := d.newMember(bgctx, jr, p); err != nil {
		return err
	}
	if err := d.startLeasing(bgctx); err != nil {
		return err
	}
	if err := d.newService(); err != nil {
		return err
	}
	d.member.Start()
	d.startSweeps(bgctx)
	if err := d.awaitOwners(ctx, bgctx, p.buckets.shards); err != nil {
		return err
	}
	return d.addEndpoints(ctx)
}

// openJournal opens the state journal (nil with NoJournal: records are
// written to the state bucket).
func (d *decider) openJournal(ctx, bgctx context.Context, p decideParts) (*journal.Journal, error) {
	if d.cfg.NoJournal {
		return nil, nil
	}
	jr, err := journal.Open(ctx, bgctx, journal.OpenConfig{
		Config: journal.Config{
			Self:               d.cfg.NodeID,
			Prefix:             d.cfg.Prefix,
			Parts:              d.cfg.Partitions,
			View:               d.route,
			OnFenced:           func(p int, by string) { d.member.FencedBy(p, by) },
			Runtime:            d.rt,
			Timeout:            d.cfg.DecisionTimeout,
			CheckpointInterval: min(d.cfg.CheckpointInterval, d.cfg.StateTTL/4),
			ReadCache:          2 * d.cfg.LeaseTime,
			Boot:               p.boot,
			Retention:          p.buckets.retention,
			// Adopted keys with open reservations are swept here.
			OnAdopted: func(key string, rec []byte) {
				if svc := d.svc; svc != nil {
					svc.NoteRecord(key, rec)
				}
			},
			Log: d.log,
		},
		JS:       p.js,
		Store:    p.buckets.state,
		Bucket:   d.stateBucket(),
		Replicas: d.cfg.Replicas,
		MaxAge:   d.horizon(),
		Retry:    jsSetup{js: p.js, log: d.log}.retry,
	})
	if err != nil {
		return nil, err
	}
	if d.pub != nil {
		jr.SetUsage(p.sink)
	}
	for _, c := range jr.Collectors() {
		if err := d.reg.Register(c); err != nil {
			return nil, fmt.Errorf("%w: registering metrics: %v", ErrConfig, err)
		}
	}
	return jr, nil
}

// newMember builds the member: the routing, keys, journal and ownership
// of this node.
func (d *decider) newMember(bgctx context.Context, jr *journal.Journal, p decideParts) error {
	km, err := keys.NewMetrics(d.reg, func() float64 {
		if m := d.member; m != nil {
			return float64(m.Keys.Len())
		}
		return 0
	})
	if err != nil {
		return fmt.Errorf("%w: registering metrics: %v", ErrConfig, err)
	}
	d.member = member.New(member.Config{
		Self:            d.cfg.NodeID,
		Lease:           d.cfg.LeaseTime,
		DecisionTimeout: d.cfg.DecisionTimeout,
		Runtime:         d.rt,
		Route:           d.route,
		Journal:         jr,
		Store: member.BucketStore{Bucket: p.buckets.state, Usage: p.sink.directOf, Retention: p.buckets.retention,
			Now: d.rt.Now},
		Keys: keys.Config{
			Env:           d.policies,
			Versions:      versionFetcher{p.watcher},
			MaxConflicts:  d.cfg.MaxConflicts,
			TTL:           d.cfg.StateTTL,
			AsyncInterval: d.cfg.AsyncInterval,
			LostUsage:     p.sink.lost,
			OnReservations: func(policy, key string, open int, next int64) {
				if svc := d.svc; svc != nil {
					svc.NoteReservations(policy, key, open, next)
				}
			},
			Log:     d.log,
			Metrics: km,
		},
		Shards:  ownership.NewJetStreamKV(bgctx, p.buckets.shards),
		OnServe: d.subs.serve,
		Metrics: p.metrics,
		Log:     d.log,
	})
	return nil
}

// startLeasing starts leased mode on the member's keys and subscribes
// this node's lease subject (where gateways report).
func (d *decider) startLeasing(bgctx context.Context) error {
	var err error
	d.leasing, err = leasing.New(leasing.Config{
		Conn:       d.nc,
		Prefix:     d.cfg.Prefix,
		Self:       d.cfg.NodeID,
		Policies:   d.policies,
		Keys:       d.member.Keys,
		Route:      d.route,
		Runtime:    d.rt,
		Timeout:    d.cfg.DecisionTimeout,
		Log:        d.log,
		Registerer: d.reg,
	})
	if err != nil {
		return fmt.Errorf("%w: %v", ErrConfig, err)
	}
	d.bg.Go(func() { d.leasing.Run(bgctx) })
	d.subs.handleOwner = d.leasing.HandleOwner
	return d.subs.subscribeNode(leasing.NodeSubject(d.cfg.Prefix, d.cfg.NodeID), d.leasing.HandleNode)
}

// newService builds the decide service over the member's keys.
func (d *decider) newService() error {
	sm, err := service.NewMetrics(d.reg)
	if err != nil {
		return fmt.Errorf("%w: registering metrics: %v", ErrConfig, err)
	}
	var sink service.UsageSink
	if d.pub != nil {
		sink = d.pub
	}
	d.svc = service.New(service.Config{
		Conn:            d.nc,
		Policies:        d.policies,
		Keys:            d.member.Keys,
		Route:           d.route,
		Runtime:         d.rt,
		DecisionTimeout: d.cfg.DecisionTimeout,
		Binder:          d.cfg.Binder,
		Usage:           sink,
		Leases:          d.leasing,
		Prefix:          d.cfg.Prefix,
		Log:             d.log,
		Metrics:         sm,
	})
	d.subs.handleDecide = d.svc.HandleMsg
	return nil
}

// startSweeps drops idle keys and the service's expired state in the
// background.
func (d *decider) startSweeps(bgctx context.Context) {
	// Cached keys go well before their records may expire from the bucket
	// (at least StateTTL after their last write, and never before they
	// are at rest): an idle key then starts from its durable record.
	idle := max(min(d.cfg.StateTTL/2, time.Minute), 500*time.Millisecond)
	d.bg.Go(func() { d.sweep(bgctx, idle) })
	d.svc.StartSweeps(bgctx)
}

// sweep drops idle keys every idle/2 until ctx ends.
func (d *decider) sweep(ctx context.Context, idle time.Duration) {
	tk := time.NewTicker(idle / 2)
	defer tk.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tk.C:
			d.member.Keys.Sweep(d.rt.Now().UnixNano(), idle)
		}
	}
}

// awaitOwners drives ownership (watch the shards bucket, claim this
// node's partitions) and waits, at most two leases, until no partition
// waits for an owner.
func (d *decider) awaitOwners(ctx, bgctx context.Context, shards jetstream.KeyValue) error {
	d.bg.Go(func() { ownership.Drive(bgctx, d.member.Owner, shards) })
	settle := time.NewTimer(2*d.cfg.LeaseTime + time.Second)
	defer settle.Stop()
	select {
	case <-d.member.Owner.Settled():
	case <-settle.C:
		d.log.Warn("starting before every partition has an owner")
	case <-ctx.Done():
		return fmt.Errorf("mesh: waiting for partition owners: %w", ctx.Err())
	}
	return nil
}

// addEndpoints adds the micro service and its endpoints: from then on the
// node takes requests.
func (d *decider) addEndpoints(ctx context.Context) error {
	svc, err := micro.AddService(d.nc, micro.Config{
		Name:        ServiceName,
		Version:     Version,
		Description: "limitmesh rate-limit decisions",
		QueueGroup:  QueueGroup,
		Metadata:    map[string]string{MetadataNode: d.cfg.NodeID, MetadataRoles: d.cfg.Roles.String()},
	})
	if err != nil {
		return fmt.Errorf("mesh: adding micro service: %w", err)
	}
	endpoints := []struct {
		name string
		h    func(micro.Request)
		subj string
	}{
		{"decide", d.svc.Handle, d.decideSubject()},
		// Gateways (the Go SDK) ask for grants of leased keys here; their
		// region's nodes answer (docs/protocol.md, "Leased mode").
		{"lease", d.leasing.HandleGateway, leasing.GatewaySubject(d.cfg.Prefix)},
		// Reservations (CONTRACT §10).
		{"reserve", d.svc.HandleReserve, d.cfg.Prefix + ".v1.reserve"},
		{"settle", d.svc.HandleSettle, d.cfg.Prefix + ".v1.settle"},
		{"release", d.svc.HandleRelease, d.cfg.Prefix + ".v1.release"},
		{"renew", d.svc.HandleRenew, d.cfg.Prefix + ".v1.renew"},
		// Several descriptors all or nothing (layers; the Envoy bridge).
		{"decide_all", d.svc.HandleDecideAll, d.cfg.Prefix + ".v1.decide.all"},
	}
	for _, ep := range endpoints {
		if err := svc.AddEndpoint(ep.name, micro.HandlerFunc(ep.h),
			micro.WithEndpointSubject(ep.subj),
			micro.WithEndpointQueueGroup(QueueGroup),
			micro.WithEndpointPendingLimits(-1, -1)); err != nil {
			_ = svc.Stop()
			return fmt.Errorf("mesh: adding %s endpoint: %w", ep.name, err)
		}
	}
	if err := d.nc.FlushWithContext(ctx); err != nil {
		_ = svc.Stop()
		return fmt.Errorf("mesh: flushing subscriptions: %w", err)
	}
	d.micro = svc
	return nil
}

// leave stops taking requests (the micro service's subscriptions are
// drained), gives every grant this node holds back, hands every partition
// over and waits, bounded by ctx, until no decision is in flight.
func (d *decider) leave(ctx context.Context) error {
	err := d.micro.Stop()
	// Give every grant this node holds back to its key's owner while the
	// owners are still there.
	lctx, lcancel := context.WithTimeout(ctx, 2*d.cfg.DecisionTimeout)
	d.leasing.Stop(lctx)
	lcancel()
	// Leave the mesh: hand every partition over (each is drained, its
	// keys dropped, its entry deleted so the next owner claims it at once
	// in a greater epoch).
	left := make(chan error, 1)
	timeout := 30 * time.Second
	if dl, ok := ctx.Deadline(); ok {
		timeout = time.Until(dl)
	}
	d.member.Owner.Leave(timeout, func(e error) { left <- e })
	err = errors.Join(err, <-left)
	// Drain: the subscription delivers what it already holds, so wait
	// until no request has been in flight for a quiet period (the micro
	// service does not expose the drain's completion), bounded by ctx.
	t := time.NewTicker(2 * time.Millisecond)
	defer t.Stop()
	quiet := 0
	for {
		if d.svc.Inflight() == 0 {
			quiet++
		} else {
			quiet = 0
		}
		if quiet >= 10 {
			return err
		}
		select {
		case <-ctx.Done():
			return errors.Join(err, fmt.Errorf("mesh: stop: %d decisions still in flight: %w", d.svc.Inflight(), ctx.Err()))
		case <-t.C:
		}
	}
}

// close stops the member and unsubscribes what the role subscribed, once
// the background work has ended. It is safe after a failed start.
func (d *decider) close() {
	if d.member != nil {
		d.member.Stop()
	}
	d.subs.close()
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
