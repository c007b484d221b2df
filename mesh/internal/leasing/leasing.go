// Package leasing is a node's part in leased mode (CONTRACT §8,
// docs/protocol.md "Leased mode"), the I/O around the pure core in package
// lease:
//
//   - as a key's owner (owner.go), it applies the grant requests, reports
//     and returns of holder nodes, received on <prefix>.v1.lease.shard.<n>
//     for the partitions it serves, through the key's owner core (keys), so
//     every grant is written to the key's record before it is answered;
//   - as a holder (holder.go), it keeps a pool of grants per leased key it
//     decides for, asked for from the key's owner, spends them for the
//     plain decide requests it receives (Spend), reports their use and
//     returns them;
//   - for the gateways of its region (gateway.go), it carves sub-grants
//     from its pools on <prefix>.v1.lease (a queue group: NATS prefers the
//     subscribers of the requester's own cluster, so a gateway is served by
//     its region's nodes) and takes their reports and returns on
//     <prefix>.v1.lease.node.<node id>.
//
// leasing imports lease, keys, keyrec, policies, policyset, route, rt and
// ownership; the node (package mesh) wires it.
package leasing

import (
	"context"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/limitmesh/limitmesh/mesh/internal/keys"
	"github.com/limitmesh/limitmesh/mesh/internal/policyset"
	"github.com/limitmesh/limitmesh/mesh/internal/route"
	"github.com/limitmesh/limitmesh/mesh/internal/rt"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
)

// Config configures a node's Leasing.
type Config struct {
	Conn     *nats.Conn
	Prefix   string
	Self     string // this node's id: its holder name at owners
	Policies *policyset.Set
	Keys     *keys.Table
	Route    *route.Table
	Runtime  rt.Runtime
	// Timeout bounds a request to an owner and a gateway's acquire (the
	// node's decision timeout).
	Timeout    time.Duration
	Log        *slog.Logger
	Registerer prometheus.Registerer // nil: metrics are not registered
}

// tick is how often the pools' reports, returns and prefetches are looked
// at; a quarter of the shortest ttl (100 ms) is 25 ms.
const tick = 10 * time.Millisecond

// Leasing is a node's owner, holder and gateway sides of leased mode. Its
// methods are safe for concurrent use.
type Leasing struct {
	cfg  Config
	log  *slog.Logger
	m    *metrics
	base time.Time // origin of the holder's monotonic clock

	mu       sync.RWMutex
	entries  map[string]*entry // pools by limit key
	subs     map[uint64]*entry // sub-grants out, by id
	seq      atomic.Uint64     // sub-grant ids
	stopping bool

	bg sync.WaitGroup // requests to owners in flight
}

// New returns a node's Leasing; nothing runs before Run.
func New(cfg Config) (*Leasing, error) {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 500 * time.Millisecond
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	l := &Leasing{cfg: cfg, log: cfg.Log, m: m, base: cfg.Runtime.Now(),
		entries: make(map[string]*entry), subs: make(map[uint64]*entry)}
	// Sub-grant ids start at a per-process base, so the ids of a node
	// that restarted do not name its earlier sub-grants.
	l.seq.Store(uint64(l.base.UnixNano()) << 8)
	return l, nil
}

// OwnerSubject returns <prefix>.v1.lease.shard.<p>: partition p's owner
// answers holder nodes there.
func OwnerSubject(prefix string, p int) string { return prefix + ".v1.lease.shard." + strconv.Itoa(p) }

// GatewaySubject returns <prefix>.v1.lease: gateways ask for grants there.
func GatewaySubject(prefix string) string { return prefix + ".v1.lease" }

// NodeSubject returns <prefix>.v1.lease.node.<id>: gateways report and
// return their sub-grants to the node that made them there.
func NodeSubject(prefix, id string) string { return prefix + ".v1.lease.node." + id }

// mono is the holder's monotonic clock at t (ns).
func (l *Leasing) mono(t time.Time) int64 { return int64(t.Sub(l.base)) + 1 }

// Run looks at every pool each tick until ctx ends: grants whose deadline
// passed or that stayed unused are returned, changed ones reported, and a
// pool in use under half a grant asks for the next.
func (l *Leasing) Run(ctx context.Context) {
	tk := time.NewTicker(tick)
	defer tk.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tk.C:
			l.sweep()
		}
	}
}

// Stop returns every grant held (their units go back to the keys), bounded
// by ctx; from then on every leased request is decided by its owner.
func (l *Leasing) Stop(ctx context.Context) {
	l.mu.Lock()
	l.stopping = true
	es := make([]*entry, 0, len(l.entries))
	for _, e := range l.entries {
		es = append(es, e)
	}
	l.mu.Unlock()
	var wg sync.WaitGroup
	for _, e := range es {
		e.mu.Lock()
		held := e.pool.Drain()
		e.mu.Unlock()
		for _, h := range held {
			wg.Go(func() { l.sendReport(ctx, e, h, true) })
		}
	}
	wg.Wait()
	done := make(chan struct{})
	go func() { l.bg.Wait(); close(done) }()
	select {
	case <-done:
	case <-ctx.Done():
	}
}
