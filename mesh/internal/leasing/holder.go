package leasing

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"slices"
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

// retryEvery is how often a request to a partition's owner is sent again
// while no node serves the partition (no responders, or not_owner).
const retryEvery = 3 * time.Millisecond

// Holder is a node's holder side of leased mode: one pool of grants
// (lease.Pool) per leased key this node decides for, asked for from the
// key's owner. Plain decisions spend from it (Spend); the Gateway has
// sub-grants carved from it (carve) and reported back (subReport); every
// tick (Start) it reports, returns and asks for grants; Return gives every
// grant back. Instants are the holder's monotonic clock (ns since New,
// plus one).
//
// It reaches time and the owners only through its Runtime and Requester:
// no call blocks, every request to an owner continues in a callback, and
// the requests one call sends go out in an order fixed by its input (keys
// in order), so the simulation replays it exactly. Its methods are safe
// for concurrent use.
type Holder struct {
	requests rt.Requester
	prefix   string
	self     string
	rt       rt.Runtime
	timeout  time.Duration
	log      *slog.Logger
	m        *metrics
	base     time.Time // origin of the monotonic clock

	mu      sync.RWMutex
	entries map[string]*entry // pools by limit key
	subs    map[uint64]*entry // sub-grants out, by id: the pool each came from
	seq     atomic.Uint64     // sub-grant ids
	// stopping is set (under mu) by Return; from then on no pool is made,
	// no tick works, and a grant that arrives is returned at once.
	stopping atomic.Bool

	fmu    sync.Mutex
	flight int      // requests to owners in flight
	idle   []func() // called when flight drops to 0 (Return)
}

func newHolder(cfg Config, m *metrics) *Holder {
	h := &Holder{requests: cfg.Requests, prefix: cfg.Prefix, self: cfg.Self, rt: cfg.Runtime, timeout: cfg.Timeout,
		log: cfg.Log, m: m, base: cfg.Runtime.Now(),
		entries: make(map[string]*entry), subs: make(map[uint64]*entry)}
	if h.requests == nil {
		h.requests = rt.NATS(cfg.Conn)
	}
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
	e, stopping := h.entries[key], h.stopping.Load()
	h.mu.RUnlock()
	if stopping {
		return nil
	}
	if e == nil {
		h.mu.Lock()
		if h.stopping.Load() {
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

// startAcquire asks e's owner for a grant of want micro-units (at least
// least, at least one micro-unit) and puts the answer in e's pool; e.done
// is set (and closed once the answer is in). A grant that arrives once
// the holder stops is returned at once.
func (h *Holder) startAcquire(e *entry, want, least int64) {
	e.mu.Lock()
	p := e.p
	e.mu.Unlock()
	sent := h.now()
	req := ownerRequest{Op: opAcquire, Policy: p.Name, Key: e.key, Holder: h.self, Want: want, Min: max(least, 1)}
	h.ask(e.part, req, func(r reply, err error) {
		now := h.now()
		e.mu.Lock()
		applyAcquire(e.pool, sent, now, r, err)
		var late []lease.Held
		if h.stopping.Load() {
			late = e.pool.Drain()
		}
		if e.done != nil {
			close(e.done)
			e.done = nil
		}
		e.mu.Unlock()
		for _, g := range late {
			h.sendReport(e, g, true)
		}
	})
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

// ask sends req to the owner of partition part and calls done with its
// reply, sending it again every retryEvery while no node serves the
// partition (a move, a dead owner before its lease ran out), until the
// timeout (then err is context.DeadlineExceeded). The request counts as
// in flight until done returns.
func (h *Holder) ask(part int, req ownerRequest, done func(reply, error)) {
	body, _ := json.Marshal(req)
	subject := OwnerSubject(h.prefix, part)
	deadline := h.rt.Now().Add(h.timeout)
	h.begin()
	finish := func(r reply, err error) {
		done(r, err)
		h.end()
	}
	var try func()
	try = func() {
		h.requests.Request(&nats.Msg{Subject: subject, Data: body}, deadline, func(m *nats.Msg, err error) {
			var r reply
			switch {
			case err == nil:
				if jerr := json.Unmarshal(m.Data, &r); jerr != nil {
					finish(r, jerr)
					return
				}
				if r.Result != resNotOwner {
					finish(r, nil)
					return
				}
			case !errors.Is(err, nats.ErrNoResponders):
				finish(r, err)
				return
			}
			left := deadline.Sub(h.rt.Now())
			if left <= 0 {
				finish(r, context.DeadlineExceeded)
				return
			}
			h.rt.AfterFunc(min(retryEvery, left), func() {
				if !h.rt.Now().Before(deadline) {
					finish(r, context.DeadlineExceeded)
					return
				}
				try()
			})
		})
	}
	try()
}

// begin counts a request to an owner in flight.
func (h *Holder) begin() {
	h.fmu.Lock()
	h.flight++
	h.fmu.Unlock()
}

// end counts a request to an owner done, calling what waits for none to
// be in flight when it was the last.
func (h *Holder) end() {
	h.fmu.Lock()
	h.flight--
	var idle []func()
	if h.flight == 0 {
		idle, h.idle = h.idle, nil
	}
	h.fmu.Unlock()
	for _, f := range idle {
		f()
	}
}

// sendReport reports held's use to its owner, or returns it (ret); a
// refusal of a report marks the grant stale (spent to its deadline, not
// reported again).
func (h *Holder) sendReport(e *entry, held lease.Held, ret bool) {
	e.mu.Lock()
	p := e.p
	e.mu.Unlock()
	op := opReport
	if ret {
		op = opReturn
	}
	h.ask(e.part, ownerRequest{Op: op, Policy: p.Name, Key: e.key, Grant: held.ID, Epoch: held.Epoch, Spent: held.Used}, func(r reply, err error) {
		if err != nil {
			h.log.Debug("lease report failed", "key", e.key, "op", op, "error", err.Error())
			return
		}
		if r.Result != resOK && !ret {
			e.mu.Lock()
			e.pool.MarkStale(held.ID, held.Epoch)
			e.mu.Unlock()
		}
	})
}

// Start looks at every pool each tick (10 ms) on the Runtime's timers,
// until stop is called or the holder stops (Return); call it once.
// Grants whose deadline passed or that stayed unused are returned,
// changed ones reported, and a pool in use under half a grant asks for
// the next.
func (h *Holder) Start() (stop func()) {
	var mu sync.Mutex
	stopped := false
	var cancel func() bool
	var next func()
	next = func() {
		if !h.sweep(h.now()) {
			return
		}
		mu.Lock()
		if !stopped {
			cancel = h.rt.AfterFunc(tick, next)
		}
		mu.Unlock()
	}
	mu.Lock()
	cancel = h.rt.AfterFunc(tick, next)
	mu.Unlock()
	return func() {
		mu.Lock()
		stopped = true
		cancel()
		mu.Unlock()
	}
}

// Run does the holder's ticks (Start) until ctx ends.
func (h *Holder) Run(ctx context.Context) {
	stop := h.Start()
	<-ctx.Done()
	stop()
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

// sweep does the work due at now on every pool, in key order (Start);
// false when the holder stops (nothing done).
func (h *Holder) sweep(now int64) bool {
	h.mu.RLock()
	es := h.sorted()
	stopping := h.stopping.Load()
	h.mu.RUnlock()
	if stopping {
		return false
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
			h.sendReport(e, held, true)
		}
		for _, held := range c.reports {
			h.sendReport(e, held, false)
		}
		if c.idle {
			gone = append(gone, e)
		}
	}
	if len(gone) == 0 && len(ended) == 0 {
		return true
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
	return true
}

// sorted returns the pools in key order, the order their requests go
// out in; h.mu held.
func (h *Holder) sorted() []*entry {
	es := make([]*entry, 0, len(h.entries))
	for _, e := range h.entries {
		es = append(es, e)
	}
	slices.SortFunc(es, func(a, b *entry) int { return cmp.Compare(a.key, b.key) })
	return es
}

// Return stops the holder and gives every grant it holds back to its
// key's owner (their units go back to the keys), in key order; from then
// on every leased request is decided by its owner (Spend and carve
// decline) and the ticks end. done is called once, never before Return
// returns, when no request to an owner is in flight any more: every
// return answered or timed out (each is bounded by the timeout), as well
// as the acquires and reports sent before (a grant an acquire brings
// back is returned first).
func (h *Holder) Return(done func()) {
	h.mu.Lock()
	h.stopping.Store(true)
	es := h.sorted()
	h.mu.Unlock()
	h.begin()
	for _, e := range es {
		e.mu.Lock()
		held := e.pool.Drain()
		e.mu.Unlock()
		for _, g := range held {
			h.sendReport(e, g, true)
		}
	}
	h.fmu.Lock()
	last := h.flight == 1
	if !last {
		h.idle = append(h.idle, done)
	}
	h.fmu.Unlock()
	h.end()
	if last {
		h.rt.Go(done)
	}
}

// Stop returns every grant held (Return), waiting until every request to
// an owner is answered or timed out, or ctx ends.
func (h *Holder) Stop(ctx context.Context) {
	done := make(chan struct{})
	h.Return(func() { close(done) })
	select {
	case <-done:
	case <-ctx.Done():
	}
}
