package kvstate

import (
	"math"
	"math/big"
	"reflect"
	"testing"
	"time"

	"pgregory.net/rapid"
)

// utc returns the Unix ns of a UTC wall-clock instant.
func utc(y int, m time.Month, d, h, min, sec, nsec int) int64 {
	return time.Date(y, m, d, h, min, sec, nsec, time.UTC).UnixNano()
}

const dayT = 24 * 3600 * Second

// qstep is one request of a quota timeline at an absolute instant.
type qstep struct {
	at        int64
	cost      int64
	allowed   bool
	remaining int64
	retry     int64
	reset     int64
}

// runQuota decides each step in order, checking every field of every
// decision, and returns the final state.
func runQuota(t *testing.T, l Limit, s State, steps []qstep) State {
	t.Helper()
	for i, st := range steps {
		d, ns := Decide(l, s, st.at, st.cost)
		want := Decision{Allowed: st.allowed, Remaining: st.remaining, RetryAfter: st.retry, ResetAfter: st.reset}
		if d != want {
			t.Fatalf("step %d (%s, cost %d):\n got %+v\nwant %+v", i, time.Unix(0, st.at).UTC().Format(time.RFC3339Nano), st.cost, d, want)
		}
		if !d.Allowed && !reflect.DeepEqual(ns, s) {
			t.Fatalf("step %d: a denial changed the state: %+v -> %+v", i, s, ns)
		}
		s = ns
	}
	return s
}

func TestQuotaMonthSteps(t *testing.T) {
	l := Limit{Algorithm: Quota, Limit: 10 * Unit, Period: Month}
	jan31 := utc(2024, 1, 31, 23, 59, 59, 999_999_999)
	feb1 := utc(2024, 2, 1, 0, 0, 0, 0)
	mar1 := utc(2024, 3, 1, 0, 0, 0, 0)
	apr1 := utc(2024, 4, 1, 0, 0, 0, 0)
	may1 := utc(2024, 5, 1, 0, 0, 0, 0)
	runQuota(t, l, State{}, []qstep{
		// A never-seen key probes as empty; the period ends at Feb 1.
		{at: jan31, cost: 0, allowed: true, remaining: 10 * Unit, reset: 1},
		// The whole limit in the last nanosecond of January.
		{at: jan31, cost: 10 * Unit, allowed: true, remaining: 0, reset: 1},
		{at: jan31, cost: 1, retry: 1, reset: 1},
		// Full again exactly at the boundary: February 2024 has 29 days.
		{at: feb1, cost: 10 * Unit, allowed: true, remaining: 0, reset: 29 * dayT},
		{at: utc(2024, 2, 29, 12, 0, 0, 0), cost: Unit, retry: 12 * 3600 * Second, reset: 12 * 3600 * Second},
		// The clock steps back across the boundary into January: still
		// February's period, never a fresh January.
		{at: jan31, cost: Unit, retry: mar1 - jan31, reset: mar1 - jan31},
		{at: feb1 - 3600*Second, cost: Unit, retry: mar1 - feb1 + 3600*Second, reset: mar1 - feb1 + 3600*Second},
		// More than the limit never fits.
		{at: feb1, cost: 10*Unit + 1, retry: Never, reset: mar1 - feb1},
		// One nanosecond before March: still denied.
		{at: mar1 - 1, cost: 10 * Unit, retry: 1, reset: 1},
		// March: 31 days, decimal costs.
		{at: mar1, cost: 2_500_001, allowed: true, remaining: 7_499_999, reset: 31 * dayT},
		{at: mar1 + 1, cost: 7_499_999, allowed: true, remaining: 0, reset: 31*dayT - 1},
		// April: 30 days.
		{at: apr1, cost: 10 * Unit, allowed: true, remaining: 0, reset: 30 * dayT},
		{at: may1 - 1, cost: 1, retry: 1, reset: 1},
		{at: may1, cost: 4 * Unit, allowed: true, remaining: 6 * Unit, reset: 31 * dayT},
	})
}

func TestQuotaMonthLengths(t *testing.T) {
	// Each month's length, leap years by the Gregorian rules (2000 and
	// 2024 leap, 1900, 2023 and 2100 not), December to January.
	cases := []struct {
		y    int
		m    time.Month
		days int64
	}{
		{2023, 2, 28}, {2024, 2, 29}, {2000, 2, 29}, {1900, 2, 28}, {2100, 2, 28},
		{2024, 1, 31}, {2024, 4, 30}, {2024, 6, 30}, {2024, 7, 31}, {2024, 8, 31},
		{2024, 9, 30}, {2024, 11, 30}, {2024, 12, 31}, {1969, 12, 31}, {1970, 1, 31},
		{1960, 2, 29}, {1700, 2, 28}, {2262, 2, 28},
	}
	for _, c := range cases {
		start := utc(c.y, c.m, 1, 0, 0, 0, 0)
		for _, at := range []int64{start, start + 1, start + c.days*dayT/2, start + c.days*dayT - 1} {
			s, e := periodBounds(Month, at)
			if s != start || e != start+c.days*dayT {
				t.Errorf("%d-%02d at +%d ns: period [%d, %d), want [%d, +%d days)", c.y, c.m, at-start, s, e, start, c.days)
			}
		}
	}
	// December 31 to January 1 with a quota.
	l := Limit{Algorithm: Quota, Limit: 5 * Unit, Period: Month}
	dec31 := utc(2024, 12, 31, 23, 59, 59, 500_000_000)
	jan1 := utc(2025, 1, 1, 0, 0, 0, 0)
	runQuota(t, l, State{}, []qstep{
		{at: dec31, cost: 5 * Unit, allowed: true, remaining: 0, reset: 500 * ms},
		{at: jan1 - 1, cost: 5 * Unit, retry: 1, reset: 1},
		{at: jan1, cost: 5 * Unit, allowed: true, remaining: 0, reset: 31 * dayT},
		// Back to December: January's period.
		{at: dec31, cost: 1, retry: 31*dayT + 500*ms, reset: 31*dayT + 500*ms},
	})
}

func TestQuotaWeekSteps(t *testing.T) {
	l := Limit{Algorithm: Quota, Limit: 5 * Unit, Period: Week}
	sun := utc(2024, 1, 7, 23, 59, 59, 0) // a Sunday
	mon := utc(2024, 1, 8, 0, 0, 0, 0)    // the next Monday
	runQuota(t, l, State{}, []qstep{
		{at: sun, cost: 5 * Unit, allowed: true, remaining: 0, reset: Second},
		{at: mon - 1, cost: 1, retry: 1, reset: 1},
		{at: mon, cost: 5 * Unit, allowed: true, remaining: 0, reset: 7 * dayT},
		// Wednesday of the same week: the week's count.
		{at: mon + 2*dayT, cost: 1, retry: 5 * dayT, reset: 5 * dayT},
	})
	// Weeks start on Monday whatever the year: 2024-12-30 is a Monday and
	// its week runs into 2025; 1970-01-01 (a Thursday) is in the week of
	// Monday 1969-12-29; 1900-01-01 was a Monday.
	for _, c := range []struct{ at, start int64 }{
		{utc(2025, 1, 1, 12, 0, 0, 0), utc(2024, 12, 30, 0, 0, 0, 0)},
		{utc(2025, 1, 5, 23, 59, 59, 999_999_999), utc(2024, 12, 30, 0, 0, 0, 0)},
		{utc(2025, 1, 6, 0, 0, 0, 0), utc(2025, 1, 6, 0, 0, 0, 0)},
		{0, utc(1969, 12, 29, 0, 0, 0, 0)},
		{utc(1970, 1, 5, 0, 0, 0, 0) - 1, utc(1969, 12, 29, 0, 0, 0, 0)},
		{utc(1970, 1, 5, 0, 0, 0, 0), utc(1970, 1, 5, 0, 0, 0, 0)},
		{utc(1900, 1, 3, 5, 0, 0, 0), utc(1900, 1, 1, 0, 0, 0, 0)},
	} {
		if s, e := periodBounds(Week, c.at); s != c.start || e != c.start+7*dayT {
			t.Errorf("week of %s: [%d, %d), want [%d, +7 days)", time.Unix(0, c.at).UTC(), s, e, c.start)
		}
	}
}

func TestQuotaDayAndHourSteps(t *testing.T) {
	day := Limit{Algorithm: Quota, Limit: 3 * Unit, Period: Day}
	feb28 := utc(2024, 2, 28, 23, 59, 59, 999_999_999)
	feb29 := utc(2024, 2, 29, 0, 0, 0, 0)
	runQuota(t, day, State{}, []qstep{
		{at: feb28, cost: 3 * Unit, allowed: true, remaining: 0, reset: 1},
		{at: feb29, cost: 3 * Unit, allowed: true, remaining: 0, reset: dayT},
		{at: feb29 + dayT - 1, cost: 1, retry: 1, reset: 1},
		{at: feb29 + dayT, cost: 1, allowed: true, remaining: 3*Unit - 1, reset: dayT},
	})
	hour := Limit{Algorithm: Quota, Limit: 2 * Unit, Period: Hour}
	h := utc(2024, 3, 10, 14, 0, 0, 0)
	runQuota(t, hour, State{}, []qstep{
		{at: h + 59*60*Second, cost: 2 * Unit, allowed: true, remaining: 0, reset: 60 * Second},
		{at: h + 3600*Second - 1, cost: 1, retry: 1, reset: 1},
		// Stepping back within the hour.
		{at: h, cost: 1, retry: 3600 * Second, reset: 3600 * Second},
		{at: h + 3600*Second, cost: 2 * Unit, allowed: true, remaining: 0, reset: 3600 * Second},
		// Back across the boundary: the new hour's period, not the old one.
		{at: h + 3600*Second - 1, cost: 1, retry: 3600*Second + 1, reset: 3600*Second + 1},
		{at: h + 7200*Second, cost: 1, allowed: true, remaining: 2*Unit - 1, reset: 3600 * Second},
	})
}

// TestQuotaBackwardsNeverReopens: a quota exhausted in one period, then a
// new period, then the clock back in the old one: the old period is never
// opened again, however the clock moves after.
func TestQuotaBackwardsNeverReopens(t *testing.T) {
	l := Limit{Algorithm: Quota, Limit: 10 * Unit, Period: Day}
	d1 := utc(2024, 6, 1, 0, 0, 0, 0)
	d2 := d1 + dayT
	runQuota(t, l, State{}, []qstep{
		{at: d2 - Second, cost: 10 * Unit, allowed: true, remaining: 0, reset: Second},
		{at: d2, cost: 4 * Unit, allowed: true, remaining: 6 * Unit, reset: dayT},
		// Back into day 1: counted in day 2 (6 left), not a fresh day 1.
		{at: d2 - Second, cost: 6 * Unit, allowed: true, remaining: 0, reset: dayT + Second},
		{at: d2 - 2*Second, cost: 1, retry: dayT + 2*Second, reset: dayT + 2*Second},
		{at: d2 + 1, cost: 1, retry: dayT - 1, reset: dayT - 1},
		{at: d2 + dayT, cost: 10 * Unit, allowed: true, remaining: 0, reset: dayT},
	})
}

func TestQuotaLargeLimits(t *testing.T) {
	// 1e12 units, decimal costs: every sum exact, nothing overflows.
	l := Limit{Algorithm: Quota, Limit: MaxQuotaTest, Period: Month}
	at := utc(2026, 12, 3, 0, 0, 0, 0)
	end := utc(2027, 1, 1, 0, 0, 0, 0)
	runQuota(t, l, State{}, []qstep{
		{at: at, cost: MaxQuotaTest - 1_500_001, allowed: true, remaining: 1_500_001, reset: end - at},
		{at: at, cost: 1_500_000, allowed: true, remaining: 1, reset: end - at},
		{at: at, cost: 2, remaining: 1, retry: end - at, reset: end - at},
		{at: at, cost: 1, allowed: true, remaining: 0, reset: end - at},
		{at: at, cost: math.MaxInt64, retry: Never, reset: end - at},
		{at: end, cost: MaxQuotaTest, allowed: true, remaining: 0, reset: 31 * dayT},
	})
	// The largest limit the type holds.
	huge := Limit{Algorithm: Quota, Limit: math.MaxInt64, Period: Hour}
	s := runQuota(t, huge, State{}, []qstep{
		{at: at, cost: math.MaxInt64 - 5, allowed: true, remaining: 5, reset: 3600 * Second},
		{at: at, cost: 5, allowed: true, remaining: 0, reset: 3600 * Second},
		{at: at, cost: 1, retry: 3600 * Second, reset: 3600 * Second},
		{at: at, cost: math.MaxInt64, retry: 3600 * Second, reset: 3600 * Second},
	})
	// A corrupt spent count above the limit denies and reports 0 left.
	s.Count = math.MaxInt64
	if d, _ := Decide(l, s, at, 1); d.Allowed || d.Remaining != 0 {
		t.Fatalf("over-spent state: %+v", d)
	}
}

func TestQuotaExtremeInstants(t *testing.T) {
	// Periods at the ends of the int64 range saturate and never panic.
	for _, p := range []Period{Hour, Day, Week, Month} {
		l := Limit{Algorithm: Quota, Limit: Unit, Period: p}
		for _, now := range []int64{math.MinInt64, math.MinInt64 + 1, -1, 0, math.MaxInt64 - 1, math.MaxInt64} {
			start, end := periodBounds(p, now)
			if start > now || (end <= now && end != math.MaxInt64) {
				t.Errorf("%s at %d: [%d, %d)", p, now, start, end)
			}
			d, s := Decide(l, State{}, now, Unit)
			if !d.Allowed {
				t.Errorf("%s at %d: fresh quota denied: %+v", p, now, d)
			}
			d, _ = Decide(l, s, now, 1)
			if d.Allowed || d.RetryAfter <= 0 {
				t.Errorf("%s at %d: exhausted quota: %+v", p, now, d)
			}
		}
	}
}

func TestQuotaValidate(t *testing.T) {
	if err := (Limit{Algorithm: Quota, Limit: Unit, Period: Week}).Validate(); err != nil {
		t.Fatal(err)
	}
	for _, l := range []Limit{
		{Algorithm: Quota, Limit: Unit},
		{Algorithm: Quota, Limit: Unit, Period: 5},
		{Algorithm: Quota, Limit: 0, Period: Day},
		{Algorithm: Quota, Limit: -1, Period: Day, Window: Second},
	} {
		if err := l.Validate(); err == nil {
			t.Errorf("Validate(%+v) = nil", l)
		}
		d, ns := Decide(l, State{Algorithm: Quota, Count: 1}, t0, Unit)
		if d.Allowed || d.RetryAfter != Never || ns.Count != 1 {
			t.Errorf("Decide(%+v) = %+v, %+v; want a Never denial", l, d, ns)
		}
	}
	for p, name := range map[Period]string{Hour: "hour", Day: "day", Week: "week", Month: "month", 0: "unknown", 9: "unknown"} {
		if p.String() != name {
			t.Errorf("Period(%d).String() = %q", p, p.String())
		}
		if got, ok := ParsePeriod(name); ok != (name != "unknown") || ok && got != p {
			t.Errorf("ParsePeriod(%q) = %v, %v", name, got, ok)
		}
	}
	if a, ok := ParseAlgorithm("quota"); !ok || a != Quota || Quota.String() != "quota" {
		t.Fatal("quota's name")
	}
}

func TestQuotaRebase(t *testing.T) {
	at := utc(2024, 5, 10, 0, 0, 0, 0)
	old := Limit{Algorithm: Quota, Limit: 100 * Unit, Period: Month}
	_, s := Decide(old, State{}, at, 80*Unit)
	left := func(l Limit, s State, now int64) int64 {
		d, _ := Decide(l, s, now, 0)
		return d.Remaining
	}
	// Lowered within the period: 80 spent, nothing left of 50.
	low := Limit{Algorithm: Quota, Limit: 50 * Unit, Period: Month}
	r := Rebase(old, low, s, at+Second)
	if got := left(low, r, at+Second); got != 0 {
		t.Fatalf("lowered: %d left", got)
	}
	// Raised again in the same period: the 80 spent still count, so the
	// period never admits more than its highest limit.
	r = Rebase(low, old, r, at+2*Second)
	if got := left(old, r, at+2*Second); got != 20*Unit || r.Count != 80*Unit {
		t.Fatalf("raised back: %d left, state %+v", got, r)
	}
	// Rebased after the period ended: a fresh period.
	r = Rebase(old, low, s, utc(2024, 6, 1, 0, 0, 0, 0))
	if got := left(low, r, utc(2024, 6, 1, 0, 0, 0, 0)); got != 50*Unit {
		t.Fatalf("next period: %d left", got)
	}
	// A changed period starts fresh.
	if r := Rebase(old, Limit{Algorithm: Quota, Limit: 100 * Unit, Period: Day}, s, at); !reflect.DeepEqual(r, State{}) {
		t.Fatalf("period change kept %+v", r)
	}
}

// refPeriod is the period holding t, computed naively with the time
// package: truncating the wall-clock fields.
func refPeriod(p Period, t int64) (start, end time.Time) {
	tm := time.Unix(0, t).UTC()
	y, m, d := tm.Date()
	switch p {
	case Hour:
		start = time.Date(y, m, d, tm.Hour(), 0, 0, 0, time.UTC)
		return start, start.Add(time.Hour)
	case Day:
		start = time.Date(y, m, d, 0, 0, 0, 0, time.UTC)
		return start, start.AddDate(0, 0, 1)
	case Week:
		back := (int(tm.Weekday()) + 6) % 7 // days since Monday
		start = time.Date(y, m, d-back, 0, 0, 0, 0, time.UTC)
		return start, start.AddDate(0, 0, 7)
	}
	start = time.Date(y, m, 1, 0, 0, 0, 0, time.UTC)
	return start, time.Date(y, m+1, 1, 0, 0, 0, 0, time.UTC)
}

// refQuota is a deliberately naive quota: periods from the time package,
// the spent units in a big.Int.
type refQuota struct {
	l          Limit
	start, end time.Time // the current period; zero before the first admission
	spent      *big.Int
}

func (r *refQuota) decide(now, cost int64) Decision {
	ps, pe := refPeriod(r.l.Period, now)
	start, end, spent := ps, pe, new(big.Int)
	if r.spent != nil && !ps.After(r.start) {
		start, end, spent = r.start, r.end, new(big.Int).Set(r.spent) // at or before the stored period
	}
	limit := big.NewInt(r.l.Limit)
	reset := end.UnixNano() - now
	d := Decision{Allowed: true, ResetAfter: reset}
	after := new(big.Int).Add(spent, big.NewInt(cost))
	switch {
	case cost <= 0:
	case cost > r.l.Limit:
		d = Decision{RetryAfter: Never, ResetAfter: reset}
	case after.Cmp(limit) > 0:
		d = Decision{RetryAfter: reset, ResetAfter: reset}
	default:
		spent = after
		r.start, r.end, r.spent = start, end, spent
	}
	d.Remaining = new(big.Int).Sub(limit, spent).Int64()
	return d
}

// genQuotaArrivals draws requests around boundaries: gaps of nanoseconds to
// months, some stepping back across a boundary.
func genQuotaArrivals(t *rapid.T, l Limit, backwards bool) []arrival {
	gaps := []*rapid.Generator[int64]{
		rapid.Just(int64(0)),
		rapid.Int64Range(0, 1000),
		rapid.Int64Range(0, 3600*Second),
		rapid.Int64Range(0, 40*dayT),
	}
	if backwards {
		gaps = append(gaps, rapid.Int64Range(-2*dayT, -1))
	}
	gap := rapid.OneOf(gaps...)
	cost := rapid.OneOf(
		rapid.Int64Range(1, max(l.Limit/8, 1)),
		rapid.Int64Range(1, l.Limit+l.Limit/4+1),
		rapid.Just(l.Limit),
	)
	// Start just before a period boundary of a random instant in 1900-2200.
	base := rapid.Int64Range(utc(1900, 1, 1, 0, 0, 0, 0), utc(2200, 1, 1, 0, 0, 0, 0)).Draw(t, "base")
	_, end := periodBounds(l.Period, base)
	now := end - rapid.Int64Range(0, 3*Second).Draw(t, "before boundary")
	out := make([]arrival, rapid.IntRange(1, 60).Draw(t, "n"))
	for i := range out {
		out[i] = arrival{now, cost.Draw(t, "cost")}
		now += gap.Draw(t, "gap")
	}
	return out
}

// TestQuotaAgainstReference: Decide makes exactly the decisions of the
// naive reference, at any limit up to 1e12 units, any decimal cost, and
// with the clock stepping back across boundaries.
func TestQuotaAgainstReference(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		l := genQuotaLimit(t)
		ref := &refQuota{l: l}
		var s State
		for i, a := range genQuotaArrivals(t, l, rapid.Bool().Draw(t, "backwards")) {
			d, ns := Decide(l, s, a.now, a.cost)
			if want := ref.decide(a.now, a.cost); d != want {
				t.Fatalf("request %d (%s, cost %d): got %+v, reference %+v", i, time.Unix(0, a.now).UTC().Format(time.RFC3339Nano), a.cost, d, want)
			}
			s = ns
		}
	})
}

// TestQuotaPeriodBoundsAgainstTime: the integer calendar agrees with the
// time package at any instant of the int64 range whose period fits in it.
func TestQuotaPeriodBoundsAgainstTime(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		p := Period(rapid.IntRange(int(Hour), int(Month)).Draw(t, "period"))
		now := rapid.Int64Range(math.MinInt64+32*dayT, math.MaxInt64-32*dayT).Draw(t, "now")
		start, end := periodBounds(p, now)
		ws, we := refPeriod(p, now)
		if start != ws.UnixNano() || end != we.UnixNano() {
			t.Fatalf("%s of %s: [%d, %d), time package [%s, %s)", p, time.Unix(0, now).UTC(), start, end, ws, we)
		}
	})
}

// TestQuotaPerPeriod: with a clock that never steps back, no calendar
// period admits more than Limit; with one that does, no stored period
// does. At the end, a request of the whole Limit is admitted exactly at
// the period's end and not 1 ns before (unless nothing was spent).
func TestQuotaPerPeriod(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		l := genQuotaLimit(t)
		backwards := rapid.Bool().Draw(t, "backwards")
		perPeriod := map[int64]*big.Int{}
		var s State
		for _, a := range genQuotaArrivals(t, l, backwards) {
			d, ns := Decide(l, s, a.now, a.cost)
			if d.Allowed && a.cost > 0 {
				key, _ := periodBounds(l.Period, a.now)
				if backwards {
					key = ns.WindowStart
				}
				if perPeriod[key] == nil {
					perPeriod[key] = new(big.Int)
				}
				sum := perPeriod[key].Add(perPeriod[key], big.NewInt(a.cost))
				if sum.Cmp(big.NewInt(l.Limit)) > 0 {
					t.Fatalf("period starting %d admitted %v, limit %d", key, sum, l.Limit)
				}
			}
			s = ns
		}
		if s.Algorithm != Quota {
			return
		}
		_, end := periodBounds(l.Period, s.WindowStart)
		before, _ := Decide(l, s, end-1, l.Limit)
		if s.Count > 0 && (before.Allowed || before.RetryAfter != 1) {
			t.Fatalf("1 ns before the boundary with %d spent: %+v", s.Count, before)
		}
		if at, _ := Decide(l, s, end, l.Limit); !at.Allowed {
			t.Fatalf("at the boundary: %+v", at)
		}
	})
}

func TestQuotaSpent(t *testing.T) {
	l := Limit{Algorithm: Quota, Limit: 100 * Unit, Period: Day}
	day := 24 * 3600 * Second
	t0 := 20000 * day // a day boundary
	_, s := Decide(l, State{}, t0+5, 7*Unit)
	for _, c := range []struct {
		at    int64
		spent int64
		ok    bool
	}{
		{t0, 7 * Unit, true},           // the state's own day
		{t0 + day - 1, 7 * Unit, true}, // still that day
		{t0 + day, 0, true},            // the next day: nothing spent yet
		{t0 - 1, 0, false},             // the day before: the state no longer tells
	} {
		if spent, ok := QuotaSpent(l, s, c.at); spent != c.spent || ok != c.ok {
			t.Errorf("QuotaSpent at %d: %d %v, want %d %v", c.at-t0, spent, ok, c.spent, c.ok)
		}
	}
	if _, ok := QuotaSpent(Limit{Algorithm: TokenBucket, Rate: 1, Burst: 1}, s, t0); ok {
		t.Error("QuotaSpent of a token bucket")
	}
}
