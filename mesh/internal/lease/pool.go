package lease

// The holder's side at a node: a Pool is one limit key's grants that this
// node holds from the key's owner. The node spends them for the plain
// decide requests it receives (Spend) and carves sub-grants from them for
// the gateways (SDK holders) of its region (Carve), which report and
// return to it (SubReport); it reports its own grants' use to the owner
// and returns them (Due, Drain). A Pool is not safe for concurrent use
// (the node holds a lock around it). Instants are the node's monotonic
// clock, ns.
//
// What the owner sees of a held grant: Used, the units this node spent
// itself plus the units of the sub-grants it carved and that were not
// given back. So what gateways spend is within their sub-grants, what
// those hold is within this node's grants, and the owner's bound covers
// both levels (a sub-grant ends no later than the grant it came from).

// Held is a grant this node holds from the owner.
type Held struct {
	ID       uint64
	Epoch    uint64
	Units    int64 // micro-units granted
	Used     int64 // spent here or carved into sub-grants still out
	Reported int64 // Used as last sent to the owner
	Deadline int64 // spending stops (HolderDeadline of the request's send instant)
	// Stale: the owner refused a report (a new owner, or the grant is
	// gone): spend it to its deadline, report nothing more.
	Stale bool
	subs  int // sub-grants of it still out
}

// Left returns the micro-units of h not yet used.
func (h *Held) Left() int64 { return h.Units - h.Used }

// Sub is a sub-grant carved from a held grant for a gateway.
type Sub struct {
	ID       uint64 // unique on this node (its pools share a sequence)
	Epoch    uint64 // the held grant's epoch
	Grant    uint64 // the held grant's id
	Holder   string
	Units    int64
	Spent    int64 // cumulative spend the gateway reported
	Deadline int64 // the held grant's deadline
}

// Pool is one key's held grants and sub-grants.
type Pool struct {
	p      Params
	held   []Held
	subs   []Sub
	nextID func() uint64 // the node's sub-grant ids
	// acquiring: a request to the owner is in flight.
	acquiring bool
	// deniedUntil: the owner answered Exhausted; requests are denied
	// here until then. remoteUntil: Full or no answer; requests are
	// decided by the owner (strict) until then.
	deniedUntil int64
	remoteUntil int64
	lastUse     int64
	lastReport  int64
	// least is the cost (or sub-grant minimum) last asked of the pool: a
	// grant holding less serves nothing and is given back.
	least int64
}

// NewPool returns an empty pool for a policy's params; nextID returns the
// node's next sub-grant id (shared by its pools, so a sub-grant id names
// one sub-grant of the node; it must be safe for concurrent use).
func NewPool(p Params, nextID func() uint64) *Pool { return &Pool{p: p, nextID: nextID} }

// SetParams changes the pool's params (a new revision of the policy);
// grants held keep their deadlines.
func (pl *Pool) SetParams(p Params) { pl.p = p }

// Params returns the pool's params.
func (pl *Pool) Params() Params { return pl.p }

// Held returns the grants held (for tests and metrics; do not modify).
func (pl *Pool) Held() []Held { return pl.held }

// Subs returns the sub-grants out (do not modify).
func (pl *Pool) Subs() []Sub { return pl.subs }

// Available returns the micro-units held that can still be spent at now.
func (pl *Pool) Available(now int64) int64 {
	var sum int64
	for i := range pl.held {
		if now < pl.held[i].Deadline {
			sum += pl.held[i].Left()
		}
	}
	return sum
}

// SpendResult is how a Spend was decided.
type SpendResult uint8

const (
	// Spent from a held grant.
	Spent SpendResult = iota + 1
	// Denied here: the owner said the key's limits lack the units
	// (Exhausted) less than DeniedFor ago.
	Denied
	// Remote: no held grant has the units; decide at the owner.
	Remote
)

// Spend spends cost micro-units at now from the held grant that ends
// first among those that hold it. Left is what that grant holds after.
func (pl *Pool) Spend(now, cost int64) (r SpendResult, left, retryAfter int64) {
	pl.lastUse, pl.least = now, cost
	best := -1
	for i := range pl.held {
		h := &pl.held[i]
		if now < h.Deadline && h.Left() >= cost && (best < 0 || h.Deadline < pl.held[best].Deadline) {
			best = i
		}
	}
	if best >= 0 {
		h := &pl.held[best]
		h.Used += cost
		return Spent, h.Left(), 0
	}
	if now < pl.deniedUntil {
		return Denied, 0, pl.deniedUntil - now
	}
	return Remote, 0, 0
}

// Carve makes a sub-grant for holder at now of up to want micro-units
// (at least least) from the held grant that ends last among those that
// hold least units and end at least a quarter ttl from now. ok is false
// when none does.
func (pl *Pool) Carve(now int64, holder string, want, least int64) (Sub, bool) {
	least = max(least, 1)
	pl.lastUse, pl.least = now, least
	want = max(min(want, pl.p.Size), least)
	best := -1
	for i := range pl.held {
		h := &pl.held[i]
		if h.Deadline-now >= pl.p.TTL/4 && h.Left() >= least && (best < 0 || h.Deadline > pl.held[best].Deadline) {
			best = i
		}
	}
	if best < 0 {
		return Sub{}, false
	}
	h := &pl.held[best]
	units := min(want, h.Left())
	h.Used += units
	h.subs++
	s := Sub{ID: pl.nextID(), Epoch: h.Epoch, Grant: h.ID, Holder: holder, Units: units, Deadline: h.Deadline}
	pl.subs = append(pl.subs, s)
	return s, true
}

// SubReport applies a gateway's report (or, with ret, return) of
// sub-grant id in epoch: the spend is recorded; a return gives Units −
// spend back to the held grant, if it is still held. Errors:
// ErrUnknownGrant (no such sub-grant out: expired, returned, another
// epoch), ErrBadSpend.
func (pl *Pool) SubReport(now int64, id, epoch uint64, spent int64, ret bool) error {
	at := -1
	for i := range pl.subs {
		if pl.subs[i].ID == id && pl.subs[i].Epoch == epoch && now < pl.subs[i].Deadline {
			at = i
			break
		}
	}
	if at < 0 {
		return ErrUnknownGrant
	}
	s := &pl.subs[at]
	if spent < 0 || spent > s.Units {
		return ErrBadSpend
	}
	s.Spent = max(s.Spent, spent)
	if !ret {
		return nil
	}
	for i := range pl.held {
		h := &pl.held[i]
		if h.ID == s.Grant && h.Epoch == s.Epoch {
			h.Used -= s.Units - s.Spent
			h.subs--
			break
		}
	}
	pl.subs = append(pl.subs[:at], pl.subs[at+1:]...)
	return nil
}

// WantAcquire reports whether the node should ask the owner for a grant
// now: none is being asked for, the owner's last refusal has run out, the
// key was used within a quarter ttl (a pool idle that long returns its
// grants, Due: asking for one then would return it at the next look), and
// what is held for at least another quarter ttl, in grants holding at
// least the last cost asked, is under half a grant. It returns the
// micro-units to ask for (Size) and marks the pool acquiring.
func (pl *Pool) WantAcquire(now int64) (int64, bool) {
	if pl.acquiring || now < pl.deniedUntil || now < pl.remoteUntil || now-pl.lastUse >= pl.p.TTL/4 {
		return 0, false
	}
	var lasting int64
	for i := range pl.held {
		if h := &pl.held[i]; h.Deadline-now >= pl.p.TTL/4 && h.Left() >= max(pl.least, 1) {
			lasting += h.Left()
		}
	}
	if lasting >= pl.p.Size/2 || pl.heldUnits() >= pl.p.MaxOutstanding {
		return 0, false
	}
	pl.acquiring = true
	return pl.p.Size, true
}

func (pl *Pool) heldUnits() int64 {
	var sum int64
	for i := range pl.held {
		sum += pl.held[i].Left()
	}
	return sum
}

// Acquiring reports whether a request to the owner is in flight.
func (pl *Pool) Acquiring() bool { return pl.acquiring }

// Granted adds a grant the owner made in answer to a request sent at
// sent (this node's clock): it is spent until HolderDeadline(sent, ttl).
func (pl *Pool) Granted(sent int64, id, epoch uint64, units, ttl int64) {
	pl.acquiring = false
	pl.deniedUntil, pl.remoteUntil = 0, 0
	pl.held = append(pl.held, Held{ID: id, Epoch: epoch, Units: units, Deadline: HolderDeadline(sent, ttl)})
}

// Refused records the owner's refusal at now: Exhausted denies here for
// retryAfter (at most a ttl; kvstate.Never: decide remotely instead), Full
// (or no answer: outcome 0) decides remotely for retryAfter, at most a
// quarter ttl.
func (pl *Pool) Refused(now int64, o Outcome, retryAfter int64) {
	pl.acquiring = false
	switch {
	case o == Exhausted && retryAfter > 0:
		pl.deniedUntil = now + min(retryAfter, pl.p.TTL)
	default:
		if retryAfter <= 0 {
			retryAfter = pl.p.TTL / 20
		}
		pl.remoteUntil = now + max(min(retryAfter, pl.p.TTL/4), 1)
	}
}

// Due returns, at now, the held grants to return (their deadline passed;
// used up (holding less than the last cost asked) with no sub-grant out:
// it only counts against max_outstanding;
// or unused for a quarter ttl with no sub-grant out: another holder may
// need the units), removed from the pool, and the held grants to report
// (Used changed since the last report, at most once a quarter ttl), marked
// reported, and the ids of the sub-grants that ended (dropped: their
// units stay used).
func (pl *Pool) Due(now int64) (returns, reports []Held, ended []uint64) {
	subs := pl.subs[:0]
	for _, s := range pl.subs {
		if now < s.Deadline {
			subs = append(subs, s)
		} else {
			ended = append(ended, s.ID)
		}
	}
	clear(pl.subs[len(subs):])
	pl.subs = subs
	idle := now-pl.lastUse >= pl.p.TTL/4
	keep := pl.held[:0]
	for _, h := range pl.held {
		if now >= h.Deadline || h.subs == 0 && (idle || h.Left() < max(pl.least, 1)) {
			returns = append(returns, h)
			continue
		}
		keep = append(keep, h)
	}
	clear(pl.held[len(keep):])
	pl.held = keep
	if now-pl.lastReport >= pl.p.TTL/4 {
		for i := range pl.held {
			h := &pl.held[i]
			if !h.Stale && h.Used != h.Reported {
				h.Reported = h.Used
				reports = append(reports, *h)
			}
		}
		if len(reports) > 0 {
			pl.lastReport = now
		}
	}
	return returns, reports, ended
}

// MarkStale records that the owner refused a report of grant id: it is
// spent to its deadline and not reported again.
func (pl *Pool) MarkStale(id, epoch uint64) {
	for i := range pl.held {
		if pl.held[i].ID == id && pl.held[i].Epoch == epoch {
			pl.held[i].Stale = true
		}
	}
}

// Drain removes and returns every held grant (the node stops): their
// sub-grants stay with the gateways until they end, counted as used.
func (pl *Pool) Drain() []Held {
	h := pl.held
	pl.held = nil
	return h
}

// Refusal returns how requests are decided at now when no held grant has
// their units: Denied until the owner's Exhausted answer runs out (and for
// how long), else Remote.
func (pl *Pool) Refusal(now int64) (SpendResult, int64) {
	if now < pl.deniedUntil {
		return Denied, pl.deniedUntil - now
	}
	return Remote, 0
}

// Backoff reports whether the owner's last refusal (or failure) still
// keeps the pool from asking for a grant at now.
func (pl *Pool) Backoff(now int64) bool { return now < pl.deniedUntil || now < pl.remoteUntil }

// LastUse returns the instant of the last Spend or Carve.
func (pl *Pool) LastUse() int64 { return pl.lastUse }

// Idle reports whether the pool holds nothing and asks for nothing: it
// may be forgotten.
func (pl *Pool) Idle() bool { return len(pl.held) == 0 && len(pl.subs) == 0 && !pl.acquiring }
