// Package mesh is the limitmesh node: the decide endpoint as a NATS micro
// service, live policies from a watched KV bucket, limit keys sharded to
// owner nodes with leases and epochs, limiter state journalled and
// checkpointed to JetStream KV, metrics and health over HTTP, and an
// embedded nats-server for single-binary deployments.
//
// The node wires packages that each own one concept (docs/internals.md):
//
//	internal/policyset  the policies in force and their versions, the watch
//	internal/service    the decide endpoint: decoding, the memo, forwarding, replies
//	internal/keys       per-key owner cores with group commit, modes, local keys
//	internal/route      which partitions this node serves now
//	internal/ownership  partition leases and epochs: a core and its runner
//	internal/journal    the state journal: appends, checkpoints, fences, adoption
//	internal/lease      leased mode's pure core: grants, refunds, a holder's pool
//	internal/leasing    leased mode's I/O: owner, holder and gateway sides
//	internal/member     one node's routing, keys, journal and ownership, wired
//	internal/sim        the deterministic simulation of several members
//
// mesh imports kvstate and policies; it must not import cmd or integration.
package mesh

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"net/http"
	"regexp"
	"sync"
	"sync/atomic"
	"time"

	"github.com/limitmesh/limitmesh/auth"
	"github.com/limitmesh/limitmesh/mesh/internal/journal"
	"github.com/limitmesh/limitmesh/mesh/internal/keys"
	"github.com/limitmesh/limitmesh/mesh/internal/ownership"
	"github.com/limitmesh/limitmesh/mesh/internal/policyset"
	"github.com/limitmesh/limitmesh/mesh/internal/route"
	"github.com/limitmesh/limitmesh/mesh/internal/rt"
	"github.com/limitmesh/limitmesh/mesh/internal/service"
	"github.com/limitmesh/limitmesh/policies"
	"github.com/limitmesh/limitmesh/shadow"
	"github.com/limitmesh/limitmesh/usage"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
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

// MetadataNode and MetadataRoles are the keys of the micro service's
// metadata (`nats micro info limitmesh`) that name the node (its id in the
// shards bucket) and its roles (Roles.String). Only nodes with RoleDecide
// run the service.
const (
	MetadataNode  = "node"
	MetadataRoles = "roles"
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
	MaxPartitions = ownership.MaxPartitions
	// DefaultCheckpointInterval is the default interval between
	// checkpoints of journalled records to the state bucket.
	DefaultCheckpointInterval = journal.DefaultCheckpointInterval
	// DefaultLocalMaxKeys is the most local-mode keys one node holds.
	DefaultLocalMaxKeys = keys.DefaultLocalMaxKeys
	// MaxRequestBytes is the largest decide request body (CONTRACT.md
	// §2); a larger one is a 413, checked before parsing.
	MaxRequestBytes = service.MaxRequestBytes
	// MaxRequestIDBytes is the longest request_id.
	MaxRequestIDBytes = service.MaxRequestIDBytes
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
	// StateTTL is how long limiter state that is at rest (a full bucket,
	// rolled-over windows) is kept after its last write; state that can
	// still change a decision is kept until it is at rest, however long
	// that is (CONTRACT §3, RetentionHorizon); default 1h.
	StateTTL time.Duration
	Logger   *slog.Logger // nil: discard
	Registry *prometheus.Registry
	Clock    func() time.Time // nil: time.Now
	// MaxConflicts bounds lost CAS writes per decision; default 8.
	MaxConflicts int
	// AsyncInterval is the write-behind interval of async-mode policies: a
	// key's unwritten changes are written at most this long after the first
	// of them (plus the duration of a write in flight); default
	// DefaultAsyncInterval (100ms). See OvershootBound.
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
	// checkpointed to the state bucket; default DefaultCheckpointInterval
	// (at most a quarter of StateTTL).
	CheckpointInterval time.Duration
	// NoJournal writes every state record to the state bucket (one
	// compare-and-swap per key and batch) instead of journalling them.
	NoJournal bool
	// NoUsage turns the usage stream off: no usage records, no ledger, no
	// shadow evaluation.
	NoUsage bool
	// UsageInterval is how often usage records are published (default
	// DefaultUsageInterval); UsageRetention and UsageMaxBytes bound the
	// usage stream a node creates (defaults DefaultUsageRetention,
	// DefaultUsageMaxBytes).
	UsageInterval  time.Duration
	UsageRetention time.Duration
	UsageMaxBytes  int64
	// Binder binds each request's tenant to its calling NATS account in a
	// secured deployment (CONTRACT §9); nil: unsecured, the
	// Nats-Request-Info header is ignored.
	Binder *auth.Binder
	// NodeID names the node in the shards bucket ([A-Za-z0-9_-], 1..64
	// bytes); default: random. It must be unique among running nodes; a
	// node restarted with the same id takes its old entries over at once.
	NodeID string
	// Roles are what the node does (CONTRACT.md §13); default (zero)
	// AllRoles. Without RoleDecide it owns no partition and takes no
	// request; without RoleLedger or RoleShadow it never runs the
	// reconciler or the shadow evaluator. A node with NoUsage must
	// have RoleDecide: the other roles read the usage stream.
	Roles Roles
}

// Headers of the routing protocol (docs/protocol.md, "Routing").
const (
	HopHeader      = service.HopHeader
	TimeoutHeader  = service.TimeoutHeader
	NotOwnerHeader = service.NotOwnerHeader
)

// PartitionQueue is the queue group of the nodes' subscriptions to a
// partition's subjects (decide and lease): a request sent there reaches
// one node even while two serve the hand-over of the partition.
const PartitionQueue = "limitmesh-partition"

var prefixRE = regexp.MustCompile(`^[a-z0-9][a-z0-9_-]{0,31}$`)

// Node is one limitmesh node. Start it once; Stop drains it. Its methods
// are safe for concurrent use.
//
// A node is the parts its roles share (base), its usage publisher, and,
// with RoleDecide, the decide role (decider, decide.go); Start wires them
// (start.go).
type Node struct {
	base

	pub *usage.Publisher // nil before Start and with NoUsage
	dec *decider         // nil before Start and without RoleDecide

	ready atomic.Bool

	mu      sync.Mutex
	started bool
	stopped bool
	cancel  context.CancelFunc
}

// base is what a node's roles share: the connection and settings, the
// policies in force, the partitions served, and the background work.
type base struct {
	nc  *nats.Conn
	cfg NodeConfig
	log *slog.Logger
	reg *prometheus.Registry
	rt  rt.Runtime

	policies *policyset.Set
	route    *route.Table
	bg       sync.WaitGroup // background work: ends after the cancel of Stop
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
	if cfg.AsyncInterval <= 0 {
		cfg.AsyncInterval = DefaultAsyncInterval
	}
	if cfg.UsageInterval <= 0 {
		cfg.UsageInterval = DefaultUsageInterval
	}
	if cfg.UsageRetention <= 0 {
		cfg.UsageRetention = DefaultUsageRetention
	}
	if cfg.UsageMaxBytes <= 0 {
		cfg.UsageMaxBytes = DefaultUsageMaxBytes
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
	if !ownership.NodeIDRE.MatchString(cfg.NodeID) {
		return nil, fmt.Errorf("%w: node id %q must match %s", ErrConfig, cfg.NodeID, ownership.NodeIDRE)
	}
	if cfg.Roles == 0 {
		cfg.Roles = AllRoles
	}
	switch {
	case cfg.Roles&^AllRoles != 0:
		return nil, fmt.Errorf("%w: unknown roles %#x", ErrConfig, uint8(cfg.Roles&^AllRoles))
	case cfg.NoUsage && !cfg.Roles.Has(RoleDecide):
		return nil, fmt.Errorf("%w: roles %s without the usage stream: a node that does not decide only reads the stream", ErrConfig, cfg.Roles)
	}
	n := &Node{base: base{nc: nc, cfg: cfg, log: cfg.Logger, reg: cfg.Registry, rt: rt.Real}}
	if n.log == nil {
		n.log = slog.New(slog.DiscardHandler)
	}
	if n.reg == nil {
		n.reg = prometheus.NewRegistry()
	}
	if cfg.Clock != nil {
		n.rt = clockRuntime{clock: cfg.Clock}
	}
	n.policies = policyset.New()
	n.route = route.New(cfg.Prefix, cfg.Partitions, n.rt, n.rt.Now())
	return n, nil
}

// clockRuntime is the real runtime with NodeConfig.Clock as its clock.
type clockRuntime struct{ clock func() time.Time }

func (c clockRuntime) Now() time.Time { return c.clock() }
func (clockRuntime) AfterFunc(d time.Duration, f func()) (stop func() bool) {
	return rt.Real.AfterFunc(d, f)
}
func (clockRuntime) Go(f func()) { go f() }

// The names of the node's buckets and of its decide subject (CONTRACT.md
// §1).
func (b *base) policyBucket() string  { return b.cfg.Prefix + "_policies" }
func (b *base) stateBucket() string   { return b.cfg.Prefix + "_state" }
func (b *base) shardBucket() string   { return b.cfg.Prefix + "_shards" }
func (b *base) decideSubject() string { return b.cfg.Prefix + ".v1.decide" }

// Owns reports whether the node serves partition p now, by its own clock:
// it holds p and its self-fence (2/3 of the lease after its last claim or
// renewal that landed) has not passed. Who holds a partition, and in which
// epoch, is in the shards bucket; that a node cut off from JetStream has
// stopped serving at its self-fence is visible only here (the bucket
// still names it, and limitmesh_owned_partitions counts the partitions
// it holds), so tests of a cut check it with Owns.
func (n *Node) Owns(p int) bool { return n.route.Serving(p) }

// Policy returns the version of policy name in force on this node, nil
// when there is none. The policy is shared: do not modify it.
func (n *Node) Policy(name string) *policies.Policy { return n.policies.Current(name) }

// Ready reports whether the node does what its roles say: serves
// decisions, with RoleDecide (false before Start returns and from the
// start of Stop).
func (n *Node) Ready() bool { return n.ready.Load() }

// Stop makes /readyz fail, stops taking requests (the service's
// subscription is drained), hands every partition over, waits for
// in-flight decisions to be answered (bounded by ctx) and stops the
// background work. It is safe to call more than once and after a failed
// Start.
func (n *Node) Stop(ctx context.Context) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.stopped {
		return nil
	}
	n.stopped = true
	n.ready.Store(false)
	var err error
	if n.dec != nil && n.dec.micro != nil {
		err = n.dec.leave(ctx)
	}
	// Every decision is answered: publish their usage before the ledger
	// and the evaluator stop.
	if n.pub != nil {
		if perr := n.pub.Close(ctx); perr != nil {
			n.log.Warn("usage records not published before the stop", "records", n.pub.Held(), "error", perr.Error())
		}
	}
	if n.cancel != nil {
		n.cancel()
	}
	n.bg.Wait()
	if n.dec != nil {
		n.dec.close()
	}
	return err
}

// HTTPHandler serves GET /metrics (Prometheus), /healthz (200 while the
// process runs) and /readyz (200 once the node serves, 503 before and
// while it drains).
func (n *Node) HTTPHandler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(n.reg, promhttp.HandlerOpts{Registry: n.reg}))
	if !n.cfg.NoUsage {
		if js, err := jetstream.New(n.nc); err == nil {
			d := shadow.NewDashboard(js, shadow.DashboardConfig{Prefix: n.cfg.Prefix, Logger: n.log})
			mux.Handle("GET /shadow", d)
			mux.Handle("GET /shadow/", d)
		}
	}
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

// ReadStateRecord returns the latest durable record of a limit key in the
// installation with subject prefix prefix, by the rule the key's next
// owner adopts with (docs/protocol.md): the journals its partition's entry
// names, from their marks, else the state bucket's; an error wrapping
// kvstate.ErrNotFound when there is none. For diagnostics and tests.
func ReadStateRecord(ctx context.Context, js jetstream.JetStream, prefix, key string) ([]byte, error) {
	return journal.ReadStateRecord(ctx, js, prefix, key)
}
