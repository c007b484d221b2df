package leasing

import (
	"errors"

	"github.com/limitmesh/limitmesh/mesh/internal/lease"
	"github.com/limitmesh/limitmesh/policies"
)

// The Holder's sub-grants: carved from its pools for the Gateway, each
// registered under its id (unique on the node) with the pool it came from,
// so the gateway's reports and returns reach that pool. What a sub-grant
// holds counts as used in its grant until it is returned, and ends when
// its grant does (lease.Pool).

// carveStep is the outcome of one attempt to carve a sub-grant.
type carveStep struct {
	result string    // resGranted, resExhausted, resRemote; "": wait for the acquire in flight
	sub    lease.Sub // resGranted
	ttl    int64     // resGranted: ns left of the sub-grant (its grant's)
	retry  int64     // resExhausted: ns until the owner's refusal runs out
	ask    int64     // > 0: start an acquire of that many micro-units, then wait for it
}

// carveOnce tries at now to carve a sub-grant for holder of up to want
// micro-units, at least least, from pl: from a held grant when one fits;
// else exhausted while the owner said the key's limits lack the units;
// remote while the owner's last refusal (full, no answer) holds, or when
// grants are held but none fits and holding more is not called for; else
// wait for an acquire (asked for here, or in flight).
func carveOnce(pl *lease.Pool, now int64, holder string, want, least int64) carveStep {
	if sub, ok := pl.Carve(now, holder, want, least); ok {
		return carveStep{result: resGranted, sub: sub, ttl: sub.Deadline - now}
	}
	if res, retry := pl.Refusal(now); res == lease.Denied {
		return carveStep{result: resExhausted, retry: retry}
	}
	if pl.Backoff(now) {
		return carveStep{result: resRemote}
	}
	if w, ask := pl.WantAcquire(now); ask {
		return carveStep{ask: w}
	}
	if pl.Acquiring() {
		return carveStep{}
	}
	return carveStep{result: resRemote}
}

// carve makes one attempt (carveOnce) on key's pool, made for p when
// missing, starting the acquire it calls for; a sub-grant carved is
// registered for its reports and returns. done is closed when the acquire
// to wait for ends (when the step's result is ""). The node stopping
// answers remote.
func (h *Holder) carve(p *policies.Policy, key string, part int, holder string, want, least int64) (st carveStep, done <-chan struct{}) {
	e := h.entry(p, key, part)
	if e == nil {
		return carveStep{result: resRemote}, nil
	}
	e.follow(p)
	st = carveOnce(e.pool, h.now(), holder, want, least)
	if st.ask > 0 {
		e.done = make(chan struct{})
	}
	done = e.done
	e.mu.Unlock()
	switch {
	case st.result == resGranted:
		h.mu.Lock()
		h.subs[st.sub.ID] = e
		h.mu.Unlock()
	case st.ask > 0:
		h.startAcquire(e, st.ask, least)
	}
	return st, done
}

// subReport applies a gateway's report (or, with ret, return) of
// sub-grant id at now (lease.Pool.SubReport): ErrUnknownGrant when this
// node made no such sub-grant still out. A return forgets it (unless its
// spend was refused).
func (h *Holder) subReport(id, epoch uint64, spent int64, ret bool) error {
	h.mu.RLock()
	e := h.subs[id]
	h.mu.RUnlock()
	if e == nil {
		return lease.ErrUnknownGrant
	}
	e.mu.Lock()
	err := e.pool.SubReport(h.now(), id, epoch, spent, ret)
	e.mu.Unlock()
	if ret && !errors.Is(err, lease.ErrBadSpend) {
		h.mu.Lock()
		if h.subs[id] == e {
			delete(h.subs, id)
		}
		h.mu.Unlock()
	}
	return err
}
