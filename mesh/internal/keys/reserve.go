package keys

import (
	"fmt"
	"math"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/fail"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/lease"
	"github.com/limitmesh/limitmesh/policies"
)

// Reservations (CONTRACT §10, docs/protocol.md "Reservations"). A Call
// with a ResOp reserves, settles, releases or renews a reservation of its
// key, or sweeps the key's expired reservations. Its owner applies it to
// the key's record like a strict decision, whatever the policy's mode: the
// record, reservations included, is written before the call is answered,
// so a failover never forgets a reservation its owner acknowledged, and
// the usage of a reservation's end is journalled with the write that ends
// it (exactly once in the ledger, like a strict admission).
//
// A reservation is a grant to one request: reserving debits its units
// from every limit of the key (a concurrency limit takes a hold named
// after it, until its expiry); settling gives back the units not used
// (lease.Refund: never above a limit's capacity; a concurrency hold is
// released whole); an expiry leaves them spent (a concurrency hold ends by
// itself at the same instant).

// ResKind is the operation of a ResOp.
type ResKind uint8

// The reservation operations.
const (
	ResReserve ResKind = iota + 1
	ResSettle
	ResRelease
	ResRenew
	ResSweep // end the expired reservations, nothing else
)

// ResOp is a reservation operation of a key's owner.
type ResOp struct {
	Kind ResKind
	// Key is the call's limit key: the reservation ids name it.
	Key string
	// TTL (ns): of a reserve, and the extension of a renew.
	TTL int64
	// Nonce: of the new reservation (reserve), or the one the id names.
	Nonce uint64
	// Seq is the reservation the id names (settle, release, renew).
	Seq uint64
	// Units is what a settle keeps spent, in micro-units (0..reserved);
	// -1 settles the whole reservation.
	Units int64
	// Hold makes a reserve one layer's hold of a multi-layer decision
	// (keyrec.Reservation.Hold).
	Hold bool

	// Results, set when the call is decided (Call.Err nil).
	//
	// Res is the reservation as the call left it: a reserve's new one
	// (when admitted), or the one settled, released or renewed. Again is
	// true when it had ended before the call (a settle sent again): Res
	// holds its first ending. NotFound: no such reservation, or it
	// expired.
	Res      keyrec.Reservation
	Again    bool
	NotFound bool
	// Ended counts, by outcome, the reservations this call ended
	// (including the expired ones it swept).
	Ended [keyrec.Expired + 1]int
	// Open and Next: the key's open reservations after the call and the
	// earliest expiry among them (0: none), for the node's sweeps.
	Open int
	Next int64
}

// decideRes applies c's reservation operation to rec at now and reports
// whether rec changed.
func (o *owner) decideRes(rec *keyrec.Record, c *Call, p *policies.Policy, now int64) bool {
	op := c.Res
	// A call decided again (after a lost compare-and-swap, or a blind
	// decision dropped for a load) starts over: its results are this
	// decision's only: an answer never carries an earlier decision's
	// "not found" or ending (docs/protocol.md, R1).
	op.Res, op.Again, op.NotFound, op.Ended = keyrec.Reservation{}, false, false, [keyrec.Expired + 1]int{}
	c.mode = policies.ModeStrict // written before the reply, whatever p's mode
	c.At = now
	limits := o.limitsFor(p)
	changed := o.expireReservations(rec, op, p, now)
	switch op.Kind {
	case ResReserve:
		changed = o.reserve(rec, c, p, limits, now) || changed
	case ResSettle, ResRelease, ResRenew:
		changed = o.endOrRenew(rec, c, p, limits, now) || changed
	case ResSweep:
		c.Out = o.probe(rec, p, limits, now)
	}
	op.Open, op.Next = rec.OpenReservations()
	return changed
}

// probe returns the key's decision for a cost of 0 at now: its remaining
// units and reset time, spending nothing.
func (o *owner) probe(rec *keyrec.Record, p *policies.Policy, limits []kvstate.Limit, now int64) keyrec.Decision {
	kd, states := kvstate.DecideAll(limits, rec.States, now, 0, o.spare)
	o.spare = states
	return decisionOf(kd, p)
}

// expireReservations ends rec's open reservations whose expiry is at or
// before now (their units stay spent) and forgets the ended ones past
// their memory (keyrec.EndedWindow and keyrec.MaxEnded; with a
// request_id, keyrec.DedupeWindow and keyrec.MaxDedupeEntries). It
// allocates nothing and changes nothing when nothing is due.
func (o *owner) expireReservations(rec *keyrec.Record, op *ResOp, p *policies.Policy, now int64) bool {
	due := false
	var ended [2]int // without, with a request_id
	for i := range rec.Reservations {
		v := &rec.Reservations[i]
		switch {
		case v.Outcome == keyrec.Open:
			due = due || v.Expires <= now
		case now-v.EndedAt >= endedWindow(v):
			due = true
		default:
			ended[b2i(v.HasReqID)]++
		}
	}
	if !due && ended[0] <= keyrec.MaxEnded && ended[1] <= keyrec.MaxDedupeEntries {
		return false
	}
	rs := rec.Reservations
	ended = [2]int{}
	for i := range rs {
		v := &rs[i]
		if v.Outcome == keyrec.Open && v.Expires <= now {
			o.end(rec, v, op, keyrec.Expired, v.Units, now)
		}
		if v.Outcome != keyrec.Open && now-v.EndedAt < endedWindow(v) {
			ended[b2i(v.HasReqID)]++
		}
	}
	// The oldest (by seq) past the caps go first.
	drop := [2]int{max(ended[0]-keyrec.MaxEnded, 0), max(ended[1]-keyrec.MaxDedupeEntries, 0)}
	kept := rs[:0]
	for _, v := range rs {
		if v.Outcome != keyrec.Open {
			c := b2i(v.HasReqID)
			if now-v.EndedAt >= endedWindow(&v) {
				continue
			}
			if drop[c] > 0 {
				drop[c]--
				continue
			}
		}
		kept = append(kept, v)
	}
	clear(rs[len(kept):])
	if len(kept) == 0 {
		kept = nil
	}
	rec.Reservations = kept
	return true
}

// endedWindow is how long ended reservation v is remembered.
func endedWindow(v *keyrec.Reservation) int64 {
	if v.HasReqID {
		return keyrec.DedupeWindow
	}
	return keyrec.EndedWindow
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// end ends reservation v of rec at now with outcome, settled units staying
// spent, and queues the usage record of its end. The caller has given
// back the rest.
func (o *owner) end(rec *keyrec.Record, v *keyrec.Reservation, op *ResOp, outcome keyrec.Outcome, settled, now int64) {
	v.Outcome, v.Settled, v.Returned, v.EndedAt = outcome, settled, v.Units-settled, now
	if v.Hold {
		// A layer's hold: committed or expired, the layer's admission
		// (an ordinary usage record); released, nothing.
		if outcome != keyrec.Released {
			desc := v.Desc
			if desc == nil {
				desc, _ = policies.DescriptorOfKey(op.Key, rec.Policy)
			}
			o.usage = append(o.usage, keyrec.Usage{At: now, Revision: v.Revision, Cost: settled, Desc: desc, RequestID: v.RequestID})
			o.usageAsync = append(o.usageAsync, false)
			o.usagePolicy = rec.Policy
		}
		v.RequestID, v.Desc, v.Room = "", nil, nil
		return
	}
	op.Ended[outcome]++
	desc := v.Desc
	if desc == nil {
		desc, _ = policies.DescriptorOfKey(op.Key, rec.Policy)
	}
	o.usage = append(o.usage, keyrec.Usage{At: now, Revision: v.Revision, Cost: settled, Desc: desc,
		RequestID: v.RequestID, Reservation: keyrec.ReservationID(op.Key, v.Seq, v.Nonce)})
	o.usageAsync = append(o.usageAsync, false)
	o.usagePolicy = rec.Policy
	// Remembered for its first outcome only (keyrec stores no more).
	v.RequestID, v.Desc, v.Room = "", nil, nil
}

// reserve decides a reserve call.
func (o *owner) reserve(rec *keyrec.Record, c *Call, p *policies.Policy, limits []kvstate.Limit, now int64) bool {
	op := c.Res
	if c.HasID && !c.DryRun {
		if v, ok := rec.ReservationByRequest(c.ID); ok {
			op.Res, op.Again = *v, v.Outcome != keyrec.Open
			c.Out = o.probe(rec, p, limits, now)
			c.Out.Allowed, c.Out.Revision, c.Out.RetryAfter = true, v.Revision, 0
			c.Deduped = true
			return false
		}
		if d, ok := rec.FindDedupe(c.ID); ok {
			d.Policy = p.Name
			c.Out, c.Deduped = d, true
			return false
		}
	}
	open, next := rec.OpenReservations()
	if open >= keyrec.MaxReservations {
		c.Out = o.probe(rec, p, limits, now)
		c.Out.Allowed, c.Out.RetryAfter = false, max(next-now, 1)
		return false
	}
	ttl := int64(p.ReservationTTL(time.Duration(op.TTL)))
	room := make([]int64, len(limits))
	for i := range room {
		room[i] = math.MaxInt64
	}
	seq := max(rec.ResSeq+1, uint64(max(now, 0))/uint64(time.Millisecond))
	v := keyrec.Reservation{Seq: seq, Nonce: op.Nonce, Units: c.Cost, Revision: p.Revision, At: now,
		Expires: now + ttl, HasReqID: c.HasID, ReqID: c.ID, RequestID: c.RequestID, Room: room, Hold: op.Hold}
	if c.Desc != nil && !policies.KeyCarries(op.Key, p.Name, c.Desc) {
		v.Desc = c.Desc // else the key carries it (end)
	}
	kd, states := kvstate.DecideAllHold(limits, rec.States, now, c.Cost,
		kvstate.HoldSpec{ID: v.HoldID(), Expires: v.Expires}, o.spare)
	o.denying = !kd.Allowed
	c.Out = decisionOf(kd, p)
	if c.DryRun {
		o.spare = states
		return false
	}
	if !kd.Allowed {
		o.spare = states
		if c.HasID {
			rec.AddDedupe(c.ID, now, c.Out)
			return true
		}
		return false
	}
	o.noteDebit(rec, limits, now)
	rec.States, o.spare = states, rec.States
	rec.ResSeq = seq
	rec.Reservations = append(rec.Reservations, v)
	op.Res = v
	return true
}

// endOrRenew decides a settle, release or renew call.
func (o *owner) endOrRenew(rec *keyrec.Record, c *Call, p *policies.Policy, limits []kvstate.Limit, now int64) bool {
	op := c.Res
	v, ok := rec.Reservation(op.Seq)
	if !ok || v.Nonce != op.Nonce || v.Outcome == keyrec.Expired {
		op.NotFound = true
		c.Out = o.probe(rec, p, limits, now)
		return false
	}
	if v.Outcome != keyrec.Open {
		op.Res, op.Again = *v, true
		c.Out = o.probe(rec, p, limits, now)
		return false
	}
	// In place: rec is the owner's own record (writes carry its encoding).
	hold := v.HoldID()
	states := append([]kvstate.State(nil), rec.States...)
	if op.Kind == ResRenew {
		v.Expires = now + int64(p.ReservationTTL(time.Duration(op.TTL)))
		for i, l := range limits {
			if i < len(states) && l.Algorithm == kvstate.Concurrency {
				states[i], _ = kvstate.Extend(states[i], now, hold, min(v.Expires, now+l.Window))
			}
		}
		rec.States = states
		op.Res = *v
		c.Out = o.probe(rec, p, limits, now)
		return true
	}
	settled := op.Units
	if op.Kind == ResRelease {
		settled = 0
	}
	if settled < 0 {
		settled = v.Units
	}
	if settled > v.Units {
		c.Err = fmt.Errorf("%w: cost: %s is above the reserved %s", fail.ErrBadRequest, micro(settled), micro(v.Units))
		return false
	}
	back := v.Units - settled
	for i, l := range limits {
		if i >= len(states) {
			break
		}
		give := back
		if l.Algorithm.Bucket() {
			// A bucket gets back what it would still hold, had the
			// units never been taken: no more than its least headroom
			// since the reservation (noteDebit), nor than now.
			give = min(give, kvstate.Headroom(l, states[i], now))
			if i < len(v.Room) {
				give = min(give, v.Room[i])
			}
		}
		if l.Algorithm == kvstate.Concurrency {
			states[i] = kvstate.Release(states[i], now, hold)
		} else if give > 0 {
			states[i], _ = lease.Refund(l, states[i], now, give, v.At)
		}
	}
	rec.States = states
	outcome := keyrec.Settled
	if op.Kind == ResRelease {
		outcome = keyrec.Released
	}
	o.end(rec, v, op, outcome, settled, now)
	op.Res = *v
	c.Out = o.probe(rec, p, limits, now)
	return true
}

// noteDebit is told, before an admission debits rec's states at now,
// that the key's buckets are at their fullest since the last debit: each
// open reservation's Room keeps the least headroom its buckets had since
// it was made (a bucket's tokens only rise between debits, so its least
// headroom over any span is at a debit or at the span's end).
func (o *owner) noteDebit(rec *keyrec.Record, limits []kvstate.Limit, now int64) {
	if len(rec.Reservations) == 0 {
		return
	}
	for i, l := range limits {
		if !l.Algorithm.Bucket() || i >= len(rec.States) {
			continue
		}
		h := kvstate.Headroom(l, rec.States[i], now)
		for j := range rec.Reservations {
			// In place: rec is the owner's own record (writes carry its
			// encoding), and a reservation's rooms are its own.
			if v := &rec.Reservations[j]; v.Outcome == keyrec.Open && i < len(v.Room) && v.Room[i] > h {
				v.Room[i] = h
			}
		}
	}
}

// micro formats micro-units as a decimal for messages.
func micro(v int64) string { return string(kvstate.AppendUnits(nil, v)) }
