package sim

import (
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/keys"
	"github.com/nats-io/nats.go"
)

// Reserving clients (CONTRACT §10). Besides the decide clients, sessions
// start as a Poisson process of cfg.Reserve per second: each reserves
// units of a rate or conc key for a random ttl (with a request_id half of
// the time, and then sends the reserve again to another node when it gets
// no answer), and once admitted, after a random delay (sometimes past the
// expiry), settles a random part, releases, renews (then settles, releases
// or abandons), or abandons the reservation, which the sweeps must then
// expire. A settle or release is sometimes sent to two nodes at once, and
// is sent again to another node when its answer is lost or does not come.
// Every answer that arrives goes to the checker (rescheck.go), also those
// the client then loses. One key's sessions stop during the faults; the
// others' a quarter of the way into the settle time.

const (
	minResTTL   = int64(150 * time.Millisecond)
	maxResTTL   = int64(time.Second)
	resAttempts = 4    // sends of one reserve (with a request_id), settle or release
	lostReply   = 0.08 // probability the client does not get an answer that came
	dupEnd      = 0.15 // probability a settle or release goes to two nodes at once
)

// resSession is one reserving client.
type resSession struct {
	k     *simKey
	call  string // the reserve's call id (its usage record's "call")
	units int64  // micro-units reserved
	ttl   int64  // ns
	reqID string // "" or the reserve's request_id
	tries int
	last  int     // the node the last send went to
	r     *simRes // the reservation, once the client knows it
}

// otherNode returns the index of a random node other than last (-1: any).
func (s *Sim) otherNode(last int) int {
	if last < 0 || len(s.nodes) == 1 {
		return s.s.rng.IntN(len(s.nodes))
	}
	return (last + 1 + s.s.rng.IntN(len(s.nodes)-1)) % len(s.nodes)
}

// reservers starts the reserving clients.
func (s *Sim) reservers() {
	cfg := s.cfg
	stop := int64(cfg.Duration + cfg.Settle/4)
	for _, k := range s.resKeys {
		k.resEnd = stop
	}
	// A key whose reservations stop while faults go on: its owner may
	// change after the last call that told it of them.
	s.resKeys[s.s.rng.IntN(len(s.resKeys))].resEnd = s.s.between(int64(cfg.Duration/2), int64(cfg.Duration))
	var next func()
	next = func() {
		if s.s.now >= stop {
			return
		}
		if k := s.resKeys[s.s.rng.IntN(len(s.resKeys))]; s.s.now < k.resEnd {
			s.reserve(k)
		}
		gap := int64(s.s.rng.ExpFloat64() / cfg.Reserve * 1e9)
		s.s.after(max(gap, 1), nil, next)
	}
	s.s.after(int64(cfg.Lease), nil, next)
}

// reserve starts a session on k.
func (s *Sim) reserve(k *simKey) {
	s.check.calls++
	x := &resSession{k: k, call: callID(s.check.calls), ttl: s.s.between(minResTTL, maxResTTL), last: -1}
	if k.conc {
		x.units = kvstate.Unit
		if s.s.chance(0.25) {
			x.units = 2 * kvstate.Unit
		}
	} else {
		x.units = s.s.between(2, 12) * kvstate.Unit / 4 // 0.5 to 3 units
	}
	if s.s.chance(0.5) {
		x.reqID = "q" + x.call
	}
	s.res.active++
	s.reserveAttempt(x)
}

// reserveAttempt sends x's reserve to a random node (another one than the
// last send's).
func (s *Sim) reserveAttempt(x *resSession) {
	x.tries++
	x.last = s.otherNode(x.last)
	n := s.nodes[x.last]
	deadline := s.s.now + int64(s.cfg.Timeout)
	a := s.res.sent(&resAttempt{kind: keys.ResReserve, k: x.k, x: x, units: x.units, ttl: x.ttl, deadline: deadline})
	body := reserveBody(x.k, x.call, x.units, x.ttl, x.reqID)
	s.attempt(a, &clientCall{id: x.call, k: x.k}, n, reserveEndpoint, body, func(an answer) {
		if !an.allowed || a.res == nil { // denied (or an answer R2 refused)
			s.res.active--
			return
		}
		x.r, x.last = a.res, -1
		s.s.after(s.s.between(0, x.ttl*13/10), nil, func() { s.act(x, false) })
	}, func() {
		if x.reqID != "" && x.tries < resAttempts {
			s.s.after(s.s.between(int64(time.Millisecond), int64(20*time.Millisecond)), nil, func() { s.reserveAttempt(x) })
			return
		}
		s.res.active--
	})
}

// act does what x's client does with its reservation next: settle part of
// it, release it, renew it (once), or abandon it.
func (s *Sim) act(x *resSession, renewed bool) {
	switch v := s.s.rng.IntN(20); {
	case v < 7:
		q := x.r.units / (kvstate.Unit / 4)
		s.end(x, keys.ResSettle, s.s.between(0, q)*kvstate.Unit/4, 1)
	case v < 11:
		s.end(x, keys.ResRelease, 0, 1)
	case v < 14 && !renewed:
		s.renew(x)
	default:
		s.res.active-- // abandoned: the sweeps expire it
	}
}

// end sends a settle (keeping units) or a release of x's reservation:
// try 1 sometimes to two nodes at once; again to another node when the
// answer is lost or does not come.
func (s *Sim) end(x *resSession, kind keys.ResKind, units int64, try int) {
	r := x.r
	send := func(n *node, last bool) {
		deadline := s.s.now + int64(s.cfg.Timeout)
		a := s.res.sent(&resAttempt{kind: kind, k: x.k, r: r, units: units, deadline: deadline})
		ep, name := settleEndpoint, "settle"
		if kind == keys.ResRelease {
			ep, name = releaseEndpoint, "release"
		}
		s.attempt(a, &clientCall{k: x.k}, n, ep, endBody(name, r.id, units, 0), func(answer) {
			if last {
				s.res.active--
			}
		}, func() {
			if !last {
				return
			}
			if try < resAttempts {
				s.s.after(s.s.between(int64(time.Millisecond), int64(20*time.Millisecond)), nil, func() { s.end(x, kind, units, try+1) })
				return
			}
			s.res.active--
		})
	}
	x.last = s.otherNode(x.last)
	if try == 1 && s.s.chance(dupEnd) {
		send(s.nodes[s.otherNode(x.last)], false)
	}
	send(s.nodes[x.last], true)
}

// renew renews x's reservation for a new random ttl, then acts again
// after a random delay (whatever the answer).
func (s *Sim) renew(x *resSession) {
	n := s.nodes[s.s.rng.IntN(len(s.nodes))]
	x.last = -1
	ttl := s.s.between(minResTTL, maxResTTL)
	deadline := s.s.now + int64(s.cfg.Timeout)
	a := s.res.sent(&resAttempt{kind: keys.ResRenew, k: x.k, r: x.r, ttl: ttl, deadline: deadline})
	later := func() { s.s.after(s.s.between(0, ttl*13/10), nil, func() { s.act(x, true) }) }
	s.attempt(a, &clientCall{k: x.k}, n, renewEndpoint, endBody("renew", x.r.id, 0, ttl), func(answer) { later() }, later)
}

// attempt sends reservation call a (body, to endpoint ep) to n. The
// checker gets the answer where it is made, if one is (resChecker.answer);
// the client acts on the answer it gets (then) unless it is an error
// other than not found or is lost, or when none comes in time (lost).
func (s *Sim) attempt(a *resAttempt, cc *clientCall, n *node, ep endpoint, body []byte, then func(answer), lost func()) {
	over := false
	cc.decided = func(on *node, arrived int64, an answer) { s.res.answer(a, an, on, arrived) }
	s.send(cc, n, ep, body, func(m *nats.Msg) {
		if over {
			return
		}
		over = true
		an, err := decodeAnswer(m)
		if err != nil || an.failed() || s.s.chance(lostReply) {
			lost()
			return
		}
		then(an)
	})
	s.s.after(2*int64(s.cfg.Timeout), nil, func() {
		if !over {
			over = true
			lost()
		}
	})
}
