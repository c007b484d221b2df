package leasing

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/lease"
	"github.com/limitmesh/limitmesh/mesh/internal/rt"
	"github.com/limitmesh/limitmesh/policies"
	"github.com/nats-io/nats.go"
)

// tick is how often the pools' reports, returns and prefetches are looked
// at; a quarter of the shortest ttl (100 ms) is 25 ms.
const tick = 10 * time.Millisecond

// Holder is a node's holder side of leased mode: one pool of grants
// (lease.Pool) per leased key this node decides for, asked for from the
// key's owner. Plain decisions spend from it (Spend); the Gateway has
// sub-grants carved from it (carve) and reported back (subReport); every
// tick Run reports, returns and asks for grants. Instants are the
// holder's monotonic clock (ns since New, plus one). Its methods are safe
// for concurrent use.
type Holder struct {
	conn    *nats.Conn
	prefix  string
	self    string
	rt      rt.Runtime
	timeout time.Duration
	log     *slog.Logger
	m       *metrics
	base    time.Time // origin of the monotonic clock

	mu       sync.RWMutex
	entries  map[string]*entry // pools by limit key
	subs     map[uint64]*entry // sub-grants out, by id: the pool each came from
	seq      atomic.Uint64     // sub-grant ids
	stopping bool

	bg sync.WaitGroup // requests to owners in flight
}

func newHolder(cfg Config, m *metrics) *Holder {
	h := &Holder{conn: cfg.Conn, prefix: cfg.Prefix, self: cfg.Self, rt: cfg.Runtime, timeout: cfg.Timeout,
		log: cfg.Log, m: m, base: cfg.Runtime.Now(),
		entries: make(map[string]*entry), subs: make(map[uint64]*entry)}
	// Sub-grant ids start at a per-process base, so the ids of a node
	// that restarted do not name its earlier sub-grants.
	h.seq.Store(uint64(h.base.UnixNano()) << 8)
	return h
}

// entry is one key's pool.
type entry struct {
	key  string
	part int

	mu   sync.Mutex
	pool *lease.Pool
	p    *policies.Policy // the version the pool's params come from
	dead bool             // removed from the holder's entries: look it up again
	// done is closed when the acquire in flight ends (nil when none).
	done chan struct{}
}

// mono is the holder's monotonic clock at t (ns).
func (h *Holder) mono(t time.Time) int64 { return int64(t.Sub(h.base)) + 1 }

// now is the holder's monotonic clock now (ns).
func (h *Holder) now() int64 { return rt.Mono(h.rt, h.base) }

// entry returns key's pool entry, made for p when missing, locked; nil
// while the node stops.
func (h *Holder) entry(p *policies.Policy, key string, part int) *entry {
	for {
		e := h.lookup(p, key, part)
		if e == nil {
			return nil
		}
		e.mu.Lock()
		if !e.dead {
			return e // locked
		}
		e.mu.Unlock()
	}
}

// lookup returns key's entry, made when missing (not locked).
func (h *Holder) lookup(p *policies.Policy, key string, part int) *entry {
	h.mu.RLock()
	e, stopping := h.entries[key], h.stopping
	h.mu.RUnlock()
	if stopping {
		return nil
	}
	if e == nil {
		h.mu.Lock()
		if h.stopping {
			h.mu.Unlock()
			return nil
		}
		if e = h.entries[key]; e == nil {
			e = &entry{key: key, part: part, pool: lease.NewPool(lease.ParamsOf(p.Lease), h.nextID), p: p}
			h.entries[key] = e
		}
		h.mu.Unlock()
	}
	return e
}

// follow brings e's params to p when p is a newer revision; e.mu held.
func (e *entry) follow(p *policies.Policy) {
	if p != e.p && p.Revision > e.p.Revision && p.Mode == policies.ModeLeased {
		e.p = p
		e.pool.SetParams(lease.ParamsOf(p.Lease))
	}
}

func (h *Holder) nextID() uint64 { return h.seq.Add(1) }

// Spend decides a request of cost micro-units of leased policy p for key
// (in partition part) at now from this node's grants. ok is false when it
// cannot (no grant holds the cost, or the node stops): the caller decides
// at the key's owner, and the pool asks for a grant meanwhile. A decision
// from the grants has Remaining = what the grant spent holds after it
// (not the key's) and ResetAfter 0; a denial here (the owner said the
// key's limits lack the units) has the owner's RetryAfter, less the time
// since.
func (h *Holder) Spend(p *policies.Policy, key string, part int, cost int64, now time.Time) (keyrec.Decision, bool) {
	e := h.entry(p, key, part)
	if e == nil {
		return keyrec.Decision{}, false
	}
	mono := h.mono(now)
	e.follow(p)
	r, left, retry := e.pool.Spend(mono, cost)
	want, ask := e.pool.WantAcquire(mono)
	if ask {
		e.done = make(chan struct{})
	}
	e.mu.Unlock()
	if ask {
		h.startAcquire(e, want, min(cost, want))
	}
	d, ok := spendDecision(p, r, left, retry)
	switch {
	case ok && d.Allowed:
		h.m.local.WithLabelValues(p.Name, "allowed").Inc()
	case ok:
		h.m.local.WithLabelValues(p.Name, "denied").Inc()
	}
	return d, ok
}

// spendDecision is the decision of a spend from a pool that came out as r
// (lease.Pool.Spend): allowed with what the grant holds after it, denied
// for retry ns (the owner's exhausted answer, less the time since), or
// none (ok false: decide at the owner).
func spendDecision(p *policies.Policy, r lease.SpendResult, left, retry int64) (keyrec.Decision, bool) {
	d := keyrec.Decision{Policy: p.Name, Revision: p.Revision}
	switch r {
	case lease.Spent:
		d.Allowed, d.Remaining = true, left
		return d, true
	case lease.Denied:
		d.RetryAfter = retry
		return d, true
	}
	return keyrec.Decision{}, false
}

// startAcquire asks the key's owner for a grant of want micro-units (at
// least least) in the background; e.done is set.
func (h *Holder) startAcquire(e *entry, want, least int64) {
	h.bg.Go(func() { h.acquire(e, want, max(least, 1)) })
}

// acquire asks e's owner for a grant and puts the answer in e's pool.
func (h *Holder) acquire(e *entry, want, least int64) {
	e.mu.Lock()
	p := e.p
	e.mu.Unlock()
	sent := h.now()
	ctx, cancel := context.WithTimeout(context.Background(), h.timeout)
	r, err := h.ask(ctx, e.part, ownerRequest{Op: opAcquire, Policy: p.Name, Key: e.key, Holder: h.self, Want: want, Min: least})
	cancel()
	now := h.now()
	e.mu.Lock()
	applyAcquire(e.pool, sent, now, r, err)
	if e.done != nil {
		close(e.done)
		e.done = nil
	}
	e.mu.Unlock()
}

// applyAcquire puts the owner's answer r (or the failure err) to an
// acquire sent at sent, known at now, in pl. A grant is spent until its
// deadline counted from sent, the holder's own instant of asking, less
// the skew margin (L4): however late the answer came, and whatever the
// owner's clock read. Exhausted denies the key here for the owner's
// retry time; full, another answer or none sends the key's requests to
// the owner for a while (lease.Pool.Refused).
func applyAcquire(pl *lease.Pool, sent, now int64, r reply, err error) {
	switch {
	case err != nil:
		pl.Refused(now, 0, 0)
	case r.Result == resGranted && r.Units > 0 && r.TTL > 0:
		pl.Granted(sent, r.Grant, r.Epoch, r.Units, r.TTL)
	case r.Result == resExhausted:
		pl.Refused(now, lease.Exhausted, r.RetryAfter)
	case r.Result == resFull:
		pl.Refused(now, lease.Full, r.RetryAfter)
	default: // not_leased, unavailable
		pl.Refused(now, 0, 0)
	}
}

// ask sends req to the owner of partition part and returns its reply,
// retrying while no node serves the partition (a move, a dead owner before
// its lease ran out) until ctx ends.
func (h *Holder) ask(ctx context.Context, part int, req ownerRequest) (reply, error) {
	body, _ := json.Marshal(req)
	subject := OwnerSubject(h.prefix, part)
	for {
		m, err := h.conn.RequestWithContext(ctx, subject, body)
		var r reply
		switch {
		case err == nil:
			if jerr := json.Unmarshal(m.Data, &r); jerr != nil {
				return r, jerr
			}
			if r.Result != resNotOwner {
				return r, nil
			}
		case !errors.Is(err, nats.ErrNoResponders):
			return r, err
		}
		select {
		case <-ctx.Done():
			return r, ctx.Err()
		case <-time.After(3 * time.Millisecond):
		}
	}
}

// sendReport reports held's use to its owner, or returns it (ret); a
// refusal of a report marks the grant stale (spent to its deadline, not
// reported again).
func (h *Holder) sendReport(ctx context.Context, e *entry, held lease.Held, ret bool) {
	e.mu.Lock()
	p := e.p
	e.mu.Unlock()
	op := opReport
	if ret {
		op = opReturn
	}
	ctx, cancel := context.WithTimeout(ctx, h.timeout)
	defer cancel()
	r, err := h.ask(ctx, e.part, ownerRequest{Op: op, Policy: p.Name, Key: e.key, Grant: held.ID, Epoch: held.Epoch, Spent: held.Used})
	if err != nil {
		h.log.Debug("lease report failed", "key", e.key, "op", op, "error", err.Error())
		return
	}
	if r.Result != resOK && !ret {
		e.mu.Lock()
		e.pool.MarkStale(held.ID, held.Epoch)
		e.mu.Unlock()
	}
}

// Run looks at every pool each tick until ctx ends: grants whose deadline
// passed or that stayed unused are returned, changed ones reported, and a
// pool in use under half a grant asks for the next.
func (h *Holder) Run(ctx context.Context) {
	tk := time.NewTicker(tick)
	defer tk.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tk.C:
			h.sweep(h.now())
		}
	}
}

// chores is one tick's work on a pool.
type chores struct {
	returns, reports []lease.Held // to send to the owner
	ended            []uint64     // sub-grants that ended: forget them
	acquire          int64        // > 0: ask the owner for a grant of that many micro-units
	idle             bool         // the pool holds and asks nothing and was unused for a ttl: forget it
}

// choresAt is the work due at now on pl: what lease.Pool.Due hands back,
// an acquire when the pool is in use and low (asking for at least a unit),
// and whether the pool may be forgotten. pl is marked acquiring when an
// acquire is due.
func choresAt(pl *lease.Pool, now int64) chores {
	var c chores
	c.returns, c.reports, c.ended = pl.Due(now)
	if want, ask := pl.WantAcquire(now); ask {
		c.acquire = want
	}
	c.idle = pl.Idle() && now-pl.LastUse() > pl.Params().TTL
	return c
}

// sweep does the work due at now on every pool (Run).
func (h *Holder) sweep(now int64) {
	h.mu.RLock()
	es := make([]*entry, 0, len(h.entries))
	for _, e := range h.entries {
		es = append(es, e)
	}
	stopping := h.stopping
	h.mu.RUnlock()
	if stopping {
		return
	}
	var gone []*entry
	var ended []uint64
	for _, e := range es {
		e.mu.Lock()
		c := choresAt(e.pool, now)
		if c.acquire > 0 {
			e.done = make(chan struct{})
		}
		e.mu.Unlock()
		ended = append(ended, c.ended...)
		if c.acquire > 0 {
			h.startAcquire(e, c.acquire, min(c.acquire, kvstate.Unit))
		}
		for _, held := range c.returns {
			h.bg.Go(func() { h.sendReport(context.Background(), e, held, true) })
		}
		for _, held := range c.reports {
			h.bg.Go(func() { h.sendReport(context.Background(), e, held, false) })
		}
		if c.idle {
			gone = append(gone, e)
		}
	}
	if len(gone) == 0 && len(ended) == 0 {
		return
	}
	h.mu.Lock()
	for _, id := range ended {
		delete(h.subs, id)
	}
	for _, e := range gone {
		e.mu.Lock()
		if e.pool.Idle() && h.entries[e.key] == e {
			delete(h.entries, e.key)
			e.dead = true
		}
		e.mu.Unlock()
	}
	h.mu.Unlock()
}

// Stop returns every grant held (their units go back to the keys), bounded
// by ctx; from then on every leased request is decided by its owner.
func (h *Holder) Stop(ctx context.Context) {
	h.mu.Lock()
	h.stopping = true
	es := make([]*entry, 0, len(h.entries))
	for _, e := range h.entries {
		es = append(es, e)
	}
	h.mu.Unlock()
	var wg sync.WaitGroup
	for _, e := range es {
		e.mu.Lock()
		held := e.pool.Drain()
		e.mu.Unlock()
		for _, g := range held {
			wg.Go(func() { h.sendReport(ctx, e, g, true) })
		}
	}
	wg.Wait()
	done := make(chan struct{})
	go func() { h.bg.Wait(); close(done) }()
	select {
	case <-done:
	case <-ctx.Done():
	}
}
