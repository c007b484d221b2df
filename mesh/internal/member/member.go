// Package member is one node's part of the mesh: the routing table, the
// keys it decides, its state journal and its ownership runner, wired
// together. It is the glue between them: the runner tells it which
// partitions to serve (ownership.Host), the key owners ask it whether a
// lost compare-and-swap means the partition moved (keys.Fencer), and the
// journal tells it when a fence took a partition away.
//
// The node (package mesh) builds a Member over JetStream; the
// deterministic simulation (package sim) builds several over a simulated
// JetStream and drives them with one seeded scheduler.
package member

import (
	"log/slog"
	"sync"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/journal"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/keys"
	"github.com/limitmesh/limitmesh/mesh/internal/ownership"
	"github.com/limitmesh/limitmesh/mesh/internal/route"
	"github.com/limitmesh/limitmesh/mesh/internal/rt"
)

// Config configures a Member.
type Config struct {
	Self            string
	Lease           time.Duration
	DecisionTimeout time.Duration
	Runtime         rt.Runtime
	Route           *route.Table
	// Journal is the node's state journal; nil: the key owners write to
	// Store (the state bucket) directly.
	Journal *journal.Journal
	Store   keys.Store
	// Keys configures the key table; Store, Fencer, Partition and Runtime
	// are set by New.
	Keys   keys.Config
	Shards ownership.KV
	// OnServe, when not nil, is told when this node starts (true) or
	// stops (false) holding partition p (the node subscribes p's subject).
	OnServe func(p int, serving bool)
	Metrics ownership.Metrics
	Log     *slog.Logger
}

// Member is one node's routing table, keys, journal and ownership runner.
type Member struct {
	Route   *route.Table
	Keys    *keys.Table
	Journal *journal.Journal
	Owner   *ownership.Runner

	cfg Config
	log *slog.Logger

	mu   sync.Mutex
	held []bool // partitions OnServe was told of
}

// New wires a member; nothing runs before the runner gets its watch
// (Owner.Ready) and Start.
func New(cfg Config) *Member {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	parts := cfg.Route.Parts()
	m := &Member{Route: cfg.Route, Journal: cfg.Journal, cfg: cfg, log: cfg.Log, held: make([]bool, parts)}
	kc := cfg.Keys
	kc.Store = cfg.Store
	if cfg.Journal != nil {
		kc.Store = cfg.Journal
		kc.UsageKept = true // the journal publishes a landed write's usage
		// The keys with open reservations an adoption finds in the
		// partition's index (J17) are told as those a load finds.
		cfg.Journal.SetReservations(kc.OnReservations)
	}
	kc.Fencer = m
	kc.Partition = func(key string) int { return ownership.PartitionOf(key, parts) }
	kc.Runtime = cfg.Runtime
	if kc.DecisionTimeout == 0 {
		kc.DecisionTimeout = cfg.DecisionTimeout
	}
	m.Keys = keys.New(kc)
	var life ownership.Lifecycle
	if cfg.Journal != nil {
		life = cfg.Journal
	}
	m.Owner = ownership.NewRunner(ownership.Config{
		Self:    cfg.Self,
		Parts:   parts,
		Lease:   cfg.Lease,
		KV:      cfg.Shards,
		Life:    life,
		Host:    m,
		Runtime: cfg.Runtime,
		Log:     cfg.Log,
		Metrics: cfg.Metrics,
		Base:    cfg.Route.Base(),
	})
	return m
}

// Start starts the journal's checkpoints.
func (m *Member) Start() {
	if m.Journal != nil {
		m.Journal.Start()
	}
}

// Stop stops the runner and the journal (a crash, or the end of a
// graceful stop): nothing more is written.
func (m *Member) Stop() {
	m.Owner.Stop()
	if m.Journal != nil {
		m.Journal.Stop()
	}
}

// Serve implements ownership.Host.
func (m *Member) Serve(p int, epoch uint64, until int64) {
	lapsed := !m.Route.Serving(p)
	m.Route.Set(p, epoch, until)
	m.told(p, true)
	if lapsed && m.Journal != nil {
		// The sweeps forget the keys of a partition not served: p's are
		// told again whenever it is served after it was not (an adoption
		// tells them too, J17, but a renewal that lands after this node's
		// lease ran out serves p again without one).
		m.Journal.TellReservations(p)
	}
}

// Unserve implements ownership.Host.
func (m *Member) Unserve(p int) {
	m.Route.Clear(p)
	m.told(p, false)
}

func (m *Member) told(p int, held bool) {
	m.mu.Lock()
	changed := m.held[p] != held
	m.held[p] = held
	m.mu.Unlock()
	if changed && m.cfg.OnServe != nil {
		m.cfg.OnServe(p, held)
	}
}

// Drain implements ownership.Host: it waits until p has no call in flight
// here (bounded by the decision timeout: p no longer serves, so no new call
// starts), writes its keys' unwritten async changes (bounded again), then
// drops its keys.
func (m *Member) Drain(p int, done func()) {
	r := m.cfg.Runtime
	bound := m.cfg.DecisionTimeout + 100*time.Millisecond
	deadline := r.Now().Add(bound)
	slot := m.Route.Slot(p)
	var wait func()
	wait = func() {
		if slot.Inflight.Load() > 0 && r.Now().Before(deadline) {
			r.AfterFunc(time.Millisecond, wait)
			return
		}
		m.Keys.FlushPartition(p, r.Now().Add(bound), func() {
			m.Keys.DropPartition(p)
			done()
		})
	}
	wait()
}

// Dropped implements ownership.Host.
func (m *Member) Dropped(p int) { m.Keys.DropPartition(p) }

// Fenced implements keys.Fencer: a write of key lost its compare-and-swap;
// it is fenced when this node no longer serves the key's partition or the
// partition's entry names another owner or epoch.
func (m *Member) Fenced(key string, timeout time.Duration, done func(bool)) {
	p := ownership.PartitionOf(key, m.Route.Parts())
	if !m.Route.Serving(p) {
		done(true)
		return
	}
	m.Owner.Verify(p, timeout, func(ok bool) { done(!ok) })
}

// FencedBy is the journal's OnFenced: node by fenced partition p away from
// this node. It stops serving p at once and reads p's entry, so the runner
// learns of the new owner.
func (m *Member) FencedBy(p int, by string) {
	m.Route.Clear(p)
	m.Owner.Verify(p, m.cfg.DecisionTimeout, func(bool) {})
}

// BucketStore is the state bucket as the key owners' store of a node
// without the state journal: every record is a compare-and-swap write of
// its key, and the usage of the admissions it spends goes to Usage once
// the write succeeded (not durable beyond this node: the journal's is).
//
// With Retention on, each write carries the record's time to live
// (keyrec.Retention.TTLOf at the write, by Now): the bucket keeps it the
// state TTL, or until it comes to rest when that is later. The bucket must
// then be a kvstate.TTLStore allowing per-message TTLs; another store
// writes without.
type BucketStore struct {
	Bucket    kvstate.AsyncStore
	Usage     func(key string, record []byte, us []keyrec.Usage) // nil: none
	Retention keyrec.Retention
	Now       func() time.Time // the clock of records' RestAt; nil: time.Now
}

// GetAsync implements keys.Store.
func (b BucketStore) GetAsync(key string, timeout time.Duration, done func([]byte, uint64, error)) {
	b.Bucket.GetAsync(key, timeout, done)
}

// UpdateAsync implements keys.Store.
func (b BucketStore) UpdateAsync(key string, value []byte, usage []keyrec.Usage, rev uint64, timeout time.Duration, done func(uint64, error)) {
	written := func(r uint64, err error) {
		if err == nil && len(usage) > 0 && b.Usage != nil {
			b.Usage(key, value, usage)
		}
		done(r, err)
	}
	if ts, ok := b.Bucket.(kvstate.TTLStore); ok && b.Retention.On() {
		now := time.Now
		if b.Now != nil {
			now = b.Now
		}
		ts.UpdateAsyncTTL(key, value, rev, b.Retention.TTLOf(value, now().UnixNano()), timeout, written)
		return
	}
	b.Bucket.UpdateAsync(key, value, rev, timeout, written)
}
