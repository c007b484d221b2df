package leasing

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/lease"
	"github.com/limitmesh/limitmesh/policies"
	"github.com/nats-io/nats.go"
)

// The holder side: one pool of grants per leased key this node decides
// for. Plain decisions spend from it; gateways' sub-grants are carved from
// it; the sweep reports, returns and asks for grants.

// entry is one key's pool.
type entry struct {
	key  string
	part int

	mu   sync.Mutex
	pool *lease.Pool
	p    *policies.Policy // the version the pool's params come from
	dead bool             // removed from the node's entries: look it up again
	// done is closed when the acquire in flight ends (nil when none).
	done chan struct{}
}

// entry returns key's pool entry, made for p when missing, locked; nil
// while the node stops.
func (l *Leasing) entry(p *policies.Policy, key string, part int) *entry {
	for {
		e := l.lookup(p, key, part)
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
func (l *Leasing) lookup(p *policies.Policy, key string, part int) *entry {
	l.mu.RLock()
	e, stopping := l.entries[key], l.stopping
	l.mu.RUnlock()
	if stopping {
		return nil
	}
	if e == nil {
		l.mu.Lock()
		if l.stopping {
			l.mu.Unlock()
			return nil
		}
		if e = l.entries[key]; e == nil {
			e = &entry{key: key, part: part, pool: lease.NewPool(lease.ParamsOf(p.Lease), l.nextID), p: p}
			l.entries[key] = e
		}
		l.mu.Unlock()
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

// Spend decides a request of cost micro-units of leased policy p for key
// (in partition part) at now from this node's grants. ok is false when it
// cannot (no grant holds the cost, or the node stops): the caller decides
// at the key's owner, and the pool asks for a grant meanwhile. A decision
// from the grants has Remaining = what the grant spent holds after it
// (not the key's) and ResetAfter 0; a denial here (the owner said the
// key's limits lack the units) has the owner's RetryAfter, less the time
// since.
func (l *Leasing) Spend(p *policies.Policy, key string, part int, cost int64, now time.Time) (keyrec.Decision, bool) {
	e := l.entry(p, key, part)
	if e == nil {
		return keyrec.Decision{}, false
	}
	mono := l.mono(now)
	e.follow(p)
	r, left, retry := e.pool.Spend(mono, cost)
	want, ask := e.pool.WantAcquire(mono)
	if ask {
		e.done = make(chan struct{})
	}
	e.mu.Unlock()
	if ask {
		l.startAcquire(e, want, min(cost, want))
	}
	d := keyrec.Decision{Policy: p.Name, Revision: p.Revision}
	switch r {
	case lease.Spent:
		d.Allowed, d.Remaining = true, left
		l.m.local.WithLabelValues(p.Name, "allowed").Inc()
		return d, true
	case lease.Denied:
		d.RetryAfter = retry
		l.m.local.WithLabelValues(p.Name, "denied").Inc()
		return d, true
	}
	return keyrec.Decision{}, false
}

func (l *Leasing) nextID() uint64 { return l.seq.Add(1) }

// startAcquire asks the key's owner for a grant of want micro-units (at
// least least) in the background; e.done is set.
func (l *Leasing) startAcquire(e *entry, want, least int64) {
	l.bg.Go(func() { l.acquire(e, want, max(least, 1)) })
}

// acquire asks e's owner for a grant and puts the answer in e's pool.
func (l *Leasing) acquire(e *entry, want, least int64) {
	e.mu.Lock()
	p := e.p
	e.mu.Unlock()
	sent := l.mono(l.cfg.Runtime.Now())
	ctx, cancel := context.WithTimeout(context.Background(), l.cfg.Timeout)
	r, err := l.ask(ctx, e.part, ownerRequest{Op: opAcquire, Policy: p.Name, Key: e.key, Holder: l.cfg.Self, Want: want, Min: least})
	cancel()
	now := l.mono(l.cfg.Runtime.Now())
	e.mu.Lock()
	switch {
	case err != nil:
		e.pool.Refused(now, 0, 0)
	case r.Result == resGranted && r.Units > 0 && r.TTL > 0:
		e.pool.Granted(sent, r.Grant, r.Epoch, r.Units, r.TTL)
	case r.Result == resExhausted:
		e.pool.Refused(now, lease.Exhausted, r.RetryAfter)
	case r.Result == resFull:
		e.pool.Refused(now, lease.Full, r.RetryAfter)
	default: // not_leased, unavailable
		e.pool.Refused(now, 0, 0)
	}
	if e.done != nil {
		close(e.done)
		e.done = nil
	}
	e.mu.Unlock()
}

// ask sends req to the owner of partition part and returns its reply,
// retrying while no node serves the partition (a move, a dead owner before
// its lease ran out) until ctx ends.
func (l *Leasing) ask(ctx context.Context, part int, req ownerRequest) (reply, error) {
	body, _ := json.Marshal(req)
	subject := OwnerSubject(l.cfg.Prefix, part)
	for {
		m, err := l.cfg.Conn.RequestWithContext(ctx, subject, body)
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

// sendReport reports h's use to its owner, or returns it (ret); a refusal
// of a report marks the grant stale (spent to its deadline, not reported
// again).
func (l *Leasing) sendReport(ctx context.Context, e *entry, h lease.Held, ret bool) {
	e.mu.Lock()
	p := e.p
	e.mu.Unlock()
	op := opReport
	if ret {
		op = opReturn
	}
	ctx, cancel := context.WithTimeout(ctx, l.cfg.Timeout)
	defer cancel()
	r, err := l.ask(ctx, e.part, ownerRequest{Op: op, Policy: p.Name, Key: e.key, Grant: h.ID, Epoch: h.Epoch, Spent: h.Used})
	if err != nil {
		l.log.Debug("lease report failed", "key", e.key, "op", op, "error", err.Error())
		return
	}
	if r.Result != resOK && !ret {
		e.mu.Lock()
		e.pool.MarkStale(h.ID, h.Epoch)
		e.mu.Unlock()
	}
}

// sweep does one tick's work on every pool (Run).
func (l *Leasing) sweep() {
	now := l.mono(l.cfg.Runtime.Now())
	l.mu.RLock()
	es := make([]*entry, 0, len(l.entries))
	for _, e := range l.entries {
		es = append(es, e)
	}
	stopping := l.stopping
	l.mu.RUnlock()
	if stopping {
		return
	}
	var gone []*entry
	var ended []uint64
	for _, e := range es {
		e.mu.Lock()
		rets, reps, end := e.pool.Due(now)
		ended = append(ended, end...)
		want, ask := e.pool.WantAcquire(now)
		if ask {
			e.done = make(chan struct{})
		}
		idle := e.pool.Idle() && now-e.pool.LastUse() > e.pool.Params().TTL
		e.mu.Unlock()
		if ask {
			l.startAcquire(e, want, min(want, kvstate.Unit))
		}
		for _, h := range rets {
			l.bg.Go(func() { l.sendReport(context.Background(), e, h, true) })
		}
		for _, h := range reps {
			l.bg.Go(func() { l.sendReport(context.Background(), e, h, false) })
		}
		if idle {
			gone = append(gone, e)
		}
	}
	if len(gone) == 0 && len(ended) == 0 {
		return
	}
	l.mu.Lock()
	for _, id := range ended {
		delete(l.subs, id)
	}
	for _, e := range gone {
		e.mu.Lock()
		if e.pool.Idle() && l.entries[e.key] == e {
			delete(l.entries, e.key)
			e.dead = true
		}
		e.mu.Unlock()
	}
	l.mu.Unlock()
}
