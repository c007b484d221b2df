package mesh

import (
	"errors"
	"fmt"
	"time"

	"github.com/limitmesh/limitmesh/policies"
	"github.com/nats-io/nats.go/micro"
)

// handleDecide is the decide endpoint's handler. It validates the request,
// resolves the policy and the limit key, and hands the call to the key's
// owner; the reply is sent when the owner finishes the call. It never
// panics: a panic is answered with a 500.
func (n *Node) handleDecide(r micro.Request) {
	start := time.Now()
	n.inflight.Add(1)
	handed := false
	defer func() {
		if v := recover(); v != nil {
			n.log.Error("panic in decide handler", "panic", fmt.Sprint(v))
			if !handed {
				n.replyError(r, "", start, fmt.Errorf("%w: %v", errInternal, v))
			}
		}
	}()
	req, err := decodeRequest(r.Data())
	if err != nil {
		n.replyError(r, "", start, err)
		return
	}
	p := n.policies.snap.Load().Match(req.desc)
	if p == nil {
		if !req.dryRun {
			n.metrics.decisions.WithLabelValues("", "allowed").Inc()
		}
		n.replyOK(r, start, decision{Allowed: true})
		return
	}
	key, err := p.LimitKey(req.desc)
	if err != nil {
		if !req.dryRun {
			n.metrics.decisions.WithLabelValues(p.Name, "error").Inc()
		}
		n.replyError(r, p.Name, start, fmt.Errorf("%w: %v", ErrBadRequest, err))
		return
	}
	now := n.clock().UnixNano()
	c := &call{
		policy:   p,
		cost:     req.cost,
		dryRun:   req.dryRun,
		deadline: now + int64(n.cfg.DecisionTimeout),
	}
	if req.id != "" {
		c.id, c.hasID = idHash(req.id), true
	}
	c.done = func(c *call) { n.finishCall(r, c, start) }
	handed = true
	n.submit(key, c, now)
}

// finishCall sends the reply of a call the owner finished.
func (n *Node) finishCall(r micro.Request, c *call, start time.Time) {
	if c.err != nil {
		if !c.dryRun {
			n.metrics.decisions.WithLabelValues(c.policy.Name, "error").Inc()
		}
		n.replyError(r, c.policy.Name, start, c.err)
		return
	}
	switch {
	case c.deduped:
		n.metrics.deduped.Inc()
	case c.dryRun:
	case c.out.ShadowDenied:
		n.metrics.decisions.WithLabelValues(c.out.Policy, "shadow_denied").Inc()
	case c.out.Allowed:
		n.metrics.decisions.WithLabelValues(c.out.Policy, "allowed").Inc()
	default:
		n.metrics.decisions.WithLabelValues(c.out.Policy, "denied").Inc()
	}
	n.replyOK(r, start, c.out)
}

func (n *Node) replyOK(r micro.Request, start time.Time, d decision) {
	var buf [192]byte
	if err := r.Respond(appendReply(buf[:0], d)); err != nil {
		n.log.Debug("reply failed", "error", err.Error())
	}
	n.metrics.duration.Observe(time.Since(start).Seconds())
	n.inflight.Add(-1)
}

// replyError answers with a micro error: code, description and the JSON
// body {"error": symbol, "message": text} (CONTRACT.md §2).
func (n *Node) replyError(r micro.Request, policy string, start time.Time, err error) {
	code, symbol := "500", "internal"
	switch {
	case errors.Is(err, ErrTooLarge):
		code, symbol = "413", "too_large"
	case errors.Is(err, ErrBadRequest), errors.Is(err, policies.ErrInvalid):
		code, symbol = "400", "bad_request"
	case errors.Is(err, ErrUnavailable):
		code, symbol = "503", "unavailable"
	}
	msg := err.Error()
	if rerr := r.Error(code, msg, errorBody(symbol, msg)); rerr != nil {
		n.log.Debug("error reply failed", "error", rerr.Error())
	}
	n.metrics.errors.WithLabelValues(code).Inc()
	if code == "500" {
		n.log.Error("decide failed", "policy", policy, "error", msg)
	}
	n.metrics.duration.Observe(time.Since(start).Seconds())
	n.inflight.Add(-1)
}
