package sim

import (
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/policies"
	"github.com/limitmesh/limitmesh/usage"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
)

// clients issue decide requests until end (global ns): to a random node,
// for a random key, as a Poisson process of cfg.Rate per second.
func (s *Sim) clients(end int64) {
	var next func()
	next = func() {
		if s.s.now >= end {
			return
		}
		k := s.keys[s.s.rng.IntN(len(s.keys))]
		n := s.nodes[s.s.rng.IntN(len(s.nodes))]
		s.decide(k, n)
		gap := int64(s.s.rng.ExpFloat64() / s.cfg.Rate * 1e9)
		s.s.after(max(gap, 1), nil, next)
	}
	s.s.after(int64(s.cfg.Lease), nil, next)
}

// decide sends a decide request of k (cost 1) to n as a new client call;
// the checker gets its answer where it is made (check.outcome).
func (s *Sim) decide(k *simKey, n *node) {
	s.check.calls++
	c := &clientCall{k: k, id: callID(s.check.calls)}
	c.decided = func(n *node, arrived int64, a answer) { s.check.outcome(c, n, arrived, a) }
	s.send(c, n, decideEndpoint, decideBody(k, c.id, false), func(*nats.Msg) {})
}

// clientCall is one request a client sends: a decide request or one
// attempt of a reservation call.
type clientCall struct {
	id string // names the call in its descriptor ("call"; "" for a probe)
	k  *simKey
	// decided is what the checks do with an answer a where it is made: n
	// the node that made it, arrived the global instant the request
	// reached n. nil: nothing (a probe's answer is read by its client).
	decided func(n *node, arrived int64, a answer)
}

// decided hands the answer m node n made to request q of client call c
// to the checks.
func (s *Sim) decided(c *clientCall, n *node, q *simReq, m *nats.Msg) {
	if c.decided == nil {
		return
	}
	a, err := decodeAnswer(m)
	if err != nil {
		s.check.fail("%s answered call %s of %s with a reply that does not decode: %v: %s", n.id, c.id, c.k.name, err, m.Data)
		return
	}
	c.decided(n, q.arrived, a)
}

// answer is a reply to a client call, decoded (CONTRACT §2, §10).
type answer struct {
	code, msg   string // an error reply's code and description ("" none)
	allowed     bool
	remaining   int64  // micro-units
	reservation string // a reservation's id ("" none)
	expiresIn   int64  // expires_in_ms; -1 when absent
	outcome     string // a settle's, release's or renew's
	settled     int64  // micro-units
	returned    int64  // micro-units
	again       bool
}

// failed reports whether a is an error other than a not found.
func (a answer) failed() bool { return a.code != "" && a.code != "404" }

// decodeAnswer decodes a reply; an error reply is an answer with its code.
func decodeAnswer(m *nats.Msg) (answer, error) {
	a := answer{expiresIn: -1}
	if code := m.Header.Get(micro.ErrorCodeHeader); code != "" {
		a.code, a.msg = code, m.Header.Get(micro.ErrorHeader)
		return a, nil
	}
	var v struct {
		Allowed     bool        `json:"allowed"`
		Remaining   json.Number `json:"remaining"`
		Reservation string      `json:"reservation"`
		ExpiresIn   *int64      `json:"expires_in_ms"`
		Outcome     string      `json:"outcome"`
		Settled     json.Number `json:"settled"`
		Returned    json.Number `json:"returned"`
		Again       bool        `json:"again"`
	}
	if err := json.Unmarshal(m.Data, &v); err != nil {
		return a, err
	}
	a.allowed, a.reservation, a.outcome, a.again = v.Allowed, v.Reservation, v.Outcome, v.Again
	if v.ExpiresIn != nil {
		a.expiresIn = *v.ExpiresIn
	}
	for _, f := range []struct {
		n   json.Number
		out *int64
	}{{v.Remaining, &a.remaining}, {v.Settled, &a.settled}, {v.Returned, &a.returned}} {
		if f.n == "" {
			continue
		}
		u, err := policies.ParseUnits(string(f.n))
		if err != nil {
			return a, fmt.Errorf("%q: %v", f.n, err)
		}
		*f.out = u
	}
	return a, nil
}

// decideBody is the decide request of k by call id (its "call"
// dimension; "" none), a dry run or not.
func decideBody(k *simKey, id string, dryRun bool) []byte {
	b := append([]byte(`{"descriptor":`), descriptorJSON(k, id)...)
	if dryRun {
		b = append(b, `,"dry_run":true`...)
	}
	return append(b, '}')
}

// descriptorJSON is k's descriptor with call id as a JSON object.
func descriptorJSON(k *simKey, id string) []byte {
	d := map[string]string{}
	for _, dim := range k.desc {
		d[dim.Name] = dim.Value
	}
	if id != "" {
		d["call"] = id
	}
	b, _ := json.Marshal(d) // keys sorted: a run replays exactly
	return b
}

// reserveBody is a reserve of units (micro-units) of k for ttl (ns) by
// call id, with request_id reqID ("" none).
func reserveBody(k *simKey, id string, units, ttl int64, reqID string) []byte {
	b := append([]byte(`{"descriptor":`), descriptorJSON(k, id)...)
	b = append(b, `,"cost":`...)
	b = kvstate.AppendUnits(b, units)
	b = append(b, `,"ttl":`...)
	b = strconv.AppendQuote(b, time.Duration(ttl).String())
	if reqID != "" {
		b = append(b, `,"request_id":`...)
		b = strconv.AppendQuote(b, reqID)
	}
	return append(b, '}')
}

// endBody is a settle (keeping units), release or renew (for ttl) body
// of reservation id.
func endBody(ep string, id string, units, ttl int64) []byte {
	b := append([]byte(`{"reservation":`), strconv.Quote(id)...)
	switch ep {
	case "settle":
		b = append(b, `,"cost":`...)
		b = kvstate.AppendUnits(b, units)
	case "renew":
		b = append(b, `,"ttl":`...)
		b = strconv.AppendQuote(b, time.Duration(ttl).String())
	}
	return append(b, '}')
}

// serviceUsage is a node's usage sink for the records its service
// publishes itself (denials, and leased admissions spent from a grant):
// the usage model (usage.go) is the journal's, so it notes the calls
// these records admitted, which the journal's stream does not hold
// (check.outcome, U2).
type serviceUsage struct{ s *Sim }

func (u serviceUsage) Add(_ string, r usage.Record) bool {
	if call, ok := r.Descriptor.Get("call"); ok && r.Allowed {
		u.s.spentByHolder[call] = true
	}
	return true
}
