package mesh

import (
	"fmt"
	"log/slog"
	"sync"

	"github.com/limitmesh/limitmesh/mesh/internal/leasing"
	"github.com/limitmesh/limitmesh/mesh/internal/route"
	"github.com/nats-io/nats.go"
)

// partitionSubs are the subscriptions of the decide role: each served
// partition's subjects (decide and lease) and the node's own lease
// subject. Its methods are safe for concurrent use.
type partitionSubs struct {
	nc     *nats.Conn
	prefix string
	route  *route.Table
	log    *slog.Logger
	// handleDecide and handleOwner take a partition's decide and lease
	// requests; set before the first partition is served.
	handleDecide nats.MsgHandler
	handleOwner  nats.MsgHandler

	mu     sync.Mutex
	decide []*nats.Subscription // the shard subjects of the partitions held
	lease  []*nats.Subscription // their lease owner subjects
	node   *nats.Subscription   // this node's lease subject (gateways' reports)
}

func newPartitionSubs(nc *nats.Conn, prefix string, rt *route.Table, parts int, log *slog.Logger) *partitionSubs {
	return &partitionSubs{nc: nc, prefix: prefix, route: rt, log: log,
		decide: make([]*nats.Subscription, parts), lease: make([]*nats.Subscription, parts)}
}

// serve subscribes partition p's subjects (decide and lease) while this
// node holds p (member.Config.OnServe).
func (s *partitionSubs) serve(p int, held bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if held {
		if s.decide[p] == nil {
			s.decide[p] = s.subscribe(s.route.Subject(p), s.handleDecide)
		}
		if s.lease[p] == nil {
			s.lease[p] = s.subscribe(leasing.OwnerSubject(s.prefix, p), s.handleOwner)
		}
		return
	}
	// Drain: requests already delivered are still handled (decisions
	// forwarded, lease requests answered "not_owner": the slot no longer
	// serves).
	for _, subs := range [][]*nats.Subscription{s.decide, s.lease} {
		if subs[p] != nil {
			_ = subs[p].Drain()
			subs[p] = nil
		}
	}
}

// subscribe subscribes a partition subject, in the queue group
// PartitionQueue, with no pending limits; nil (logged) when it fails.
//
// A queue group, because two nodes are subscribed to a partition's
// subjects for a moment whenever it changes hands (the new owner
// subscribes when it starts serving, the old one unsubscribes when it
// stops). With plain subscriptions both received every forwarded request
// of that moment: the one that no longer served answered "not owner",
// the forwarder, seeing that answer first, sent the request again, and
// the owner decided it twice (the first reply was dropped: an admission
// no client saw, spent and billed). In the group each request reaches
// one node, and "not owner" means that node decided nothing.
func (s *partitionSubs) subscribe(subject string, h nats.MsgHandler) *nats.Subscription {
	sub, err := s.nc.QueueSubscribe(subject, PartitionQueue, h)
	if err != nil {
		s.log.Warn("subscribing to a partition subject", "subject", subject, "error", err.Error())
		return nil
	}
	_ = sub.SetPendingLimits(-1, -1)
	return sub
}

// subscribeNode subscribes the node's own lease subject.
func (s *partitionSubs) subscribeNode(subject string, h nats.MsgHandler) error {
	sub, err := s.nc.Subscribe(subject, h)
	if err != nil {
		return fmt.Errorf("mesh: subscribing to the node's lease subject: %w", err)
	}
	_ = sub.SetPendingLimits(-1, -1)
	s.mu.Lock()
	s.node = sub
	s.mu.Unlock()
	return nil
}

// close unsubscribes everything.
func (s *partitionSubs) close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, subs := range [][]*nats.Subscription{s.decide, s.lease} {
		for p, sub := range subs {
			if sub != nil {
				_ = sub.Unsubscribe()
				subs[p] = nil
			}
		}
	}
	if s.node != nil {
		_ = s.node.Unsubscribe()
		s.node = nil
	}
}
