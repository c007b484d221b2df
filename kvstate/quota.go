package kvstate

// Quota: at most Limit micro-units per UTC calendar period.
//
// The period holding instant t is the UTC hour, day, week (from Monday
// 00:00) or month holding t; periods partition time, so every instant is in
// exactly one. The state is the start of the period it counts (WindowStart)
// and the micro-units spent in it (Count). A request of cost c is admitted
// iff Count + c <= Limit; a new period starts empty. A time before the
// stored period's start (a clock stepping back, also across a boundary) is
// treated as inside the stored period, so stepping back and forth across a
// boundary never opens a fresh period twice.
//
// Calendar arithmetic is done on integers: days since the Unix epoch and
// the proleptic Gregorian calendar (civil dates from day numbers), with no
// time zone and no leap seconds, as Unix time itself. Instants near the
// ends of the int64 range saturate: a period starting before math.MinInt64
// starts at math.MinInt64, one ending after math.MaxInt64 ends there.

const (
	hourNs = 3600 * Second
	dayNs  = 24 * hourNs
	weekNs = 7 * dayNs
	// mondayNs is the first Monday 00:00 UTC after the Unix epoch
	// (1970-01-05; the epoch was a Thursday).
	mondayNs = 4 * dayNs
)

// floorMod returns t mod m in [0, m), for m > 0.
func floorMod(t, m int64) int64 {
	r := t % m
	if r < 0 {
		r += m
	}
	return r
}

// floorDiv returns floor(t / m), for m > 0.
func floorDiv(t, m int64) int64 {
	q := t / m
	if t%m < 0 {
		q--
	}
	return q
}

// civil returns the proleptic Gregorian date (year, month 1..12, day 1..31)
// of day z since 1970-01-01.
func civil(z int64) (y, m, d int64) {
	z += 719468 // days from 0000-03-01 to 1970-01-01
	era := floorDiv(z, 146097)
	doe := z - era*146097                                  // [0, 146096]
	yoe := (doe - doe/1460 + doe/36524 - doe/146096) / 365 // [0, 399]
	doy := doe - (365*yoe + yoe/4 - yoe/100)               // [0, 365], from March 1
	mp := (5*doy + 2) / 153                                // [0, 11], March = 0
	d = doy - (153*mp+2)/5 + 1
	m = mp + 3
	if m > 12 {
		m -= 12
	}
	y = yoe + era*400
	if m <= 2 {
		y++
	}
	return y, m, d
}

// daysIn returns the number of days of month m (1..12) of year y.
func daysIn(y, m int64) int64 {
	switch m {
	case 2:
		if y%4 == 0 && (y%100 != 0 || y%400 == 0) {
			return 29
		}
		return 28
	case 4, 6, 9, 11:
		return 30
	}
	return 31
}

// periodBounds returns the start and end (the next period's start) of the
// period p (valid) holding t, in Unix ns, saturated to the int64 range:
// start <= t < end unless end saturated at math.MaxInt64.
func periodBounds(p Period, t int64) (start, end int64) {
	var into, length int64 // how far t is into its period, and its length
	switch p {
	case Hour:
		into, length = floorMod(t, hourNs), hourNs
	case Day:
		into, length = floorMod(t, dayNs), dayNs
	case Week:
		// (t - Monday) mod week, computed without overflowing.
		into, length = floorMod(floorMod(t, weekNs)-mondayNs, weekNs), weekNs
	default: // Month
		z := floorDiv(t, dayNs)
		y, m, d := civil(z)
		into = (d-1)*dayNs + floorMod(t, dayNs)
		length = daysIn(y, m) * dayNs
	}
	return satAdd(t, -into), satAdd(t, length-into)
}

// quotaView returns a quota state's period (start, end) and the micro-units
// spent in it, as seen at now: a state of another algorithm, or of a
// period that ended at or before now, is a fresh, empty period.
func quotaView(l *Limit, s *State, now int64) (start, end, spent int64) {
	start, end = periodBounds(l.Period, now)
	if s.Algorithm != Quota || start > s.WindowStart {
		return start, end, 0
	}
	// now is in the stored period or before it: the stored period counts.
	_, end = periodBounds(l.Period, s.WindowStart)
	return s.WindowStart, end, max(s.Count, 0)
}

// decideQuota decides against *s and writes the state to store to *out.
// ResetAfter is the time to the end of the period; a denial's RetryAfter is
// the same (the next period starts empty and cost <= Limit fits in it),
// at least 1 ns.
func decideQuota(l *Limit, s *State, now, cost int64, out *State) Decision {
	start, end, spent := quotaView(l, s, now)
	d := Decision{Allowed: true, ResetAfter: sat(span(now, end))}
	switch {
	case cost <= 0:
	case cost > l.Limit:
		d.Allowed, d.RetryAfter = false, Never
	case spent > l.Limit-cost: // both sides in [0, MaxInt64]: no overflow
		d.Allowed, d.RetryAfter = false, max(d.ResetAfter, 1)
	default:
		spent += cost // <= Limit
	}
	d.Remaining = max(l.Limit-spent, 0)
	if !d.Allowed || cost <= 0 {
		*out = *s
		return d
	}
	*out = State{Algorithm: Quota, WindowStart: start, Count: spent}
	return d
}

// QuotaSpent returns the micro-units quota limit l's state s has spent in
// the UTC period containing at (Unix ns): 0 when the state's period ended
// before that period began (or s is not a quota state); ok false when the
// state is of a later period, which no longer tells at's.
func QuotaSpent(l Limit, s State, at int64) (spent int64, ok bool) {
	if l.Algorithm != Quota || !l.Period.valid() {
		return 0, false
	}
	start, _ := periodBounds(l.Period, at)
	switch {
	case s.Algorithm != Quota || s.WindowStart < start:
		return 0, true
	case s.WindowStart > start:
		return 0, false
	}
	return max(s.Count, 0), true
}
