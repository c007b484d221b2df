package mesh

import (
	"context"
	"encoding/json"
	"errors"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
)

// Routing: a decide request is decided by the owner of its limit key's
// partition. The node that receives it on <prefix>.v1.decide decides it
// itself when it serves the partition and otherwise forwards the request
// bytes to <prefix>.v1.shard.<n>, which only the owner subscribes to, and
// relays the reply verbatim (docs/protocol.md, "Partitions and routing").

// Headers of the routing protocol.
const (
	// HopHeader marks a forwarded request; a node never forwards it again.
	HopHeader = "Limitmesh-Hop"
	// TimeoutHeader carries the forwarder's remaining decision time (ns).
	TimeoutHeader = "Limitmesh-Timeout"
	// NotOwnerHeader is set (to the partition) on the 503 of a node that
	// got a forwarded request for a partition it does not serve; the
	// forwarder retries.
	NotOwnerHeader = "Limitmesh-Not-Owner"
)

// forwardRetry is the pause between attempts while a partition has no
// reachable owner (handoff, dead owner before its lease ran out).
const forwardRetry = 3 * time.Millisecond

// errFenced is the error of a state write refused or lost because this
// node no longer owns the key's partition. The owner core wraps store
// errors with %v, so isFenced also matches the message.
var errFenced = errors.New("mesh: partition fenced: not the owner")

func isFenced(err error) bool {
	return err != nil && (errors.Is(err, errFenced) || strings.Contains(err.Error(), errFenced.Error()))
}

// partSlot is the routing state of one partition, read by every request.
type partSlot struct {
	until    atomic.Int64  // serving until this monotonic instant (ns); 0: not serving
	epoch    atomic.Uint64 // epoch while held
	inflight atomic.Int64  // local calls of the partition not yet answered
}

// router is the node's routing table.
type router struct {
	parts    int
	base     time.Time
	slots    []partSlot
	subjects []string // <prefix>.v1.shard.<n>
}

func newRouter(prefix string, parts int) *router {
	r := &router{parts: parts, base: time.Now(), slots: make([]partSlot, parts),
		subjects: make([]string, parts)}
	for n := range parts {
		r.subjects[n] = prefix + ".v1.shard." + strconv.Itoa(n)
	}
	return r
}

// mono is the router's monotonic clock (ns since it was made, > 0). Leases
// use it rather than NodeConfig.Clock: they measure durations on this node
// only.
func (r *router) mono() int64 { return r.monoAt(time.Now()) }

// monoAt is mono at t (a time read from time.Now).
func (r *router) monoAt(t time.Time) int64 { return int64(t.Sub(r.base)) + 1 }

// serving reports whether this node decides partition n now.
func (r *router) serving(n int) bool { return r.mono() < r.slots[n].until.Load() }

// shardSubject returns <prefix>.v1.shard.<n>.
func (n *Node) shardSubject(part int) string { return n.router.subjects[part] }

// forward hands a request for a partition this node does not serve to its
// owner, within the decision deadline, and relays the reply. hopped is
// true for a request that was already forwarded once: it is not forwarded
// again; the node waits for the partition to come to it, else answers 503
// with NotOwnerHeader so the first forwarder retries. It runs in its own
// goroutine and answers rq.r exactly once.
func (n *Node) forward(rq *routed) {
	r := rq.r
	for {
		if n.router.serving(rq.part) {
			n.route(rq, time.Now())
			return
		}
		left := time.Until(rq.deadline)
		if left <= 0 {
			break
		}
		if rq.hopped {
			// Wait briefly for a move to settle here; the forwarder
			// retries elsewhere after our 503.
			if time.Since(rq.start) > 4*forwardRetry {
				n.metrics.forwarded.WithLabelValues("not_owner").Inc()
				n.replyError(r, rq.p.Name, rq.start, errNotOwner, micro.WithHeaders(micro.Headers{NotOwnerHeader: []string{strconv.Itoa(rq.part)}}))
				return
			}
			time.Sleep(forwardRetry)
			continue
		}
		m := nats.NewMsg(n.shardSubject(rq.part))
		m.Data = r.Data()
		m.Header.Set(HopHeader, "1")
		m.Header.Set(TimeoutHeader, strconv.FormatInt(int64(left), 10))
		ctx, cancel := context.WithDeadline(context.Background(), rq.deadline)
		resp, err := n.nc.RequestMsgWithContext(ctx, m)
		cancel()
		switch {
		case err == nil && resp.Header.Get(NotOwnerHeader) == "":
			n.metrics.forwarded.WithLabelValues("ok").Inc()
			if rerr := r.Respond(resp.Data, micro.WithHeaders(micro.Headers(resp.Header))); rerr != nil {
				n.log.Debug("relaying a reply failed", "error", rerr.Error())
			}
			n.metrics.duration.Observe(time.Since(rq.start).Seconds())
			n.inflight.Add(-1)
			return
		case err == nil, errors.Is(err, nats.ErrNoResponders):
			// Not owned there (yet): retry within the deadline.
			n.metrics.forwarded.WithLabelValues("retry").Inc()
			time.Sleep(forwardRetry)
		default:
			// Timed out or the connection failed.
			if time.Until(rq.deadline) > forwardRetry {
				time.Sleep(forwardRetry)
				continue
			}
		}
	}
	n.metrics.forwarded.WithLabelValues("unavailable").Inc()
	n.replyError(r, rq.p.Name, rq.start, errNoOwner)
}

// errNoOwner and errNotOwner are the 503 causes of routing.
var (
	errNoOwner  = wrapUnavailable("no owner of the key's partition answered before the decision deadline")
	errNotOwner = wrapUnavailable("forwarded to a node that does not own the partition")
)

func wrapUnavailable(msg string) error { return &routeError{msg: msg} }

type routeError struct{ msg string }

func (e *routeError) Error() string { return "mesh: unavailable: " + e.msg }
func (e *routeError) Unwrap() error { return ErrUnavailable }

// fencedStore wraps the state store with the fencing rule: a write that
// loses its compare-and-swap while this node no longer owns the key's
// partition (it does not serve it any more, or the part.<n> entry read back
// names another owner or epoch) fails with errFenced instead of a conflict,
// so the owner core does not reload and decide again: the calls go to the
// new owner, and the node drops the partition.
type fencedStore struct {
	kvstate.Store
	n *Node
}

func (f *fencedStore) Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error) {
	nrev, err := f.Store.Update(ctx, key, value, rev)
	if err == nil || !errors.Is(err, kvstate.ErrConflict) || f.n.shards == nil {
		return nrev, err
	}
	part := partitionOf(key, f.n.router.parts)
	if f.n.router.serving(part) && f.n.shards.verify(ctx, part) {
		return nrev, err
	}
	return 0, errFenced
}

// msgRequest is a micro.Request over a plain subscription's message (the
// shard subjects are plain subscriptions, not micro endpoints).
type msgRequest struct{ m *nats.Msg }

func (q msgRequest) Respond(b []byte, opts ...micro.RespondOpt) error {
	resp := &nats.Msg{Data: b}
	for _, o := range opts {
		o(resp)
	}
	return q.m.RespondMsg(resp)
}

func (q msgRequest) RespondJSON(v any, opts ...micro.RespondOpt) error {
	b, err := json.Marshal(v)
	if err != nil {
		return micro.ErrMarshalResponse
	}
	return q.Respond(b, opts...)
}

func (q msgRequest) Error(code, desc string, data []byte, opts ...micro.RespondOpt) error {
	resp := &nats.Msg{Header: nats.Header{micro.ErrorHeader: {desc}, micro.ErrorCodeHeader: {code}}}
	for _, o := range opts {
		o(resp)
	}
	resp.Data = data
	return q.m.RespondMsg(resp)
}

func (q msgRequest) Data() []byte           { return q.m.Data }
func (q msgRequest) Headers() micro.Headers { return micro.Headers(q.m.Header) }
func (q msgRequest) Subject() string        { return q.m.Subject }
func (q msgRequest) Reply() string          { return q.m.Reply }

// owned counts the partitions this node serves now.
func (r *router) owned() int {
	k := 0
	for p := range r.slots {
		if r.serving(p) {
			k++
		}
	}
	return k
}
