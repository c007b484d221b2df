package kvstate

import "sort"

// Concurrency: at most Limit micro-units held at once.
//
// Each hold records its holder's id, cost and expiry (acquisition instant +
// Window), so a holder that crashes without releasing gives its slots back
// when its hold expires. Holds are kept in order of expiry. A hold counts
// while now < Expires.

// MaxHoldID is the longest holder id, in bytes, a hold can carry.
const MaxHoldID = 255

// liveHolds returns the holds of a concurrency state still held at now (a
// sub-slice of s.Holds, never written to) and their total cost.
func liveHolds(s State, now int64) (live []Hold, sum int64) {
	if s.Algorithm != Concurrency {
		return nil, 0
	}
	i := sort.Search(len(s.Holds), func(i int) bool { return s.Holds[i].Expires > now })
	live = s.Holds[i:len(s.Holds):len(s.Holds)]
	for _, h := range live {
		sum = satAdd(sum, max(h.Cost, 0))
	}
	return live, sum
}

// Acquire takes cost micro-units of a concurrency limit for holder id until
// now+l.Window, or until [Release]. A non-empty id that already holds is
// renewed: its hold is replaced by one of the new cost and expiry (so an
// acquisition retried with the same id is counted once). The empty id is
// anonymous: each acquisition is a separate hold that only expiry returns.
//
// Admitted iff the live holds plus cost stay within l.Limit and fewer than
// [MaxHolds] holds are live. When denied, RetryAfter is the ns until enough
// holds expire, assuming none is released (so an upper bound), or [Never]
// when cost exceeds l.Limit. ResetAfter is the ns until every hold has
// expired. It never mutates s. A limit that is not a usable concurrency
// limit, or an id longer than [MaxHoldID], is denied with Never.
func Acquire(l Limit, s State, now int64, id string, cost int64) (Decision, State) {
	return AcquireUntil(l, s, now, id, cost, satAdd(now, l.Window))
}

// AcquireUntil is [Acquire] with the hold's expiry given: expires, at most
// now+l.Window (a reservation's hold lasts its ttl, CONTRACT §10).
func AcquireUntil(l Limit, s State, now int64, id string, cost, expires int64) (Decision, State) {
	if l.Algorithm != Concurrency || !l.usable() || len(id) > MaxHoldID {
		return Decision{RetryAfter: Never}, s
	}
	live, sum := liveHolds(s, now)
	own := -1
	if id != "" {
		for i, h := range live {
			if h.ID == id {
				own = i
				sum -= max(h.Cost, 0)
				break
			}
		}
	}
	n := len(live)
	if own >= 0 {
		n--
	}
	d := Decision{Allowed: true}
	switch {
	case cost <= 0:
	case cost > l.Limit:
		d.Allowed, d.RetryAfter = false, Never
	case sum > l.Limit-cost || n >= MaxHolds:
		d.Allowed = false
		d.RetryAfter = max(sat(span(now, holdRetryAt(l, live, own, sum, n, cost))), 1)
	default:
		sum += cost
	}
	d.Remaining = max(l.Limit-sum, 0)
	if !d.Allowed || cost <= 0 {
		if k := len(live); k > 0 {
			d.ResetAfter = sat(span(now, live[k-1].Expires))
		}
		return d, s
	}
	exp := min(expires, satAdd(now, l.Window))
	holds := make([]Hold, 0, n+1)
	for i, h := range live {
		if i != own {
			holds = append(holds, h)
		}
	}
	at := sort.Search(len(holds), func(i int) bool { return holds[i].Expires > exp })
	holds = append(holds, Hold{})
	copy(holds[at+1:], holds[at:])
	holds[at] = Hold{ID: id, Cost: cost, Expires: exp}
	d.ResetAfter = sat(span(now, holds[len(holds)-1].Expires))
	return d, State{Algorithm: Concurrency, Holds: holds}
}

// holdRetryAt returns the first expiry after which cost fits, skipping the
// caller's own hold (own, or -1), which an acquisition replaces.
func holdRetryAt(l Limit, live []Hold, own int, sum int64, n int, cost int64) int64 {
	for j, h := range live {
		if j == own {
			continue
		}
		sum -= max(h.Cost, 0)
		n--
		if sum <= l.Limit-cost && n < MaxHolds {
			return h.Expires
		}
	}
	return maxInt64
}

// Release gives back the slots held by id (every hold with that id) and
// drops expired holds. An unknown or empty id releases nothing. It never
// mutates s; when nothing changes it returns s itself.
func Release(s State, now int64, id string) State {
	if s.Algorithm != Concurrency {
		return s
	}
	live, _ := liveHolds(s, now)
	found := false
	if id != "" {
		for _, h := range live {
			if h.ID == id {
				found = true
				break
			}
		}
	}
	if !found && len(live) == len(s.Holds) {
		return s
	}
	var holds []Hold
	for _, h := range live {
		if !found || h.ID != id {
			holds = append(holds, h)
		}
	}
	return State{Algorithm: Concurrency, Holds: holds}
}

// Extend moves the expiry of id's live hold to expires (a renewed
// reservation) and drops expired holds; false when id holds nothing live.
// It never mutates s.
func Extend(s State, now int64, id string, expires int64) (State, bool) {
	if s.Algorithm != Concurrency || id == "" {
		return s, false
	}
	live, _ := liveHolds(s, now)
	own := -1
	for i, h := range live {
		if h.ID == id {
			own = i
			break
		}
	}
	if own < 0 {
		return s, false
	}
	h := live[own]
	h.Expires = expires
	holds := make([]Hold, 0, len(live))
	for i, x := range live {
		if i != own {
			holds = append(holds, x)
		}
	}
	at := sort.Search(len(holds), func(i int) bool { return holds[i].Expires > expires })
	holds = append(holds, Hold{})
	copy(holds[at+1:], holds[at:])
	holds[at] = h
	return State{Algorithm: Concurrency, Holds: holds}, true
}
