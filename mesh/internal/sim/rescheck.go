package sim

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/journal"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/keys"
)

// The reservation invariants (docs/protocol.md, "Reservations (R)"),
// checked against every answer an owner sends (also those the client then
// loses), every record appended to the journal (the state bucket's are
// checkpoints of those), and the usage stream at the end of a run:
//
//	R1  an acknowledged reservation is never forgotten: a settle, release
//	    or renew of it is not answered not found while it is surely
//	    unexpired (at every node's clock), nor once it has ended;
//	R2  a reservation is made once and ends once: every admitted answer
//	    to a reserve sent again with its request_id names the same
//	    reservation (and none is denied); a settle, release or renew
//	    after its end answers that first ending, which is what was asked
//	    (settle: the units kept; release: 0); the usage stream counts it
//	    once, with those units;
//	R3  no limit beyond its capacity: every record journalled holds
//	    tokens in [0, burst], and a concurrency limit's holds are its
//	    open reservations' (same units and expiry; an ended one keeps
//	    none unless it expired), at most its limit;
//	    every answer's remaining units are within capacity; a rate key
//	    admits, over any span, at most burst + rate × span units (M4's
//	    check and slack), counting each reservation when it was admitted
//	    at what it keeps: its reserved units while open or once expired,
//	    its settled units once settled (a settle gives back no more than
//	    the bucket would hold had they never been taken); a concurrency
//	    key admits no reservation while the ones surely held leave no room
//	    for it;
//	R4  an expired reservation gives its units back: a concurrency key
//	    denies a reservation only while the reservations possibly held
//	    (not surely ended or expired at every node's clock) leave no room
//	    for it; and once the faults have ended, every reservation ends
//	    (the sweeps expire those not settled) and reaches the usage stream
//	    once: at its reserved cost when it expired.
//
// Instants of answers and sends are global; expiries are of the clock of
// the owner that set them (ns, Unix), compared with every node's clock.

// simRes is one reservation an owner admitted, as the checker knows it.
type simRes struct {
	id         string
	k          *simKey
	seq, nonce uint64
	call       string // the reserve's call id
	units      int64
	admitted   int64 // global: the first answer that admitted it
	// expLow and expHigh bound its expiry (owner's clock): exact once an
	// answer told it, wider while a renew may have moved it.
	expLow, expHigh int64
	// Its ending, once an answer told it: outcome, units kept, and when
	// that answer came.
	ended    bool
	outcome  keyrec.Outcome
	settled  int64
	endedAns int64
	fresh    int // answers that ended it (not again)
	// The settles or releases sent (the client sends one kind, with one
	// number of units): the first's send, the last's deadline.
	endKind            keys.ResKind
	endUnits           int64
	endSent, endLatest int64
}

// resAttempt is one send of a reservation call.
type resAttempt struct {
	kind     keys.ResKind
	k        *simKey
	x        *resSession // a reserve's
	r        *simRes     // a settle's, release's or renew's
	units    int64       // a reserve's cost; the units a settle keeps
	ttl      int64       // a reserve's or renew's
	deadline int64       // global
	sent     int64       // global

	answered, admitted, denied bool
	res                        *simRes // a reserve's reservation, once an answer named it
}

// until is the last global instant the owner may decide a: its deadline,
// as the owners' slow clocks read it.
func (a *resAttempt) until() int64 { return a.deadline + int64(20*time.Millisecond) }

// resChecker checks R1-R4.
type resChecker struct {
	s        *Sim
	byID     map[string]*simRes
	byKey    map[*simKey][]*simRes
	attempts map[*simKey][]*resAttempt // the reserves sent, per key
	calls    map[string][]*resAttempt  // the reserves sent, per call id
	active   int                       // client sessions still acting
	// counts for Stats
	reserves, admitted, denied, ends, notFound int
}

func newResChecker(s *Sim) *resChecker {
	return &resChecker{s: s, byID: map[string]*simRes{}, byKey: map[*simKey][]*simRes{},
		attempts: map[*simKey][]*resAttempt{}, calls: map[string][]*resAttempt{}}
}

func (c *resChecker) fail(format string, a ...any) { c.s.check.fail(format, a...) }

// wallRange returns the lowest and highest wall clock (ns, Unix) of the
// nodes at global instant g.
func (s *Sim) wallRange(g int64) (lo, hi int64) {
	for i, n := range s.nodes {
		w := n.wallAt(g)
		if i == 0 || w < lo {
			lo = w
		}
		if i == 0 || w > hi {
			hi = w
		}
	}
	return lo, hi
}

// globalWhen returns the first global instant at which every node's wall
// clock reads at least w.
func (s *Sim) globalWhen(w int64) int64 {
	var g int64
	for _, n := range s.nodes {
		g = max(g, (w-epoch-n.offset)*1_000_000/(1_000_000+n.drift)+1)
	}
	return g
}

// sent records a send (its instant is now) and returns it.
func (c *resChecker) sent(a *resAttempt) *resAttempt {
	s := c.s
	a.sent = s.s.now
	switch a.kind {
	case keys.ResReserve:
		c.reserves++
		c.attempts[a.k] = append(c.attempts[a.k], a)
		c.calls[a.x.call] = append(c.calls[a.x.call], a)
	case keys.ResRenew:
		// A renew moves the expiry to its owner's now + ttl, which may be
		// earlier than the current one.
		r := a.r
		lo, _ := s.wallRange(a.sent)
		_, hi := s.wallRange(a.until())
		r.expLow, r.expHigh = min(r.expLow, lo+a.ttl), max(r.expHigh, hi+a.ttl)
	default:
		r := a.r
		if r.endSent == 0 {
			r.endSent, r.endKind, r.endUnits = a.sent, a.kind, a.units
		}
		r.endLatest = max(r.endLatest, a.until())
	}
	return a
}

// answer checks the answer an, which n made, to a (its request reached
// n at global instant arrived).
func (c *resChecker) answer(a *resAttempt, an answer, n *node, arrived int64) {
	s := c.s
	a.answered = true
	if an.failed() {
		return // unavailable: the outcome is unknown
	}
	// R3: remaining units within capacity.
	capacity := int64(rateBurst) * kvstate.Unit
	if a.k.conc {
		capacity = concLimit * kvstate.Unit
	}
	if r := an.remaining; r < 0 || r > capacity {
		c.fail("R3: %s answered %s of %s with %d remaining micro-units (capacity %d)", n.id, kindName(a.kind), a.k.name, r, capacity)
	}
	if s.cfg.Debug {
		s.logf("%s answers %s of %s: %+v", n.id, kindName(a.kind), a.k.name, an)
	}
	if a.kind == keys.ResReserve {
		c.reserveAnswer(a, an, n, arrived)
		return
	}
	c.ends++
	c.endAnswer(a, an, n, arrived)
}

// expiry bounds, on n's clock (ns, Unix), the expiry an answer made by n
// tells (expires_in_ms, counted from the decision's instant, rounded up
// to a millisecond): the decision came after the request arrived and
// before now.
func (c *resChecker) expiry(an answer, n *node, arrived int64) (lo, hi int64) {
	in := an.expiresIn * int64(time.Millisecond)
	return n.wallAt(arrived) + in - int64(time.Millisecond), n.wallAt(c.s.s.now) + in
}

// reserveAnswer checks a reserve's answer: R2 (one reservation per
// request_id), R3 (no admission beyond the limit) and R4 (no denial while
// a slot is free). A reserve sent again with its request_id may be
// answered from the dedupe memory, with what an earlier send's decision
// made: its answer is checked against the instant of the call's first
// send.
func (c *resChecker) reserveAnswer(a *resAttempt, an answer, n *node, arrived int64) {
	s := c.s
	x := a.x
	first := c.calls[x.call][0]
	if !an.allowed {
		c.denied++
		a.denied = true
		s.check.deniedIDs[x.call] = true // U3: never in the usage stream
		for _, b := range c.calls[x.call] {
			if b.admitted {
				c.fail("R2: %s denied reserve call %s (request_id %q) sent again, which %s admitted", n.id, x.call, x.reqID, b.res.id)
				return
			}
		}
		if a.k.conc {
			c.deniedConc(a, first.sent, n)
		}
		return
	}
	key, seq, nonce, ok := keyrec.ParseReservationID(an.reservation)
	if !ok || key != a.k.name || an.expiresIn < 0 {
		c.fail("R2: %s admitted reserve call %s of %s with reservation %q (expires in %d ms)", n.id, x.call, a.k.name, an.reservation, an.expiresIn)
		return
	}
	id := an.reservation
	for _, b := range c.calls[x.call] {
		if b.denied {
			c.fail("R2: %s admitted reserve call %s (request_id %q) as %s, which was denied before", n.id, x.call, x.reqID, id)
			return
		}
		if b.admitted && b.res.id != id {
			c.fail("R2: %s admitted reserve call %s (request_id %q) as %s, which was admitted as %s", n.id, x.call, x.reqID, id, b.res.id)
			return
		}
	}
	a.admitted = true
	r := c.byID[id]
	if r != nil {
		a.res = r
		if r.call != x.call {
			c.fail("R2: %s admitted reserve call %s as %s, which was made for call %s", n.id, x.call, id, r.call)
		}
		return
	}
	c.admitted++
	lo, hi := c.expiry(an, n, arrived)
	r = &simRes{id: id, k: a.k, seq: seq, nonce: nonce, call: x.call, units: x.units,
		admitted: s.s.now, expLow: lo, expHigh: hi}
	a.res = r
	c.byID[id] = r
	c.byKey[a.k] = append(c.byKey[a.k], r)
	if a != first {
		return // possibly made by an earlier send whose answer did not come
	}
	if !a.k.conc {
		s.check.admitRate(a.k, arrived, 0, r, n) // R3 (M4): the rate envelope
		return
	}
	// R3: the reservations surely held when a was decided (admitted
	// before it was sent, no settle or release sent before its answer,
	// unexpired at every clock) leave room for it.
	_, wall := s.wallRange(s.s.now)
	held := r.units
	var ids []string
	for _, o := range c.byKey[a.k] {
		if o == r || o.admitted > a.sent || o.ended || o.endSent != 0 && o.endSent < s.s.now || wall >= o.expLow {
			continue
		}
		held += o.units
		ids = append(ids, o.id)
	}
	if held > concLimit*kvstate.Unit {
		c.fail("R3: %s admitted %s (%s) while %v were surely held: %d units held, limit %d",
			n.id, id, fmtUnits(r.units), ids, held/kvstate.Unit, concLimit)
	}
}

// deniedConc checks R4 for a denied reserve of a conc key, decided after
// since (global): the reservations possibly held when it was decided
// leave no room for it. A reservation is possibly held unless an answer
// told its end before since, or it expired by then at every node's clock;
// a reserve sent before a was answered and not denied is possibly held
// until its latest expiry.
func (c *resChecker) deniedConc(a *resAttempt, since int64, n *node) {
	s := c.s
	lo, _ := s.wallRange(since)
	held := a.units
	seen := map[*simRes]bool{}
	for _, b := range c.attempts[a.k] {
		if b == a || b.denied || b.sent >= s.s.now {
			continue
		}
		if r := b.res; r != nil {
			if seen[r] || r.ended && r.outcome != keyrec.Expired && r.endedAns <= since || lo >= r.expHigh {
				continue
			}
			seen[r] = true
			held += r.units
			continue
		}
		if _, hi := s.wallRange(b.until()); lo >= hi+b.ttl {
			continue
		}
		held += b.units
	}
	if held <= concLimit*kvstate.Unit {
		c.fail("R4: %s denied reserve call %s of %s (%s), but at most %s were held: a slot did not come back",
			n.id, a.x.call, a.k.name, fmtUnits(a.units), fmtUnits(held-a.units))
	}
}

// outcomes are the outcomes of settle, release and renew replies.
var outcomes = map[string]keyrec.Outcome{"settled": keyrec.Settled, "released": keyrec.Released, "expired": keyrec.Expired, "renewed": keyrec.Open}

// endAnswer checks the answer to a settle, release or renew: R1 and R2.
func (c *resChecker) endAnswer(a *resAttempt, an answer, n *node, arrived int64) {
	s := c.s
	r := a.r
	if an.code == "404" { // R1
		c.notFound++
		switch _, hi := s.wallRange(s.s.now); {
		case r.ended && r.outcome != keyrec.Expired:
			c.fail("R1: %s answered %s of %s not found, but it was %s (%s kept)", n.id, kindName(a.kind), r.id, r.outcome, fmtUnits(r.settled))
		case hi < r.expLow:
			c.fail("R1: %s answered %s of %s not found, %.3fs before it expires", n.id, kindName(a.kind), r.id, float64(r.expLow-hi)/1e9)
		}
		return
	}
	// R2: the reservation asked for, ended at most once, as asked.
	outcome, ok := outcomes[an.outcome]
	units := r.units
	if outcome != keyrec.Open {
		units = an.settled + an.returned
	}
	if !ok || an.reservation != r.id || units != r.units {
		c.fail("R2: %s answered %s of %s with %+v", n.id, kindName(a.kind), r.id, an)
		return
	}
	if a.kind == keys.ResRenew && !an.again {
		if outcome != keyrec.Open || r.ended {
			c.fail("R2: %s renewed %s (outcome %s), which had ended %s", n.id, r.id, outcome, r.outcome)
			return
		}
		r.expLow, r.expHigh = c.expiry(an, n, arrived)
		return
	}
	if !an.again {
		r.fresh++
	}
	switch {
	case outcome == keyrec.Open || outcome == keyrec.Expired:
		c.fail("R2: %s answered %s of %s with outcome %s", n.id, kindName(a.kind), r.id, outcome)
	case r.fresh > 1:
		c.fail("R2: %s ended %s as %s (%s kept), which an earlier answer ended already", n.id, r.id, outcome, fmtUnits(an.settled))
	case r.ended:
		// Answers may come in another order than their decisions: the
		// first ending's own answer may come after one that repeats it.
		if outcome != r.outcome || an.settled != r.settled {
			c.fail("R2: %s ended %s as %s (%s kept, again %v), which had ended as %s (%s kept)",
				n.id, r.id, outcome, fmtUnits(an.settled), an.again, r.outcome, fmtUnits(r.settled))
		}
	default:
		want, kept := keyrec.Settled, r.endUnits
		if r.endKind == keys.ResRelease {
			want, kept = keyrec.Released, 0
		}
		if r.endKind == 0 || outcome != want || an.settled != kept {
			c.fail("R2: %s ended %s as %s (%s kept), but the client asked %s of %s", n.id, r.id, outcome, fmtUnits(an.settled), kindName(r.endKind), fmtUnits(kept))
		}
		r.ended, r.outcome, r.settled, r.endedAns = true, outcome, an.settled, s.s.now
	}
}

// kept returns the least units r keeps spent as far as the answers tell
// (R3's rate envelope): what its ending kept, once an answer told it;
// otherwise the least of its reserved units and what a settle or release
// sent asks to keep.
func (r *simRes) kept() int64 {
	switch {
	case r.ended && r.outcome == keyrec.Expired:
		return r.units
	case r.ended:
		return r.settled
	case r.endKind == keys.ResRelease:
		return 0
	case r.endKind == keys.ResSettle:
		return min(r.endUnits, r.units)
	}
	return r.units
}

// checkRecord checks R3 (and R4's holds) on a record of key about to be
// journalled.
func (c *resChecker) checkRecord(key string, val []byte, where string) {
	policy := keyrec.PolicyOfKey(key)
	if policy != "rate" && policy != "conc" {
		return
	}
	rec, err := keyrec.Decode(val)
	if err != nil {
		c.fail("R3: %s writes a record of %s that does not decode: %v", where, key, err)
		return
	}
	if len(rec.States) != 1 {
		return // not yet decided under the policy
	}
	st := rec.States[0]
	if policy == "rate" {
		if full := int64(rateBurst) * kvstate.Unit; st.Tokens < 0 || st.Tokens > full || st.Tokens == full && st.Frac > 0 {
			c.fail("R3: %s writes %s with %d micro-units of tokens (and a fraction %d), burst %d", where, key, st.Tokens, st.Frac, rateBurst)
		}
		return
	}
	var open int64
	for i := range rec.Reservations {
		v := &rec.Reservations[i]
		if v.Outcome != keyrec.Open {
			continue
		}
		open += v.Units
		if !slices.ContainsFunc(st.Holds, func(h kvstate.Hold) bool {
			return h.ID == v.HoldID() && h.Cost == v.Units && h.Expires == v.Expires
		}) {
			c.fail("R3: %s writes %s with open reservation %s (%s until %d) and no hold of it: %+v", where, key, v.HoldID(), fmtUnits(v.Units), v.Expires, st.Holds)
		}
	}
	if open > concLimit*kvstate.Unit {
		c.fail("R3: %s writes %s with %s held by open reservations, limit %d", where, key, fmtUnits(open), concLimit)
	}
	// R4: a hold is a reservation's, and an ended one's only if it
	// expired (it lapsed then).
	for _, h := range st.Holds {
		var v *keyrec.Reservation
		for i := range rec.Reservations {
			if rec.Reservations[i].HoldID() == h.ID {
				v = &rec.Reservations[i]
			}
		}
		switch {
		case v == nil:
			c.fail("R3: %s writes %s with hold %s of no reservation", where, key, h.ID)
		case v.Outcome != keyrec.Open && (v.Outcome != keyrec.Expired || h.Expires > v.EndedAt):
			c.fail("R4: %s writes %s with hold %s of a reservation that ended as %s", where, key, h.ID, v.Outcome)
		}
	}
}

// journalled checks R3 on the records of a journal message being
// appended. (The state bucket's records are checkpoints of journalled
// ones.)
func (c *resChecker) journalled(data []byte) {
	m, err := journal.Decode(data)
	if err != nil {
		return // the journal's own tests decode what it writes
	}
	for _, it := range m.Items {
		c.checkRecord(it.Key, it.Val, "a journal append")
	}
}

// quietAt returns the global instant from which, the clients done, every
// reservation has expired at every node's clock and been swept: R4's
// final check waits for it.
func (c *resChecker) quietAt() int64 {
	s := c.s
	var g int64
	for _, r := range c.byID {
		if !r.ended {
			g = max(g, s.globalWhen(r.expHigh))
		}
	}
	for _, as := range c.attempts {
		for _, a := range as {
			if a.res == nil && !a.denied {
				_, hi := s.wallRange(a.until())
				g = max(g, s.globalWhen(hi+a.ttl))
			}
		}
	}
	return g + sweepLag + 2*int64(s.cfg.Timeout)
}

// final checks R2 and R4 on the records the ledger counted.
func (c *resChecker) final(counted []usageRec) []error {
	byRes := map[string][]usageRec{}
	for _, u := range counted {
		if u.res != "" {
			byRes[u.res] = append(byRes[u.res], u)
		}
	}
	var errs []string
	ids := make([]string, 0, len(c.byID))
	for id := range c.byID {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	for _, id := range ids {
		r := c.byID[id]
		us := byRes[id]
		switch {
		case len(us) == 0:
			errs = append(errs, fmt.Sprintf("R4: reservation %s (call %s, %s, %s) never reached the usage stream; %s",
				id, r.call, fmtUnits(r.units), r.describe(), c.whereIs(r)))
			continue
		case len(us) > 1:
			errs = append(errs, fmt.Sprintf("R2: reservation %s counted %d times", id, len(us)))
		}
		u := us[0]
		ok := false
		switch {
		case u.call != r.call:
		case r.ended && r.outcome != keyrec.Expired:
			ok = u.cost == r.settled
		case r.ended || r.endSent == 0:
			ok = u.cost == r.units
		default: // an end whose answer did not come, or its expiry
			kept := r.endUnits
			if r.endKind == keys.ResRelease {
				kept = 0
			}
			ok = u.cost == r.units || u.cost == kept
		}
		if !ok {
			errs = append(errs, fmt.Sprintf("R2: reservation %s (call %s, %s, %s) counted as call %s with %s", id, r.call, fmtUnits(r.units), r.describe(), u.call, fmtUnits(u.cost)))
		}
		delete(byRes, id)
	}
	// Reservations no answer told of: a reserve whose answer did not
	// come; its client never ended it, so it expired.
	for id, us := range byRes {
		as := c.calls[us[0].call]
		switch {
		case len(as) == 0 || as[0].k.name != us[0].key:
			errs = append(errs, fmt.Sprintf("R2: reservation %s counted as call %s, which reserved no such key", id, us[0].call))
		case len(us) > 1:
			errs = append(errs, fmt.Sprintf("R2: reservation %s counted %d times", id, len(us)))
		case us[0].cost != as[0].units:
			errs = append(errs, fmt.Sprintf("R4: reservation %s of call %s, never acknowledged, counted with %s, not its reserved %s", id, us[0].call, fmtUnits(us[0].cost), fmtUnits(as[0].units)))
		}
	}
	slices.Sort(errs)
	out := make([]error, len(errs))
	for i, e := range errs {
		out[i] = errors.New(e)
	}
	return out
}

// whereIs says, for a failure's message, which node serves r's key at the
// end and how the key's latest record (the highest version written
// anywhere) holds r.
func (c *resChecker) whereIs(r *simRes) string {
	s := c.s
	var b strings.Builder
	for _, n := range s.nodes {
		if n.up && n.m.Route.Serving(r.k.part) {
			fmt.Fprintf(&b, "%s serves its key (partition %d)", n.id, r.k.part)
		}
	}
	var latest *keyrec.Record
	var where string
	consider := func(val []byte, at string) {
		if rec, err := keyrec.Decode(val); err == nil && (latest == nil || rec.Version >= latest.Version) {
			latest, where = &rec, at
		}
	}
	for _, m := range s.journal.msgs {
		jm, err := journal.Decode(m.data)
		if err != nil {
			continue
		}
		for _, it := range jm.Items {
			if it.Key == r.k.name {
				consider(it.Val, fmt.Sprintf("journal %s #%d", m.subj, m.seq))
			}
		}
	}
	for _, seq := range s.state.bySubj[r.k.name] {
		consider(s.state.msgs[seq-1].data, fmt.Sprintf("state bucket #%d", seq))
	}
	if latest == nil {
		return b.String() + "; no record of its key"
	}
	v, ok := latest.Reservation(r.seq)
	if !ok {
		return fmt.Sprintf("%s; its key's latest record (version %d, %s) does not hold it", b.String(), latest.Version, where)
	}
	if v.Outcome == keyrec.Open {
		return fmt.Sprintf("%s; its key's latest record (version %d, %s) holds it open: no sweep ended it", b.String(), latest.Version, where)
	}
	return fmt.Sprintf("%s; its key's latest record (version %d, %s) holds it %s", b.String(), latest.Version, where, v.Outcome)
}

// describe says what the checker knows of r's end.
func (r *simRes) describe() string {
	switch {
	case r.ended:
		return fmt.Sprintf("%s with %s kept", r.outcome, fmtUnits(r.settled))
	case r.endSent != 0:
		return fmt.Sprintf("%s of %s sent at %.3fs, no answer", kindName(r.endKind), fmtUnits(r.endUnits), float64(r.endSent)/1e9)
	}
	return fmt.Sprintf("abandoned, expiring at %.3fs of its owner's clock", float64(r.expHigh-epoch)/1e9)
}

// kindName names a reservation operation.
func kindName(k keys.ResKind) string {
	switch k {
	case keys.ResReserve:
		return "reserve"
	case keys.ResSettle:
		return "settle"
	case keys.ResRelease:
		return "release"
	case keys.ResRenew:
		return "renew"
	case keys.ResSweep:
		return "sweep"
	}
	return "nothing"
}

// Stats summarizes the reservation traffic.
func (c *resChecker) Stats() string {
	return fmt.Sprintf("%d reserves sent: %d reservations, %d denied; %d settle/release/renew answers, %d not found",
		c.reserves, c.admitted, c.denied, c.ends, c.notFound)
}

// units formats micro-units.
func fmtUnits(v int64) string { return string(kvstate.AppendUnits(nil, max(v, 0))) + "u" }
