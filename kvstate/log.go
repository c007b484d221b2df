package kvstate

import "sort"

// Sliding log (§6): the exact trailing window.
//
// An entry admitted at instant t counts while t > now-Window, so it expires
// exactly at t+Window. A request of cost c is admitted iff the live entries'
// costs plus c stay within Limit and fewer than MaxLogEntries entries are
// live; a full log denies until its oldest entry expires. Entries are kept
// oldest first. A time before the newest entry is treated as that entry's
// instant (the latest the state has seen), so a clock stepping backwards
// never records an entry out of order.

// logLive returns the live entries of a sliding_log state at now (a
// sub-slice of s.Log, never written to), their total cost and the effective
// instant.
func logLive(l Limit, s State, now int64) (live []LogEntry, sum, eff int64) {
	if s.Algorithm != SlidingLog {
		return nil, 0, now
	}
	eff = now
	if n := len(s.Log); n > 0 && s.Log[n-1].At > eff {
		eff = s.Log[n-1].At
	}
	cut := satAdd(eff, -l.Window) // expired iff At <= cut
	i := sort.Search(len(s.Log), func(i int) bool { return s.Log[i].At > cut })
	live = s.Log[i:len(s.Log):len(s.Log)]
	for _, e := range live {
		sum = satAdd(sum, max(e.Cost, 0))
	}
	return live, sum, eff
}

func decideSlidingLog(l Limit, s State, now, cost int64) (Decision, State) {
	live, sum, eff := logLive(l, s, now)
	d := Decision{Allowed: true}
	switch {
	case cost <= 0:
	case cost > l.Limit:
		d.Allowed, d.RetryAfter = false, Never
	case sum > l.Limit-cost || len(live) >= MaxLogEntries:
		d.Allowed = false
		d.RetryAfter = max(sat(span(now, logRetryAt(l, live, sum, cost))), 1)
	default:
		sum += cost
	}
	d.Remaining = max(l.Limit-sum, 0)
	if !d.Allowed || cost <= 0 {
		if n := len(live); n > 0 {
			d.ResetAfter = sat(span(now, satAdd(live[n-1].At, l.Window)))
		}
		return d, s
	}
	log := make([]LogEntry, len(live)+1)
	copy(log, live)
	log[len(live)] = LogEntry{At: eff, Cost: cost}
	d.ResetAfter = sat(span(now, satAdd(eff, l.Window)))
	return d, State{Algorithm: SlidingLog, Log: log}
}

// logRetryAt returns the first instant at which cost fits once the oldest
// entries have expired: the expiry of the first entry whose removal, with
// every older one, leaves room. live is non-empty when a denial happened
// with cost <= Limit.
func logRetryAt(l Limit, live []LogEntry, sum, cost int64) int64 {
	for j, e := range live {
		sum -= max(e.Cost, 0)
		if sum <= l.Limit-cost && len(live)-(j+1) < MaxLogEntries {
			return satAdd(e.At, l.Window)
		}
	}
	// Unreachable for cost <= Limit: an empty log admits.
	return maxInt64
}
