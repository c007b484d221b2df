// Package mesh is the limitmesh node: the decide endpoint as a NATS micro
// service, limiter state in JetStream KV written with compare-and-swap,
// live policies from a watched KV bucket, metrics and health over HTTP, and
// an embedded nats-server for single-binary deployments.
//
// A node is correct when several nodes serve the same keys at once: every
// state change is a compare-and-swap on the key's KV revision, and a lost
// race is reloaded and decided again. The per-key logic is a pure core
// (owner.go) driven by a thin goroutine (keys.go).
//
// Keys hash to partitions, each owned by one node at a time under a lease
// with epochs (shard.go, shardrun.go); any node accepts a decide request and
// forwards it to the owner of the key's partition (route.go), so a hot key
// is decided by one in-memory owner instead of racing writes across nodes.
//
// mesh imports kvstate and policies; it must not import cmd or integration.
package mesh

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"regexp"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nats.go/micro"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Version is the version the micro service reports.
const Version = "0.3.0"

// ServiceName and QueueGroup are the micro service's name and queue group
// (CONTRACT.md §1).
const (
	ServiceName = "limitmesh"
	QueueGroup  = "limitmesh"
)

// Defaults for NodeConfig.
const (
	DefaultPrefix          = "rl"
	DefaultDecisionTimeout = 500 * time.Millisecond
	DefaultStateTTL        = time.Hour
	// DefaultMaxConflicts bounds the lost compare-and-swap writes one
	// decision may go through before it fails with 503.
	DefaultMaxConflicts = 8
	// policyHistory is the history of a policy bucket the node creates.
	policyHistory = 16
	// DefaultPartitions is the number of partitions of the key space.
	DefaultPartitions = 64
	// MaxPartitions bounds NodeConfig.Partitions.
	MaxPartitions = 4096
	// DefaultLeaseTime is the partition lease: an owner that stops renewing
	// loses its partitions after it.
	DefaultLeaseTime = 3 * time.Second
	// MinLeaseTime bounds NodeConfig.LeaseTime from below.
	MinLeaseTime = 150 * time.Millisecond
)

// NodeConfig configures a node. The zero value is usable (defaults noted).
type NodeConfig struct {
	Prefix          string        // subject and bucket prefix; default "rl"
	DecisionTimeout time.Duration // deadline of one decision; default 500ms
	Replicas        int           // replicas of buckets the node creates; default 1
	StateTTL        time.Duration // idle expiry of limiter state (bucket TTL); default 1h
	Logger          *slog.Logger  // nil: discard
	Registry        *prometheus.Registry
	Clock           func() time.Time // nil: time.Now
	// MaxConflicts bounds lost CAS writes per decision; default 8.
	MaxConflicts int
	// AsyncInterval is the write-behind interval of async-mode policies: a
	// key's unwritten changes are written at most this long after the first
	// of them (plus the duration of a write in flight); default
	// DefaultAsyncInterval (100ms). See mode.go for the overshoot bound.
	AsyncInterval time.Duration
	// Partitions is the number of partitions limit keys hash to (default
	// 64, at most MaxPartitions). It is recorded in the shards bucket by
	// the first node; a node with another count does not start.
	Partitions int
	// LeaseTime is the partition lease (default 3 s, at least 150 ms):
	// owners renew every LeaseTime/3 and stop serving 2/3 of it after
	// their last successful renewal; other nodes take over a partition
	// whose entry was not renewed for LeaseTime as they observe it.
	LeaseTime time.Duration
	// CheckpointInterval is how often journalled state records are
	// checkpointed to the state bucket (journal.go); default
	// DefaultCheckpointInterval.
	CheckpointInterval time.Duration
	// NoJournal writes every state record to the state bucket (one
	// compare-and-swap per key and batch) instead of journalling them.
	NoJournal bool
	// NodeID names the node in the shards bucket ([A-Za-z0-9_-], 1..64
	// bytes); default: random. It must be unique among running nodes; a
	// node restarted with the same id takes its old entries over at once.
	NodeID string
}

var (
	prefixRE = regexp.MustCompile(`^[a-z0-9][a-z0-9_-]{0,31}$`)
	nodeIDRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)
)

// Node is one limitmesh node. Start it once; Stop drains it. Its methods
// are safe for concurrent use.
type Node struct {
	nc      *nats.Conn
	cfg     NodeConfig
	log     *slog.Logger
	reg     *prometheus.Registry
	metrics *metrics
	clock   func() time.Time

	policies *policySet
	watcher  *policyWatcher
	store    kvstate.Store
	keys     *keyTable
	routed   sync.Pool     // *routed values, recycled once answered
	memo     reqMemo       // decide bodies seen lately (memo.go)
	router   *router       // nil in offline unit tests: every key is decided here
	shards   *shardRunner  // nil before Start
	journal  *journalStore // nil before Start and with NoJournal

	ready    atomic.Bool
	inflight atomic.Int64

	mu      sync.Mutex
	started bool
	stopped bool
	svc     micro.Service
	cancel  context.CancelFunc
	bg      sync.WaitGroup
}

// NewNode returns a node on nc; it does nothing until Start.
func NewNode(nc *nats.Conn, cfg NodeConfig) (*Node, error) {
	if nc == nil {
		return nil, fmt.Errorf("%w: nil connection", ErrConfig)
	}
	if cfg.Prefix == "" {
		cfg.Prefix = DefaultPrefix
	}
	if !prefixRE.MatchString(cfg.Prefix) {
		return nil, fmt.Errorf("%w: prefix %q must match %s", ErrConfig, cfg.Prefix, prefixRE)
	}
	if cfg.DecisionTimeout <= 0 {
		cfg.DecisionTimeout = DefaultDecisionTimeout
	}
	if cfg.Replicas <= 0 {
		cfg.Replicas = 1
	}
	if cfg.StateTTL <= 0 {
		cfg.StateTTL = DefaultStateTTL
	}
	if cfg.MaxConflicts <= 0 {
		cfg.MaxConflicts = DefaultMaxConflicts
	}
	if cfg.CheckpointInterval <= 0 {
		cfg.CheckpointInterval = DefaultCheckpointInterval
	}
	if cfg.Partitions == 0 {
		cfg.Partitions = DefaultPartitions
	}
	if cfg.Partitions < 1 || cfg.Partitions > MaxPartitions {
		return nil, fmt.Errorf("%w: partitions %d not in [1, %d]", ErrConfig, cfg.Partitions, MaxPartitions)
	}
	if cfg.LeaseTime == 0 {
		cfg.LeaseTime = DefaultLeaseTime
	}
	if cfg.LeaseTime < MinLeaseTime {
		return nil, fmt.Errorf("%w: lease time %v below %v", ErrConfig, cfg.LeaseTime, MinLeaseTime)
	}
	if cfg.NodeID == "" {
		var b [8]byte
		_, _ = rand.Read(b[:])
		cfg.NodeID = hex.EncodeToString(b[:])
	}
	if !nodeIDRE.MatchString(cfg.NodeID) {
		return nil, fmt.Errorf("%w: node id %q must match %s", ErrConfig, cfg.NodeID, nodeIDRE)
	}
	n := &Node{nc: nc, cfg: cfg, log: cfg.Logger, reg: cfg.Registry, clock: cfg.Clock}
	if n.log == nil {
		n.log = slog.New(slog.DiscardHandler)
	}
	if n.reg == nil {
		n.reg = prometheus.NewRegistry()
	}
	if n.clock == nil {
		n.clock = time.Now
	}
	n.policies = newPolicySet()
	n.keys = newKeyTable()
	n.router = newRouter(cfg.Prefix, cfg.Partitions)
	m, err := newMetrics(n.reg, func() float64 { return float64(n.keys.len()) })
	if err != nil {
		return nil, fmt.Errorf("%w: registering metrics: %v", ErrConfig, err)
	}
	n.metrics = m
	return n, nil
}

// PolicyBucket, StateBucket, ShardBucket and DecideSubject are the names
// the node uses; ShardSubject(p) is partition p's subject.
func (n *Node) PolicyBucket() string      { return n.cfg.Prefix + "_policies" }
func (n *Node) StateBucket() string       { return n.cfg.Prefix + "_state" }
func (n *Node) ShardBucket() string       { return n.cfg.Prefix + "_shards" }
func (n *Node) DecideSubject() string     { return n.cfg.Prefix + ".v1.decide" }
func (n *Node) ShardSubject(p int) string { return n.cfg.Prefix + ".v1.shard." + strconv.Itoa(p) }

// ID returns the node's id in the shards bucket.
func (n *Node) ID() string { return n.cfg.NodeID }

// Partitions returns the partition count.
func (n *Node) Partitions() int { return n.cfg.Partitions }

// PartitionOf returns the partition of a limit key.
func (n *Node) PartitionOf(key string) int { return partitionOf(key, n.cfg.Partitions) }

// Owns reports whether the node serves partition p now.
func (n *Node) Owns(p int) bool { return n.router.serving(p) }

// Epoch returns the epoch in which the node holds partition p (0 when it
// does not hold it).
func (n *Node) Epoch(p int) uint64 {
	if !n.router.serving(p) {
		return 0
	}
	return n.router.slots[p].epoch.Load()
}

// Start creates missing buckets, applies the current policies, starts the
// policy watch and the decide service, and returns once the node serves.
// ctx bounds the start; the node keeps running after it returns.
func (n *Node) Start(ctx context.Context) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.stopped {
		return ErrStopped
	}
	if n.started {
		return fmt.Errorf("%w: already started", ErrConfig)
	}
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
		TTL:         n.cfg.StateTTL,
		Storage:     jetstream.FileStorage,
		Replicas:    n.cfg.Replicas,
	}); err != nil {
		return err
	}
	store, err := kvstate.NewJetStreamStore(ctx, js, n.StateBucket())
	if err != nil {
		return err
	}
	n.store = &fencedStore{Store: store, n: n}
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
		return checkShardConfig(ctx, skv, n.cfg.Partitions)
	}); err != nil {
		return err
	}

	bgctx, cancel := context.WithCancel(context.Background())
	n.cancel = cancel
	n.watcher = &policyWatcher{kv: pkv, set: n.policies, log: n.log, metrics: n.metrics}
	w, err := pkv.WatchAll(bgctx)
	if err != nil {
		cancel()
		return fmt.Errorf("mesh: watching %s: %w", n.PolicyBucket(), err)
	}
	ready := make(chan struct{})
	n.bg.Add(2)
	go func() { defer n.bg.Done(); n.watcher.run(bgctx, w, ready) }()
	go func() {
		defer n.bg.Done()
		// Cached keys go well before their records expire from the
		// bucket (which happens up to a checkpoint interval after the
		// last change): an idle key then starts from the bucket, fresh.
		n.keys.sweep(bgctx, n.clock, max(min(n.cfg.StateTTL/2, time.Minute), 500*time.Millisecond))
	}()
	select {
	case <-ready:
	case <-ctx.Done():
		cancel()
		n.bg.Wait()
		return fmt.Errorf("mesh: waiting for the initial policies: %w", ctx.Err())
	}

	if !n.cfg.NoJournal {
		j, err := n.startJournal(ctx, bgctx, js, store)
		if err != nil {
			cancel()
			n.bg.Wait()
			return err
		}
		n.journal = j
		n.store = &fencedStore{Store: j, n: n}
	}

	// Ownership: watch the shards bucket, claim this node's partitions, and
	// wait (at most two leases) until no partition waits for an owner.
	sw, err := skv.WatchAll(bgctx)
	if err != nil {
		cancel()
		n.bg.Wait()
		return fmt.Errorf("mesh: watching %s: %w", n.ShardBucket(), err)
	}
	n.shards = newShardRunner(n, skv)
	n.bg.Add(1)
	go func() { defer n.bg.Done(); n.shards.run(bgctx, sw) }()
	settle := time.NewTimer(2*n.cfg.LeaseTime + time.Second)
	select {
	case <-n.shards.settled:
	case <-settle.C:
		n.log.Warn("starting before every partition has an owner")
	case <-ctx.Done():
		settle.Stop()
		cancel()
		n.bg.Wait()
		return fmt.Errorf("mesh: waiting for partition owners: %w", ctx.Err())
	}
	settle.Stop()

	svc, err := micro.AddService(n.nc, micro.Config{
		Name:        ServiceName,
		Version:     Version,
		Description: "limitmesh rate-limit decisions",
		QueueGroup:  QueueGroup,
	})
	if err != nil {
		cancel()
		n.bg.Wait()
		return fmt.Errorf("mesh: adding micro service: %w", err)
	}
	if err := svc.AddEndpoint("decide", micro.HandlerFunc(n.handleDecide),
		micro.WithEndpointSubject(n.DecideSubject()),
		micro.WithEndpointQueueGroup(QueueGroup),
		micro.WithEndpointPendingLimits(-1, -1)); err != nil {
		_ = svc.Stop()
		cancel()
		n.bg.Wait()
		return fmt.Errorf("mesh: adding decide endpoint: %w", err)
	}
	if err := n.nc.FlushWithContext(ctx); err != nil {
		_ = svc.Stop()
		cancel()
		n.bg.Wait()
		return fmt.Errorf("mesh: flushing subscriptions: %w", err)
	}
	n.svc = svc
	n.started = true
	n.ready.Store(true)
	n.log.Info("node serving", "subject", n.DecideSubject(), "policies", n.policies.snap.Load().Len(),
		"node", n.cfg.NodeID, "partitions_owned", n.router.owned())
	return nil
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

// PolicyRevision returns the KV revision of the version of policy name in
// force on this node, and false when the node has no such policy. A put
// reaches every node within about a second; tests and operators use this
// to see that a particular node has applied it.
func (n *Node) PolicyRevision(name string) (uint64, bool) {
	p := n.policies.current(name)
	if p == nil {
		return 0, false
	}
	return p.Revision, true
}

// Ready reports whether the node serves decisions (false before Start
// returns and from the start of Stop).
func (n *Node) Ready() bool { return n.ready.Load() }

// Stop makes /readyz fail, stops taking requests (the service's
// subscription is drained), waits for in-flight decisions to be answered
// (bounded by ctx) and stops the background work. It is safe to call more
// than once and after a failed Start.
func (n *Node) Stop(ctx context.Context) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.stopped {
		return nil
	}
	n.stopped = true
	n.ready.Store(false)
	var err error
	if n.svc != nil {
		err = n.svc.Stop()
		// Leave the mesh: hand every partition over (each is drained,
		// its keys dropped, its entry deleted so the next owner claims it
		// at once in a greater epoch).
		if n.shards != nil {
			err = errors.Join(err, n.shards.leave(ctx))
		}
		// Drain: the subscription delivers what it already holds, so wait
		// until no request has been in flight for a quiet period (the
		// micro service does not expose the drain's completion), bounded
		// by ctx.
		t := time.NewTicker(2 * time.Millisecond)
		defer t.Stop()
		quiet := 0
	wait:
		for {
			if n.inflight.Load() == 0 {
				quiet++
			} else {
				quiet = 0
			}
			if quiet >= 10 {
				break
			}
			select {
			case <-ctx.Done():
				err = errors.Join(err, fmt.Errorf("mesh: stop: %d decisions still in flight: %w", n.inflight.Load(), ctx.Err()))
				break wait
			case <-t.C:
			}
		}
	}
	if n.cancel != nil {
		n.cancel()
	}
	n.bg.Wait()
	return err
}

// HTTPHandler serves GET /metrics (Prometheus), /healthz (200 while the
// process runs) and /readyz (200 once the node serves, 503 before and
// while it drains).
func (n *Node) HTTPHandler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(n.reg, promhttp.HandlerOpts{Registry: n.reg}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		if !n.Ready() {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = w.Write([]byte("not ready\n"))
			return
		}
		_, _ = w.Write([]byte("ready\n"))
	})
	return mux
}
