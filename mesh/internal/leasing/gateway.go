package leasing

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/lease"
	"github.com/limitmesh/limitmesh/mesh/internal/ownership"
	"github.com/limitmesh/limitmesh/policies"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
)

// The gateway side: gateways (SDK holders) ask this node for grants on the
// gateway subject and get sub-grants carved from its pools; they report
// and return them on this node's subject, named in the grant's reply.

// HandleGateway answers a gateway's acquire on <prefix>.v1.lease.
func (l *Leasing) HandleGateway(r micro.Request) {
	var req gatewayRequest
	if err := decode(r.Data(), &req); err != nil {
		l.respondGateway(r, reply{Result: resBadRequest, Message: err.Error()})
		return
	}
	if req.Op != opAcquire {
		l.respondGateway(r, reply{Result: resBadRequest, Message: "reports and returns go to the grant's report_to subject"})
		return
	}
	if req.Holder == "" || len(req.Holder) > keyrec.MaxHolderBytes {
		l.respondGateway(r, reply{Result: resBadRequest, Message: fmt.Sprintf("holder: 1..%d bytes", keyrec.MaxHolderBytes)})
		return
	}
	dims := make([]policies.Dim, 0, len(req.Descriptor))
	for k, v := range req.Descriptor {
		dims = append(dims, policies.Dim{Name: k, Value: v})
	}
	slices.SortFunc(dims, func(a, b policies.Dim) int { return strings.Compare(a.Name, b.Name) })
	desc, err := policies.NewDescriptor(dims)
	if err != nil {
		l.respondGateway(r, reply{Result: resBadRequest, Message: err.Error()})
		return
	}
	p := l.cfg.Policies.Snapshot().Match(desc)
	if p == nil || p.Mode != policies.ModeLeased {
		rep := reply{Result: resNotLeased}
		if p != nil {
			rep.Policy, rep.Revision = p.Name, p.Revision
		}
		l.respondGateway(r, rep)
		return
	}
	key, err := p.LimitKey(desc)
	if err != nil {
		l.respondGateway(r, reply{Result: resBadRequest, Message: err.Error()})
		return
	}
	part := ownership.PartitionOf(key, l.cfg.Route.Parts())
	least := max(req.Min, 1)
	want := req.Want
	if want == 0 {
		want = p.Lease.Size
	}
	deadline := l.cfg.Runtime.Now().Add(l.cfg.Timeout)
	l.respondGateway(r, l.carve(p, key, part, req.Holder, max(want, least), least, deadline))
}

// carve makes a sub-grant of key's pool for holder, asking the owner for a
// grant first (and waiting for it, until deadline) when the pool holds
// none that fits; other gateways may take a new grant first, then it asks
// again. It answers "exhausted" while the owner says the key's limits lack
// the units, and "remote" when the owner has no room (max_outstanding),
// cannot be reached, or nothing came before the deadline.
func (l *Leasing) carve(p *policies.Policy, key string, part int, holder string, want, least int64, deadline time.Time) reply {
	base := reply{Policy: p.Name, Revision: p.Revision}
	result := func(r string) reply {
		base.Result = r
		l.m.subGrants.WithLabelValues(r).Inc()
		return base
	}
	for {
		e := l.entry(p, key, part)
		if e == nil {
			return result(resRemote)
		}
		now := l.mono(l.cfg.Runtime.Now())
		e.follow(p)
		sub, ok := e.pool.Carve(now, holder, want, least)
		if ok {
			e.mu.Unlock()
			l.mu.Lock()
			l.subs[sub.ID] = e
			l.mu.Unlock()
			base.Grant, base.Epoch, base.Units = sub.ID, sub.Epoch, sub.Units
			base.TTL, base.ReportTo = sub.Deadline-now, NodeSubject(l.cfg.Prefix, l.cfg.Self)
			return result(resGranted)
		}
		if res, retry := e.pool.Refusal(now); res == lease.Denied {
			e.mu.Unlock()
			base.RetryAfter = retry
			return result(resExhausted)
		}
		if e.pool.Backoff(now) {
			e.mu.Unlock()
			return result(resRemote)
		}
		wantA, ask := e.pool.WantAcquire(now)
		if ask {
			e.done = make(chan struct{})
		}
		done := e.done
		e.mu.Unlock()
		if ask {
			l.startAcquire(e, wantA, least)
		}
		if done == nil {
			// Grants are held but none fits (the cost, or too close to
			// their end), and holding more is not called for.
			return result(resRemote)
		}
		t := time.NewTimer(time.Until(deadline))
		select {
		case <-done:
			t.Stop()
		case <-t.C:
			return result(resRemote)
		}
	}
}

func (l *Leasing) respondGateway(r micro.Request, rep reply) {
	if rep.Result == resNotLeased {
		l.m.subGrants.WithLabelValues(resNotLeased).Inc()
	}
	if err := r.Respond(encode(rep)); err != nil {
		l.log.Debug("lease reply failed", "error", err.Error())
	}
}

// HandleNode answers a gateway's report or return of a sub-grant on
// <prefix>.v1.lease.node.<id>.
func (l *Leasing) HandleNode(m *nats.Msg) {
	var req gatewayRequest
	if err := decode(m.Data, &req); err != nil {
		respond(m, reply{Result: resBadRequest, Message: err.Error()})
		return
	}
	if req.Op == opAcquire {
		respond(m, reply{Result: resBadRequest, Message: "acquires go to the gateway subject"})
		return
	}
	ret := req.Op == opReturn
	l.mu.RLock()
	e := l.subs[req.Grant]
	l.mu.RUnlock()
	err := lease.ErrUnknownGrant
	if e != nil {
		e.mu.Lock()
		err = e.pool.SubReport(l.mono(l.cfg.Runtime.Now()), req.Grant, req.Epoch, req.Spent, ret)
		e.mu.Unlock()
		if ret && !errors.Is(err, lease.ErrBadSpend) {
			l.mu.Lock()
			if l.subs[req.Grant] == e {
				delete(l.subs, req.Grant)
			}
			l.mu.Unlock()
		}
	}
	switch {
	case err == nil:
		respond(m, reply{Result: resOK})
	case errors.Is(err, lease.ErrBadSpend):
		respond(m, reply{Result: resBadSpend})
	default:
		respond(m, reply{Result: resUnknown})
	}
}
