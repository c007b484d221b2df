package sim

import (
	"context"
	"encoding/json"
	"strconv"
	"strings"
	"time"

	"github.com/limitmesh/limitmesh/mesh/internal/service"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
)

// The network the nodes' services talk over. A client's request reaches
// the node it picked at once (a gateway on the same host) and is handled
// by the node's real service (service.Service): decided there when the
// node serves the key's partition, else forwarded by the service's own
// forward code, through the node's rt.Requester (simRequester), to the
// node subscribed to the partition's shard subject. A forwarded request
// and its reply each cross the network twice (node to server to node):
// delayed, lost, or dropped by a cut. A node subscribes to a partition's
// shard subject while its member holds the partition (member.Config's
// OnServe, as mesh's partition subscriptions do).
//
// The checks see every answer where it is made: on the node that decided
// it (simReq.answer), whether or not it then reaches the client.

// deciderHeader names, on a reply that crossed the network, the node
// that made it; the node that relays it to the client keeps the header,
// so the client's side knows the answer was checked already.
const deciderHeader = "Sim-Decider"

// simReq is a request delivered to a node's service: a client's, or one
// another node forwarded (hop). It implements micro.Request.
type simReq struct {
	n       *node // the node whose service handles it
	data    []byte
	hdr     nats.Header
	subject string
	call    *clientCall // the client call it carries
	arrived int64       // global instant it reached n
	hop     bool        // forwarded by another node
	// reply delivers the reply (called once, on n).
	reply func(*nats.Msg)
}

func (q *simReq) Respond(b []byte, opts ...micro.RespondOpt) error {
	m := &nats.Msg{Data: append([]byte(nil), b...)} // as a publish copies it
	for _, o := range opts {
		o(m)
	}
	q.answer(m)
	return nil
}

func (q *simReq) RespondJSON(v any, opts ...micro.RespondOpt) error {
	b, err := json.Marshal(v)
	if err != nil {
		return micro.ErrMarshalResponse
	}
	return q.Respond(b, opts...)
}

func (q *simReq) Error(code, desc string, data []byte, opts ...micro.RespondOpt) error {
	m := &nats.Msg{Header: nats.Header{micro.ErrorHeader: {desc}, micro.ErrorCodeHeader: {code}},
		Data: append([]byte(nil), data...)}
	for _, o := range opts {
		o(m)
	}
	q.answer(m)
	return nil
}

func (q *simReq) Data() []byte           { return q.data }
func (q *simReq) Headers() micro.Headers { return micro.Headers(q.hdr) }
func (q *simReq) Subject() string        { return q.subject }
func (q *simReq) Reply() string          { return "" } // replies go through Respond

// answer checks the reply m of the node that made it (not one it
// relays, nor a not-owner refusal, which the forwarder retries) and
// delivers it.
func (q *simReq) answer(m *nats.Msg) {
	if m.Header.Get(deciderHeader) == "" && m.Header.Get(service.NotOwnerHeader) == "" && q.call != nil {
		q.n.sim.decided(q.call, q.n, q, m)
		if q.hop {
			if m.Header == nil {
				m.Header = nats.Header{}
			}
			m.Header.Set(deciderHeader, q.n.id)
		}
	}
	q.reply(m)
}

// simRequester is a node's rt.Requester: a request to a partition
// subject, over the simulated network.
type simRequester struct{ n *node }

// Request sends m from r.n to a node subscribed to its partition subject
// (the service's forwards, the holder's requests to owners).
// With none, the answer is nats.ErrNoResponders; from a cut node, the
// connection's error at once; with no reply by deadline (the node's
// clock), context.DeadlineExceeded.
func (r simRequester) Request(m *nats.Msg, deadline time.Time, done func(*nats.Msg, error)) {
	n := r.n
	s := n.sim
	finished := false
	finish := func(reply *nats.Msg, err error) {
		if !finished {
			finished = true
			done(reply, err)
		}
	}
	wait := int64(deadline.Sub(nodeRT{n}.Now()))
	s.s.after(n.global(max(wait, 0)), n, func() { finish(nil, context.DeadlineExceeded) })
	if n.cut {
		nodeRT{n}.Go(func() { finish(nil, nats.ErrConnectionReconnecting) })
		return
	}
	part, lease, ok := shardOf(m.Subject)
	call := s.calls[dataKey(m.Data)]
	if !ok || s.s.chance(s.cfg.Loss) {
		return
	}
	back := func(reply *nats.Msg, err error) {
		// Server to n.
		s.s.after(s.netDelay(), n, func() {
			if !n.cut {
				finish(reply, err)
			}
		})
	}
	// n to the server, which delivers to one subscriber (the shard
	// subjects are subscribed in a queue group: mesh/subs.go).
	s.s.after(s.netDelay(), nil, func() {
		var subs []*node
		for _, o := range s.nodes {
			if o.up && !o.cut && o.subscribed[part] {
				subs = append(subs, o)
			}
		}
		if len(subs) == 0 {
			back(nil, nats.ErrNoResponders)
			return
		}
		o := subs[s.s.rng.IntN(len(subs))]
		if s.s.chance(s.cfg.Loss) {
			return
		}
		s.s.after(s.netDelay(), o, func() {
			if o.cut {
				return
			}
			q := &simReq{n: o, data: m.Data, hdr: m.Header, subject: m.Subject, call: call, arrived: s.s.now, hop: true}
			q.reply = func(reply *nats.Msg) {
				if o.cut || s.s.chance(s.cfg.Loss) {
					return
				}
				// o to the server, then to n.
				s.s.after(s.netDelay(), nil, func() { back(reply, nil) })
			}
			if lease {
				reply := q.reply
				q.reply = func(m *nats.Msg) {
					s.check.leaseReply(o, part, q.data, m.Data)
					reply(m)
				}
				o.lease.ServeOwner(q)
			} else {
				o.svc.HandleShard(q)
			}
		})
	})
}

// shardOf returns the partition of a partition subject: a shard subject
// (rl.v1.shard.<p>: the decide service's) or a lease one
// (rl.v1.lease.shard.<p>: leasing's Owner's).
func shardOf(subject string) (part int, lease, ok bool) {
	p, ok := strings.CutPrefix(subject, "rl.v1.shard.")
	if !ok {
		if p, ok = strings.CutPrefix(subject, "rl.v1.lease.shard."); !ok {
			return 0, false, false
		}
		lease = true
	}
	n, err := strconv.Atoi(p)
	return n, lease, err == nil
}

// dataKey names a request body by its first byte's address: the service
// forwards a request's body as it got it (the same slice), so a forwarded
// request is known as the client call that sent it.
func dataKey(b []byte) *byte {
	if len(b) == 0 {
		return nil
	}
	return &b[0]
}

// endpoint is the handler of a node's service a client call goes to.
type endpoint func(svc *service.Service, r micro.Request)

var (
	decideEndpoint  endpoint = (*service.Service).Handle
	reserveEndpoint endpoint = (*service.Service).HandleReserve
	settleEndpoint  endpoint = (*service.Service).HandleSettle
	releaseEndpoint endpoint = (*service.Service).HandleRelease
	renewEndpoint   endpoint = (*service.Service).HandleRenew
)

// send delivers client call c (body, to endpoint ep) to node n's service;
// got runs with the reply the client gets (not when none comes: the node
// died, or its reply was lost on the way).
func (s *Sim) send(c *clientCall, n *node, ep endpoint, body []byte, got func(*nats.Msg)) {
	if !n.up {
		s.check.lost++
		return
	}
	s.calls[dataKey(body)] = c
	s.s.after(0, n, func() {
		q := &simReq{n: n, data: body, subject: "rl.v1.decide", call: c, arrived: s.s.now}
		q.reply = got
		ep(n.svc, q)
	})
}
