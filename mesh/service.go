package mesh

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/limitmesh/limitmesh/policies"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
)

// routed is a decide request on its way to the owner of its key. It
// carries the call the owner decides, the partition slot that counts it in
// flight and the reply's buffer, and is recycled once answered
// (Node.routed): at about 550 bytes, one per decision, routed values were
// the largest part of the node's garbage. (The pool was withdrawn once for
// a lost-accounting failure of TestFaultPartition; that failure came
// without the pool too: state regressions in failover, in the journal's
// reads and releases, see journal.go.)
type routed struct {
	n        *Node
	r        micro.Request
	req      request
	p        *policies.Policy
	key      string
	hint     *atomic.Pointer[keyEntry] // the key's entry, cached (Node.submit)
	part     int
	start    time.Time // when this node received it
	deadline time.Time // decision deadline on this node
	hopped   bool      // it was forwarded to this node (never forward again)

	c    call      // the call being decided (submitCall)
	slot *partSlot // counts c in flight in its partition; nil: not counted
	buf  [replyBufSize]byte
}

// replyBufSize holds a usual decision reply without allocating (a reply
// with a long policy name and every number at its widest, up to about
// 280 bytes, grows into an allocation of its own).
const replyBufSize = 208

// handleDecide is the handler of the decide endpoint and of the shard
// subjects. It validates the request, resolves the policy and the limit
// key, and routes the call: to the key's owner core on this node when this
// node serves the key's partition (or the policy's mode is local), else to
// the partition's owner (route.go). The reply is sent when the call
// finishes. It never blocks on I/O and never panics: a panic is answered
// with a 500.
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
	snap := n.policies.snap.Load()
	var (
		req  request
		p    *policies.Policy
		key  string
		part = -1
		hint *atomic.Pointer[keyEntry]
	)
	if m := n.memo.get(r.Data(), snap); m != nil {
		req, p, key, part, hint = m.req, m.p, m.key, m.part, &m.ent
	} else {
		var err error
		if req, err = decodeRequest(r.Data()); err != nil {
			n.replyError(r, "", start, err)
			return
		}
		if p = snap.Match(req.desc); p == nil {
			if !req.dryRun {
				n.metrics.decision("", resAllowed)
			}
			n.replyOK(r, start, decision{Allowed: true}, -1, nil)
			return
		}
		if key, err = p.LimitKey(req.desc); err != nil {
			if !req.dryRun {
				n.metrics.decision(p.Name, resError)
			}
			n.replyError(r, p.Name, start, fmt.Errorf("%w: %v", ErrBadRequest, err))
			return
		}
		if n.router != nil {
			part = partitionOf(key, n.router.parts)
		}
		if m := n.memo.put(r.Data(), snap, req, p, key, part); m != nil {
			hint = &m.ent
		}
	}
	rq, _ := n.routed.Get().(*routed)
	if rq == nil {
		rq = new(routed)
	}
	*rq = routed{n: n, r: r, req: req, p: p, key: key, part: part, hint: hint, start: start,
		deadline: start.Add(n.cfg.DecisionTimeout)}
	if h := r.Headers(); h != nil {
		rq.hopped = h.Get(HopHeader) != ""
		if ns, err := strconv.ParseInt(h.Get(TimeoutHeader), 10, 64); err == nil && ns > 0 && time.Duration(ns) < n.cfg.DecisionTimeout {
			rq.deadline = start.Add(time.Duration(ns))
		}
	}
	handed = true
	n.route(rq, start)
}

// route decides rq here when this node serves its partition (or the
// policy is local), and forwards it otherwise. now is the current time
// (one clock read serves the whole path).
func (n *Node) route(rq *routed, now time.Time) {
	if n.router == nil || rq.part < 0 || rq.p.Mode == policies.ModeLocal {
		n.submitCall(rq, nil, now)
		return
	}
	slot := &n.router.slots[rq.part]
	slot.inflight.Add(1)
	if n.router.monoAt(now) < slot.until.Load() {
		n.submitCall(rq, slot, now)
		return
	}
	slot.inflight.Add(-1)
	go n.forward(rq)
}

// submitCall hands rq to its key's owner core on this node. slot, when not
// nil, counts the call as in flight in its partition until it finishes.
func (n *Node) submitCall(rq *routed, slot *partSlot, at time.Time) {
	now := at.UnixNano()
	if n.cfg.Clock != nil {
		now = n.clock().UnixNano()
	}
	// A call is submitted again only after its previous submission
	// finished (fenced: finish forwards it), so rq.c is free.
	rq.c = call{
		policy:   rq.p,
		cost:     rq.req.cost,
		dryRun:   rq.req.dryRun,
		deadline: now + int64(rq.deadline.Sub(at)),
		done:     rq,
	}
	if rq.req.id != "" {
		rq.c.id, rq.c.hasID = idHash(rq.req.id), true
	}
	rq.slot = slot
	n.submit(rq.key, &rq.c, now, rq.hint)
}

// finish is the driver's end of rq's call c: it sends the reply, or
// forwards rq when this node lost the partition while deciding.
func (rq *routed) finish(c *call) {
	n := rq.n
	if rq.slot != nil {
		rq.slot.inflight.Add(-1)
	}
	if isFenced(c.err) && rq.slot != nil && time.Until(rq.deadline) > 0 {
		// Nothing was written: this node lost the partition while
		// deciding. The new owner decides.
		go n.forward(rq)
		return
	}
	n.finishCall(c, rq)
	// Answered: nothing refers to rq any more (the owner handed c out,
	// the reply was copied out), so the next request may reuse it. A
	// forwarded rq is left to the garbage collector.
	*rq = routed{}
	n.routed.Put(rq)
}

// finishCall sends the reply of rq's call c, which the owner finished.
func (n *Node) finishCall(c *call, rq *routed) {
	r := rq.r
	if c.err != nil {
		if !c.dryRun {
			n.metrics.decision(c.policy.Name, resError)
		}
		n.replyError(r, c.policy.Name, rq.start, c.err)
		return
	}
	switch {
	case c.deduped:
		n.metrics.deduped.Inc()
	case c.dryRun:
	case c.out.ShadowDenied:
		n.metrics.decision(c.out.Policy, resShadowDenied)
	case c.out.Allowed:
		n.metrics.decision(c.out.Policy, resAllowed)
	default:
		n.metrics.decision(c.out.Policy, resDenied)
	}
	part := rq.part
	if rq.p.Mode == policies.ModeLocal {
		part = -1 // any node decides a local key: no hint
	}
	n.replyOK(r, rq.start, c.out, part, rq.buf[:0])
}

// replyOK sends a decision, encoded into buf (the reply is copied out
// before Respond returns); part is the limit key's partition (the reply's
// "partition" hint), or -1.
func (n *Node) replyOK(r micro.Request, start time.Time, d decision, part int, buf []byte) {
	if err := n.respond(r, appendReply(buf, d, part)); err != nil {
		n.log.Debug("reply failed", "error", err.Error())
	}
	n.metrics.duration.Observe(time.Since(start).Seconds())
	n.inflight.Add(-1)
}

// respond publishes a decision reply to r's reply subject. It is
// r.Respond without the message value Respond allocates for every reply
// (about 200 bytes, a tenth of a decision's garbage): a decision reply
// has no headers, and the micro endpoint counts a request whether or not
// its handler used Respond. A node without a connection (in unit tests)
// uses r.Respond.
func (n *Node) respond(r micro.Request, data []byte) error {
	if n.nc == nil {
		return r.Respond(data)
	}
	reply := r.Reply()
	if reply == "" {
		return nats.ErrMsgNoReply
	}
	return n.nc.Publish(reply, data)
}

// replyError answers with a micro error: code, description and the JSON
// body {"error": symbol, "message": text} (CONTRACT.md §2).
func (n *Node) replyError(r micro.Request, policy string, start time.Time, err error, opts ...micro.RespondOpt) {
	code, symbol, sentinel := "500", "internal", errInternal
	switch {
	case errors.Is(err, ErrTooLarge):
		code, symbol, sentinel = "413", "too_large", ErrTooLarge
	case errors.Is(err, ErrBadRequest), errors.Is(err, policies.ErrInvalid):
		code, symbol, sentinel = "400", "bad_request", ErrBadRequest
	case errors.Is(err, ErrUnavailable):
		code, symbol, sentinel = "503", "unavailable", ErrUnavailable
	}
	// The symbol already says what the sentinel says: the message is the
	// rest ("descriptor.plan: missing; …", not "mesh: bad request: …").
	msg := strings.TrimPrefix(err.Error(), sentinel.Error()+": ")
	if rerr := r.Error(code, msg, errorBody(symbol, msg), opts...); rerr != nil {
		n.log.Debug("error reply failed", "error", rerr.Error())
	}
	n.metrics.errors.WithLabelValues(code).Inc()
	if code == "500" {
		n.log.Error("decide failed", "policy", policy, "error", msg)
	}
	n.metrics.duration.Observe(time.Since(start).Seconds())
	n.inflight.Add(-1)
}
