package kvstate

// Fixed and sliding windows.
//
// Windows are aligned to multiples of Window since the Unix epoch: the
// window holding instant t starts at floor(t/Window)*Window. A time before
// the stored window is treated as inside it (a clock stepping backwards
// never opens a new window, so it never creates capacity).

// alignDown returns the start of the window of width w (> 0) holding t,
// saturated at math.MinInt64.
func alignDown(t, w int64) int64 {
	m := t % w
	if m < 0 {
		m += w
	}
	if t < minInt64+m {
		return minInt64
	}
	return t - m
}

// fwView returns a fixed_window state's current window and count at now.
func fwView(l *Limit, s *State, now int64) (start, count int64) {
	cur := alignDown(now, l.Window)
	if s.Algorithm != FixedWindow || cur > s.WindowStart {
		return cur, 0
	}
	return s.WindowStart, max(s.Count, 0)
}

func decideFixedWindow(l *Limit, s *State, now, cost int64, out *State) Decision {
	start, count := fwView(l, s, now)
	end := satAdd(start, l.Window)
	d := Decision{Allowed: true, ResetAfter: sat(span(now, end))}
	switch {
	case cost <= 0:
	case cost > l.Limit:
		d.Allowed, d.RetryAfter = false, Never
	case count > l.Limit-cost:
		// The next window starts empty and cost <= Limit fits in it.
		d.Allowed, d.RetryAfter = false, d.ResetAfter
	default:
		count += cost
	}
	d.Remaining = max(l.Limit-count, 0)
	if !d.Allowed || cost <= 0 {
		*out = *s
		return d
	}
	*out = State{Algorithm: FixedWindow, WindowStart: start, Count: count}
	return d
}

// swView returns a sliding_window state's current window start, current
// count and previous count at now.
func swView(l *Limit, s *State, now int64) (start, cur, prev int64) {
	start = alignDown(now, l.Window)
	if s.Algorithm != SlidingWindow {
		return start, 0, 0
	}
	if start <= s.WindowStart {
		return s.WindowStart, max(s.Count, 0), max(s.Prev, 0)
	}
	if start == satAdd(s.WindowStart, l.Window) {
		return start, 0, max(s.Count, 0)
	}
	return start, 0, 0
}

// swWeighted returns ceil(prev*(W-elapsed)/W): the previous window's count
// weighted by the part of it still inside the trailing window, rounded up so
// that the estimate never under-counts. elapsed is clamped to [0, W).
func swWeighted(l *Limit, start, prev, now int64) int64 {
	if prev == 0 {
		return 0
	}
	elapsed := min(span(start, now), uint64(l.Window-1))
	return mul64(uint64(prev), uint64(l.Window)-elapsed).divCeil(uint64(l.Window)).int64()
}

// decideSlidingWindow applies the two-window estimate (§7):
//
//	estimate = cur + ceil(prev * (W - elapsed) / W)
//
// and admits cost iff estimate + cost <= Limit.
func decideSlidingWindow(l *Limit, s *State, now, cost int64, out *State) Decision {
	start, cur, prev := swView(l, s, now)
	end := satAdd(start, l.Window)
	est := satAdd(cur, swWeighted(l, start, prev, now))
	d := Decision{Allowed: true, ResetAfter: sat(span(now, end))}
	switch {
	case cost <= 0:
	case cost > l.Limit:
		d.Allowed, d.RetryAfter = false, Never
	case est > l.Limit-cost:
		d.Allowed = false
		d.RetryAfter = max(sat(span(now, swRetryAt(l, start, cur, prev, cost))), 1)
	default:
		cur += cost
		est += cost
	}
	d.Remaining = max(l.Limit-est, 0)
	if !d.Allowed || cost <= 0 {
		*out = *s
		return d
	}
	*out = State{Algorithm: SlidingWindow, WindowStart: start, Count: cur, Prev: prev}
	return d
}

// swRetryAt returns the first instant at which cost (<= Limit) is admitted
// with no other traffic, given a denial in the window [start, start+W) with
// counts cur and prev.
//
// Within the window, at instant t the estimate is
// cur + ceil(prev*(start+W-t)/W), which fits iff
// prev*(start+W-t) <= k*W with k = Limit-cur-cost, i.e.
// t >= start+W - floor(k*W/prev). If k < 0 it never fits in this window;
// in the next one cur becomes the previous count and the same reasoning
// gives t >= start+2W - floor((Limit-cost)*W/cur), no earlier than start+W.
func swRetryAt(l *Limit, start, cur, prev, cost int64) int64 {
	w := uint64(l.Window)
	end := satAdd(start, l.Window)
	if k := satAdd(l.Limit-cost, -cur); k >= 0 && prev > 0 {
		q, _ := mul64(uint64(k), w).divmod(uint64(prev))
		return satAdd(end, -q.int64())
	}
	if cur == 0 {
		return end
	}
	q, _ := mul64(uint64(l.Limit-cost), w).divmod(uint64(cur))
	if !q.less(from64(w)) {
		return end
	}
	return satAdd(end, l.Window-int64(q.lo))
}
