// Package leasing is a node's part in leased mode (CONTRACT §8,
// docs/protocol.md "Leased mode"), the I/O around the pure core in package
// lease. It has three sides, one type each:
//
//   - [Owner] (owner.go): as a key's owner, it applies the grant requests,
//     reports and returns of holder nodes, received on
//     <prefix>.v1.lease.shard.<n> for the partitions it serves, through the
//     key's owner core (keys), so every grant is written to the key's
//     record before it is answered;
//   - [Holder] (holder.go): as a holder, it keeps a pool of grants per
//     leased key it decides for, asked for from the key's owner, spends
//     them for the plain decide requests it receives (Spend), carves
//     sub-grants from them, reports their use and returns them;
//   - [Gateway] (gateway.go): for the gateways of its region, it answers
//     their acquires on <prefix>.v1.lease (a queue group: NATS prefers the
//     subscribers of the requester's own cluster, so a gateway is served
//     by its region's nodes) with sub-grants the Holder carves, and takes
//     their reports and returns on <prefix>.v1.lease.node.<node id>.
//
// [Leasing] puts the three together for the node. The decisions each side
// makes about a message are pure functions of the message, the pool and
// the instant (ownerReply, applyAcquire, carveOnce, gatewaySize...), which
// the tests drive with explicit instants.
//
// The Owner and the Holder reach time and other nodes only through package
// rt: the Holder's requests to owners go through an rt.Requester and
// continue in callbacks, its ticks and retries are the Runtime's timers,
// and the Owner answers a [Request] once the owner core is done. Neither
// blocks, so the deterministic simulation (mesh/internal/sim) runs them
// on its own Runtime and network; production drives them over NATS
// (HandleOwner, Run, Stop).
//
// leasing imports lease, keys, keyrec, policies, policyset, route, rt and
// ownership; the node (package mesh) wires it.
package leasing

import (
	"log/slog"
	"strconv"
	"time"

	"github.com/limitmesh/limitmesh/mesh/internal/keys"
	"github.com/limitmesh/limitmesh/mesh/internal/policyset"
	"github.com/limitmesh/limitmesh/mesh/internal/route"
	"github.com/limitmesh/limitmesh/mesh/internal/rt"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
	"github.com/prometheus/client_golang/prometheus"
)

// Config configures a node's Leasing.
type Config struct {
	Conn *nats.Conn
	// Requests carries the Holder's requests to the keys' owners; nil:
	// rt.NATS(Conn).
	Requests rt.Requester
	Prefix   string
	Self     string // this node's id: its holder name at owners
	Policies *policyset.Set
	Keys     *keys.Table
	Route    *route.Table
	Runtime  rt.Runtime
	// Timeout bounds a request to an owner and a gateway's acquire (the
	// node's decision timeout).
	Timeout    time.Duration
	Log        *slog.Logger
	Registerer prometheus.Registerer // nil: metrics are not registered
}

// Leasing is a node's owner, holder and gateway sides of leased mode, one
// of each sharing the node's metrics. Its methods are safe for concurrent
// use.
type Leasing struct {
	*Owner
	*Holder
	*Gateway
}

// New returns a node's Leasing; nothing runs before Run (or Start).
func New(cfg Config) (*Leasing, error) {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 500 * time.Millisecond
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	h := newHolder(cfg, m)
	return &Leasing{Owner: newOwner(cfg, m), Holder: h, Gateway: newGateway(cfg, m, h)}, nil
}

// Request is one request on a lease subject, answered once: a NATS
// message in production ([Owner.HandleOwner], [Gateway.HandleNode]), a
// message of the simulated network in the simulation. It is the part of
// micro.Request the handlers use, so a micro.Request is one.
type Request interface {
	// Data returns the request's body.
	Data() []byte
	// Respond sends data, the reply's body, to the requester.
	Respond(data []byte, opts ...micro.RespondOpt) error
}

// msgRequest is a NATS message as a Request; one without a reply subject
// is answered by nothing.
type msgRequest struct{ m *nats.Msg }

func (r msgRequest) Data() []byte { return r.m.Data }

func (r msgRequest) Respond(data []byte, opts ...micro.RespondOpt) error {
	if r.m.Reply == "" {
		return nil
	}
	resp := &nats.Msg{Data: data}
	for _, o := range opts {
		o(resp)
	}
	return r.m.RespondMsg(resp)
}

// OwnerSubject returns <prefix>.v1.lease.shard.<p>: partition p's owner
// answers holder nodes there.
func OwnerSubject(prefix string, p int) string { return prefix + ".v1.lease.shard." + strconv.Itoa(p) }

// GatewaySubject returns <prefix>.v1.lease: gateways ask for grants there.
func GatewaySubject(prefix string) string { return prefix + ".v1.lease" }

// NodeSubject returns <prefix>.v1.lease.node.<id>: gateways report and
// return their sub-grants to the node that made them there.
func NodeSubject(prefix, id string) string { return prefix + ".v1.lease.node." + id }
