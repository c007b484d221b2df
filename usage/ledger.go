package usage

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/limitmesh/limitmesh/kvstate"
)

// QuotaLimit is a quota limit of a policy, as the reconciler compares it
// with the ledger.
type QuotaLimit struct {
	Name   string // the limit's name in its policy
	Period string // "hour", "day", "week" or "month" (hour quotas are not compared: the ledger keeps days and months)
}

// ReconcilerConfig configures a [Reconciler].
type ReconcilerConfig struct {
	Prefix   string // subject prefix; default "rl"
	Node     string // this node's id, for the cursor entry and logs
	Replicas int    // replicas of the ledger bucket when it is created; default 1

	// QuotaLimits returns the quota limits of a policy (none: the policy's
	// keys are not compared). nil: no reconciliation.
	QuotaLimits func(policy string) []QuotaLimit
	// QuotaState returns, per quota limit name, the micro-units the
	// limiter's own state has spent for key in the period containing at;
	// ok false when it has no state for the key. nil: no reconciliation.
	QuotaState func(ctx context.Context, policy, key string, at time.Time) (units map[string]int64, ok bool, err error)
	// ReconcileInterval is the least time between two comparisons, made
	// only while the ledger is caught up; default 10 s.
	ReconcileInterval time.Duration
	// Settle is how long a key must have had no record applied before it is
	// compared (records in flight would show as differences); default 2 s.
	Settle time.Duration

	// A group of messages is applied in memory and written to the ledger
	// once (each changed entry one write): when it holds MaxGroup messages
	// or MaxGroupRecords records, or GroupInterval after it started,
	// whichever comes first; and sooner when the stream has no more
	// messages for now and the group changed at most 256 entries. The
	// larger the group, the fewer writes per record: under load a key
	// costs two writes (its day and month) per GroupInterval.
	MaxGroup         int           // default 1024 messages
	MaxGroupRecords  int           // default 500,000 records
	GroupInterval    time.Duration // default 5 s
	FetchBatch       int           // messages per fetch request; default 64
	MaxCachedEntries int           // totals entries kept in memory between groups; default 200,000
	OpTimeout        time.Duration // bounds each KV and stream operation; default 10 s
	PruneInterval    time.Duration // how often watermarks older than the stream's retention are pruned; default 10 min
	// RetentionInterval is how often the active reconciler checks how
	// near the ledger's and the shadow evaluator's unread records are to
	// the oldest the stream holds (retention.go); default 15 s.
	RetentionInterval time.Duration

	Registerer prometheus.Registerer // nil: metrics are not registered
	Logger     *slog.Logger          // nil: no logs
}

// Reconciler keeps the usage ledger (CONTRACT.md §6): it consumes the usage
// stream with the durable pull consumer limitmesh-ledger, in stream order,
// and keeps exact decimal totals per policy, limit key and UTC day and
// month in the ledger bucket, counting every record once (see ledgerCore
// for the rules). Garbage on the usage subjects is skipped, counted in
// limitmesh_usage_invalid_total and acknowledged.
//
// Run it under an elector (internal/elector: one active at a time): Run is the job. A
// second reconciler running at the same time would not double count (every
// write is a compare-and-swap and the per-entry sequences hold), but the
// two would keep conflicting.
//
// Each leadership session starts from the cursor entry (the last stream
// sequence wholly applied): it resets the consumer to the sequence after
// it, so messages the previous holder had fetched and not finished are
// delivered again at once, in order. Within a session it fetches messages
// (FetchBatch at a time), loads the entries they need that it does not
// hold (direct gets of many keys, from a replica holding the bucket at
// least up to the cursor's last write), applies them in memory, and at the
// end of a group (see MaxGroup) writes every changed entry once
// (compare-and-swap, pipelined), then the watermarks, then the cursor, and
// acknowledges the group's messages. Any failure (a conflict, a timeout, a
// delivery out of order) ends the session; the next one starts again from
// the cursor with nothing held, which the idempotence rules make safe.
type Reconciler struct {
	js     jetstream.JetStream
	cfg    ReconcilerConfig
	kv     jetstream.KeyValue
	store  *kvstate.JetStreamStore
	stream string
	m      *ledgerMetrics
	log    *slog.Logger

	mu      sync.Mutex // guards tracked (read by tests)
	tracked map[policyKey]*trackedKey

	// crashAfter, when >= 0, makes a session write only that many totals
	// entries of its next group and then fail, as if it died between two
	// writes (tests).
	crashAfter int
}

// trackedKey is a key awaiting comparison with the limiter's state.
type trackedKey struct {
	lastUs    int64     // greatest t_us of an allowed record applied
	appliedAt time.Time // when it was applied (this process's clock)
	checkedUs int64     // lastUs when it was last compared
}

// Defaults of ReconcilerConfig.
const (
	DefaultReconcileInterval = 10 * time.Second
	DefaultSettle            = 2 * time.Second
	DefaultMaxGroup          = 1024
	DefaultMaxGroupRecords   = 500_000
	DefaultGroupInterval     = 5 * time.Second
	DefaultFetchBatch        = 64
	DefaultMaxCachedEntries  = 200_000
	DefaultOpTimeout         = 10 * time.Second
	DefaultPruneInterval     = 10 * time.Minute
)

// idleWait is how long a caught-up session waits for the next message.
const idleWait = time.Second

// EnsureLedger returns the ledger bucket <prefix>_ledger, creating it when
// it is missing (history 1, file storage, replicas as given). An existing
// bucket is bound as it is.
func EnsureLedger(ctx context.Context, js jetstream.JetStream, prefix string, replicas int) (jetstream.KeyValue, error) {
	if prefix == "" {
		prefix = "rl"
	}
	name := LedgerBucket(prefix)
	kv, err := js.KeyValue(ctx, name)
	if err == nil {
		return kv, nil
	}
	if !errors.Is(err, jetstream.ErrBucketNotFound) {
		return nil, fmt.Errorf("usage: ledger bucket %s: %w", name, err)
	}
	kv, err = js.CreateKeyValue(ctx, jetstream.KeyValueConfig{
		Bucket:      name,
		Description: "limitmesh usage ledger (CONTRACT.md §6)",
		History:     1,
		Storage:     jetstream.FileStorage,
		Replicas:    max(replicas, 1),
	})
	if errors.Is(err, jetstream.ErrBucketExists) || errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
		kv, err = js.KeyValue(ctx, name)
	}
	if err != nil {
		return nil, fmt.Errorf("usage: create ledger bucket %s: %w", name, err)
	}
	return kv, nil
}

// NewReconciler returns a reconciler of the usage stream of cfg.Prefix,
// creating the ledger bucket if it is missing. It does not start: run
// [Reconciler.Run] (under an elector on [Reconciler.KV], key
// LedgerLeaderKey).
func NewReconciler(ctx context.Context, js jetstream.JetStream, cfg ReconcilerConfig) (*Reconciler, error) {
	if cfg.Prefix == "" {
		cfg.Prefix = "rl"
	}
	if cfg.ReconcileInterval <= 0 {
		cfg.ReconcileInterval = DefaultReconcileInterval
	}
	if cfg.Settle <= 0 {
		cfg.Settle = DefaultSettle
	}
	if cfg.MaxGroup <= 0 {
		cfg.MaxGroup = DefaultMaxGroup
	}
	if cfg.MaxGroupRecords <= 0 {
		cfg.MaxGroupRecords = DefaultMaxGroupRecords
	}
	if cfg.GroupInterval <= 0 {
		cfg.GroupInterval = DefaultGroupInterval
	}
	if cfg.FetchBatch <= 0 {
		cfg.FetchBatch = DefaultFetchBatch
	}
	cfg.FetchBatch = min(cfg.FetchBatch, cfg.MaxGroup)
	if cfg.MaxCachedEntries <= 0 {
		cfg.MaxCachedEntries = DefaultMaxCachedEntries
	}
	if cfg.OpTimeout <= 0 {
		cfg.OpTimeout = DefaultOpTimeout
	}
	if cfg.PruneInterval <= 0 {
		cfg.PruneInterval = DefaultPruneInterval
	}
	if cfg.RetentionInterval <= 0 {
		cfg.RetentionInterval = DefaultRetentionInterval
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	kv, err := EnsureLedger(ctx, js, cfg.Prefix, cfg.Replicas)
	if err != nil {
		return nil, err
	}
	store, err := kvstate.NewJetStreamStore(ctx, js, LedgerBucket(cfg.Prefix))
	if err != nil {
		return nil, fmt.Errorf("usage: ledger store: %w", err)
	}
	m, err := newLedgerMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	return &Reconciler{
		js: js, cfg: cfg, kv: kv, store: store,
		stream:     StreamName(cfg.Prefix),
		m:          m,
		log:        log.With("component", "usage-ledger"),
		tracked:    make(map[policyKey]*trackedKey),
		crashAfter: -1,
	}, nil
}

// KV is the ledger bucket (the reconciler's elector keeps its lease there).
func (r *Reconciler) KV() jetstream.KeyValue { return r.kv }

// Run keeps the ledger until ctx ends, then returns nil. A session that
// fails (see Reconciler) is logged and started again after a short pause.
// Meanwhile it checks the consumers' retention headroom every
// RetentionInterval (retention.go).
func (r *Reconciler) Run(ctx context.Context) error {
	wctx, stopWatch := context.WithCancel(ctx)
	var watch sync.WaitGroup
	watch.Go(func() {
		newRetentionWatch(r.js, r.cfg.Prefix, r.m.retention, r.log).run(wctx, r.cfg.RetentionInterval, r.cfg.OpTimeout)
	})
	defer func() {
		stopWatch()
		watch.Wait()
	}()
	backoff := 100 * time.Millisecond
	for {
		err := r.session(ctx)
		r.m.lag.Set(0)
		if ctx.Err() != nil {
			return nil
		}
		if errors.Is(err, kvstate.ErrConflict) {
			r.log.Info("ledger session ended by a conflicting write; restarting", "err", err)
		} else {
			r.log.Warn("ledger session failed; restarting", "err", err, "after", backoff)
		}
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
		backoff = min(2*backoff, 2*time.Second)
	}
}

type ledgerMetrics struct {
	lag         prometheus.Gauge
	invalid     prometheus.Counter
	counted     prometheus.Counter
	duplicate   prometheus.Counter
	corrupt     prometheus.Counter
	corrections *prometheus.CounterVec
	checks      *prometheus.CounterVec
	retention   *retentionMetrics
}

func newLedgerMetrics(reg prometheus.Registerer) (*ledgerMetrics, error) {
	records := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "limitmesh_usage_ledger_records_total",
		Help: "Usage records the ledger applied: counted, or duplicate (a journalled record counted before).",
	}, []string{"outcome"})
	m := &ledgerMetrics{
		lag: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "limitmesh_usage_lag_seconds",
			Help: "Age of the oldest usage record not yet in the ledger (0 when caught up; reported by the active reconciler).",
		}),
		invalid: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "limitmesh_usage_invalid_total",
			Help: "Messages on the usage subjects that are not valid usage batches (skipped).",
		}),
		counted:   records.WithLabelValues("counted"),
		duplicate: records.WithLabelValues("duplicate"),
		corrupt: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "limitmesh_usage_ledger_corrupt_total",
			Help: "Ledger entries that did not decode and were started again from zero.",
		}),
		corrections: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limitmesh_reconcile_corrections_total",
			Help: "Differences found between the ledger and the limiter's quota state, by policy.",
		}, []string{"policy"}),
		checks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limitmesh_reconcile_checks_total",
			Help: "Comparisons of a key's quota limit with the ledger, by policy (each difference is also a correction).",
		}, []string{"policy"}),
		retention: newRetentionMetrics(),
	}
	if reg != nil {
		for _, c := range append([]prometheus.Collector{m.lag, m.invalid, records, m.corrupt, m.corrections, m.checks}, m.retention.collectors()...) {
			if err := reg.Register(c); err != nil {
				return nil, fmt.Errorf("%w: %w", errRegister, err)
			}
		}
	}
	return m, nil
}
