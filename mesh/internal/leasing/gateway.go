package leasing

import (
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/lease"
	"github.com/limitmesh/limitmesh/mesh/internal/ownership"
	"github.com/limitmesh/limitmesh/mesh/internal/policyset"
	"github.com/limitmesh/limitmesh/mesh/internal/route"
	"github.com/limitmesh/limitmesh/mesh/internal/rt"
	"github.com/limitmesh/limitmesh/policies"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
)

// Gateway is a node's gateway side of leased mode: gateways (SDK holders)
// ask this node for grants on the gateway subject and get sub-grants the
// Holder carves from its pools; they report and return them on this
// node's subject, named in the grant's reply. Its methods are safe for
// concurrent use.
type Gateway struct {
	holder   *Holder
	policies *policyset.Set
	route    *route.Table
	rt       rt.Runtime
	timeout  time.Duration
	reportTo string // NodeSubject of this node
	log      *slog.Logger
	m        *metrics
}

func newGateway(cfg Config, m *metrics, h *Holder) *Gateway {
	return &Gateway{holder: h, policies: cfg.Policies, route: cfg.Route, rt: cfg.Runtime, timeout: cfg.Timeout,
		reportTo: NodeSubject(cfg.Prefix, cfg.Self), log: cfg.Log, m: m}
}

// HandleGateway answers a gateway's acquire on <prefix>.v1.lease.
func (g *Gateway) HandleGateway(r micro.Request) {
	var req gatewayRequest
	if err := decode(r.Data(), &req); err != nil {
		g.respond(r, reply{Result: resBadRequest, Message: err.Error()})
		return
	}
	if req.Op != opAcquire {
		g.respond(r, reply{Result: resBadRequest, Message: "reports and returns go to the grant's report_to subject"})
		return
	}
	if req.Holder == "" || len(req.Holder) > keyrec.MaxHolderBytes {
		g.respond(r, reply{Result: resBadRequest, Message: fmt.Sprintf("holder: 1..%d bytes", keyrec.MaxHolderBytes)})
		return
	}
	desc, err := descriptorOf(req.Descriptor)
	if err != nil {
		g.respond(r, reply{Result: resBadRequest, Message: err.Error()})
		return
	}
	p := g.policies.Snapshot().Match(desc)
	if p == nil || p.Mode != policies.ModeLeased {
		rep := reply{Result: resNotLeased}
		if p != nil {
			rep.Policy, rep.Revision = p.Name, p.Revision
		}
		g.respond(r, rep)
		return
	}
	key, err := p.LimitKey(desc)
	if err != nil {
		g.respond(r, reply{Result: resBadRequest, Message: err.Error()})
		return
	}
	part := ownership.PartitionOf(key, g.route.Parts())
	want, least := gatewaySize(req, p)
	deadline := g.rt.Now().Add(g.timeout)
	g.respond(r, g.subGrant(p, key, part, req.Holder, want, least, deadline))
}

// descriptorOf is the descriptor of a gateway's request, its entries in
// name order.
func descriptorOf(m map[string]string) (policies.Descriptor, error) {
	dims := make([]policies.Dim, 0, len(m))
	for k, v := range m {
		dims = append(dims, policies.Dim{Name: k, Value: v})
	}
	slices.SortFunc(dims, func(a, b policies.Dim) int { return strings.Compare(a.Name, b.Name) })
	return policies.NewDescriptor(dims)
}

// gatewaySize is the size of the sub-grant a gateway asks for: want
// micro-units (the policy's grant size when it names none), at least
// least (its min, at least one micro-unit), want never below least. The
// pool caps want at the grant size.
func gatewaySize(req gatewayRequest, p *policies.Policy) (want, least int64) {
	least = max(req.Min, 1)
	want = req.Want
	if want == 0 {
		want = p.Lease.Size
	}
	return max(want, least), least
}

// subGrant makes a sub-grant of key's pool for holder, asking the owner for a
// grant first (and waiting for it, until deadline) when the pool holds
// none that fits; other gateways may take a new grant first, then it asks
// again. It answers "exhausted" while the owner says the key's limits lack
// the units, and "remote" when the owner has no room (max_outstanding),
// cannot be reached, or nothing came before the deadline.
func (g *Gateway) subGrant(p *policies.Policy, key string, part int, holder string, want, least int64, deadline time.Time) reply {
	for {
		st, done := g.holder.carve(p, key, part, holder, want, least)
		if st.result == "" {
			t := time.NewTimer(time.Until(deadline))
			select {
			case <-done:
				t.Stop()
				continue
			case <-t.C:
				st.result = resRemote
			}
		}
		g.m.subGrants.WithLabelValues(st.result).Inc()
		return subGrantReply(p, st, g.reportTo)
	}
}

// subGrantReply is the reply to a gateway's acquire that came out as st:
// a granted sub-grant's ttl is what is left of the node's grant it came
// from, and its reports go to reportTo.
func subGrantReply(p *policies.Policy, st carveStep, reportTo string) reply {
	r := reply{Result: st.result, Policy: p.Name, Revision: p.Revision}
	switch st.result {
	case resGranted:
		r.Grant, r.Epoch, r.Units, r.TTL, r.ReportTo = st.sub.ID, st.sub.Epoch, st.sub.Units, st.ttl, reportTo
	case resExhausted:
		r.RetryAfter = st.retry
	}
	return r
}

func (g *Gateway) respond(r micro.Request, rep reply) {
	if rep.Result == resNotLeased {
		g.m.subGrants.WithLabelValues(resNotLeased).Inc()
	}
	if err := r.Respond(encode(rep)); err != nil {
		g.log.Debug("lease reply failed", "error", err.Error())
	}
}

// HandleNode answers a gateway's report or return of a sub-grant on
// <prefix>.v1.lease.node.<id> (ServeNode).
func (g *Gateway) HandleNode(m *nats.Msg) { g.ServeNode(msgRequest{m}) }

// ServeNode answers a gateway's report or return r of a sub-grant this
// node made, at once.
func (g *Gateway) ServeNode(r Request) {
	var req gatewayRequest
	if err := decode(r.Data(), &req); err != nil {
		respond(r, reply{Result: resBadRequest, Message: err.Error()})
		return
	}
	if req.Op == opAcquire {
		respond(r, reply{Result: resBadRequest, Message: "acquires go to the gateway subject"})
		return
	}
	respond(r, subReportReply(g.holder.subReport(req.Grant, req.Epoch, req.Spent, req.Op == opReturn)))
}

// subReportReply is the reply to a gateway's report or return that the
// holder answered with err.
func subReportReply(err error) reply {
	switch {
	case err == nil:
		return reply{Result: resOK}
	case errors.Is(err, lease.ErrBadSpend):
		return reply{Result: resBadSpend}
	}
	return reply{Result: resUnknown}
}
