package keys

import (
	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/policies"
)

// recordRestAt returns the instant (Unix ns) at and after which rec, a
// record whose states are those of policy version p's limits, is at rest
// (keyrec.Record.RestAt): every state is at rest (kvstate.RestAt: the
// bucket full again, the window or period rolled over, the log's entries
// expired) and the newest remembered request_id has left the dedupe
// window. Before then, dropping the record could change a decision: a
// spent bucket would come back full, a window or quota forget what it
// counted, a retry be decided again. It returns 0 (unknown) when p is nil,
// and never returns 0 otherwise (an instant 0 becomes 1: later is the
// safe side).
func recordRestAt(p *policies.Policy, rec *keyrec.Record) int64 {
	if p == nil {
		return 0
	}
	at := int64(-1 << 63)
	for i := range p.Limits {
		if i < len(rec.States) {
			at = max(at, kvstate.RestAt(p.Limits[i].Limit, rec.States[i]))
		}
	}
	if n := len(rec.Dedupe); n > 0 {
		// Entries are oldest first.
		at = max(at, satAdd(rec.Dedupe[n-1].At, keyrec.DedupeWindow))
	}
	for i := range rec.Grants {
		// A leased key's outstanding grant (its reports and return may
		// still come) keeps the record, and so its grant ids, until it
		// expires.
		at = max(at, rec.Grants[i].Expires)
	}
	for i := range rec.Reservations {
		// An open reservation keeps the record until well after its
		// expiry, so the owner that ends it (a sweep, or the next call
		// after a failover) still finds it and records its usage; an
		// ended one is remembered for settles sent again.
		v := &rec.Reservations[i]
		if v.Outcome == keyrec.Open {
			at = max(at, satAdd(v.Expires, reservationRestMargin))
		} else {
			at = max(at, satAdd(v.EndedAt, endedWindow(v)))
		}
	}
	if at == 0 {
		at = 1
	}
	return at
}

// reservationRestMargin is how long after its expiry an open reservation
// keeps its record from rest (a reservation's longest ttl).
const reservationRestMargin = int64(policies.MaxReservationTTL)

// policyOf returns the policy version rec was written under, if this node
// knows it (nil otherwise).
func (o *owner) policyOf(rec *keyrec.Record) *policies.Policy {
	if p := o.limitsOf; p != nil && p.Name == rec.Policy && p.Revision == rec.Revision {
		return p
	}
	if p := o.env.Current(rec.Policy); p != nil && p.Revision == rec.Revision {
		return p
	}
	if p, _, ok := o.env.Version(rec.Policy, rec.Revision); ok {
		return p
	}
	return nil
}

// satAdd returns a+b for b >= 0, saturated at the largest int64.
func satAdd(a, b int64) int64 {
	if a > 1<<63-1-b {
		return 1<<63 - 1
	}
	return a + b
}
