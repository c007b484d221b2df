package keys

import (
	"math"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
)

// restStep is one decision of a TestRecordRestAt timeline.
type restStep struct {
	at   time.Time
	cost int64  // units
	id   string // request_id, if any
}

// utc parses an RFC 3339 instant.
func utc(t *testing.T, s string) time.Time {
	t.Helper()
	v, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// TestRecordRestAt: the records a key's owner writes carry the instant
// they come to rest, for every algorithm, with several limits, and with
// remembered request_ids; and the time to live the store gives them is
// the state TTL for a record at rest and the time to rest (plus the
// margin) for one that is not.
func TestRecordRestAt(t *testing.T) {
	const floor = 2 * time.Second
	base := utc(t, "2028-02-09T10:20:00Z") // a Wednesday in a leap year's February
	h := base.Add
	cases := []struct {
		name   string
		limits string
		steps  []restStep
		rest   time.Time // the last write's RestAt
	}{
		{"token bucket, 1000/d half spent", `{"algorithm":"token_bucket","rate":"1000/d","burst":1000}`,
			[]restStep{{base, 500, ""}}, h(12 * time.Hour)},
		{"token bucket, refilled in part", `{"algorithm":"token_bucket","rate":"1/s","burst":10}`,
			[]restStep{{base, 4, ""}, {h(time.Second), 3, ""}}, h(7 * time.Second)},
		{"token bucket, fully refilled then spent", `{"algorithm":"token_bucket","rate":"1/s","burst":10}`,
			[]restStep{{base, 10, ""}, {h(time.Hour), 1, ""}}, h(time.Hour + time.Second)},
		{"gcra", `{"algorithm":"gcra","rate":"1/s","burst":10}`,
			[]restStep{{base, 4, ""}}, h(4 * time.Second)},
		{"gcra, 1000/d", `{"algorithm":"gcra","rate":"1000/d","burst":1000}`,
			[]restStep{{base, 250, ""}}, h(6 * time.Hour)},
		{"fixed window, 1h", `{"algorithm":"fixed_window","limit":10,"window":"1h"}`,
			[]restStep{{base, 3, ""}, {h(30 * time.Minute), 2, ""}}, utc(t, "2028-02-09T11:00:00Z")},
		{"fixed window, next window", `{"algorithm":"fixed_window","limit":10,"window":"1h"}`,
			[]restStep{{base, 3, ""}, {h(50 * time.Minute), 2, ""}}, utc(t, "2028-02-09T12:00:00Z")},
		{"sliding window, weighed through the next window", `{"algorithm":"sliding_window","limit":10,"window":"1h"}`,
			[]restStep{{base, 3, ""}}, utc(t, "2028-02-09T12:00:00Z")},
		{"sliding log, the newest entry's window", `{"algorithm":"sliding_log","limit":5,"window":"1h"}`,
			[]restStep{{base, 1, ""}, {h(30 * time.Minute), 2, ""}}, h(90 * time.Minute)},
		{"quota, a leap-year month", `{"algorithm":"quota","limit":100,"period":"month"}`,
			[]restStep{{base, 30, ""}}, utc(t, "2028-03-01T00:00:00Z")},
		{"quota, December to January", `{"algorithm":"quota","limit":100,"period":"month"}`,
			[]restStep{{utc(t, "2027-12-31T23:59:59Z"), 1, ""}}, utc(t, "2028-01-01T00:00:00Z")},
		{"quota, a week from Monday", `{"algorithm":"quota","limit":100,"period":"week"}`,
			[]restStep{{base, 1, ""}}, utc(t, "2028-02-14T00:00:00Z")},
		{"quota, a day", `{"algorithm":"quota","limit":"0.5","period":"day"}`,
			[]restStep{{base, 0, ""}}, utc(t, "2028-02-10T00:00:00Z")},
		{"concurrency, the last hold's expiry", `{"algorithm":"concurrency","limit":5,"window":"30s"}`,
			[]restStep{{base, 1, ""}, {h(10 * time.Second), 2, ""}}, h(40 * time.Second)},
		{"rate and quota: the later", `{"name":"r","algorithm":"token_bucket","rate":"10/s","burst":40},
			{"name":"q","algorithm":"quota","limit":20000000,"period":"month"}`,
			[]restStep{{base, 40, ""}}, utc(t, "2028-03-01T00:00:00Z")},
		{"rate and window: the later", `{"name":"r","algorithm":"token_bucket","rate":"1/h","burst":40},
			{"name":"w","algorithm":"fixed_window","limit":100,"window":"1m"}`,
			[]restStep{{base, 10, ""}}, h(10 * time.Hour)},
		{"a request_id outlives a fast refill", `{"algorithm":"token_bucket","rate":"100/s","burst":10}`,
			[]restStep{{base, 1, "r1"}}, h(time.Duration(keyrec.DedupeWindow))},
		{"a denied request_id on a key at rest", `{"algorithm":"token_bucket","rate":"1/s","burst":10}`,
			[]restStep{{base, 11, "r1"}}, h(time.Duration(keyrec.DedupeWindow))},
		{"a long refill outlives the request_id", `{"algorithm":"token_bucket","rate":"1/h","burst":10}`,
			[]restStep{{base, 1, "r1"}}, h(time.Hour)},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := mustParse(t, `{"match":{"tenant":"*"},"limits":[`+c.limits+`]}`)
			p.Revision = 3
			o := newOwner(newFakeEnv(p), 8, 0)
			s := &storeAt{}
			var last int64
			for i, st := range c.steps {
				now := st.at.UnixNano()
				// Cost 0 stands for half a unit (quotas take decimal costs).
				call := &Call{Policy: p, Cost: max(st.cost*kvstate.Unit, kvstate.Unit/2), Deadline: now + sec}
				if st.id != "" {
					withID(call, st.id)
				}
				o.submit(call)
				a := o.next(now)
				if i == 0 {
					mustKind(t, a, actLoad)
					o.loadedResult(nil, 0, kvstate.ErrNotFound)
					a = o.next(now)
				}
				mustKind(t, a, actWrite)
				o.written(s.write(t, a), nil)
				o.next(now)
				last = now
			}
			rec, err := keyrec.Decode(s.val)
			if err != nil {
				t.Fatal(err)
			}
			if rec.RestAt != c.rest.UnixNano() {
				t.Fatalf("RestAt %v, want %v", time.Unix(0, rec.RestAt).UTC(), c.rest)
			}
			ret := keyrec.Retention{Floor: floor, Horizon: 366 * 24 * time.Hour}
			want := max(floor, time.Duration(c.rest.UnixNano()-last)+keyrec.RetentionMargin)
			if got := ret.TTLOf(s.val, last); got != want {
				t.Fatalf("TTL %v, want %v", got, want)
			}
		})
	}
}

// TestRecordRestAtUnknown: a record whose policy version the node does not
// know has no rest time (0: the store keeps it the state TTL), and one at
// rest at instant 0 is said to rest at 1, so 0 keeps meaning unknown.
func TestRecordRestAtUnknown(t *testing.T) {
	rec := keyrec.Record{Policy: "p", Revision: 1, States: make([]kvstate.State, 1)}
	if got := recordRestAt(nil, &rec); got != 0 {
		t.Fatalf("unknown policy: %d", got)
	}
	p := mustParse(t, `{"match":{},"limits":[{"algorithm":"fixed_window","limit":1,"window":"1s"}]}`)
	if got := recordRestAt(p, &rec); got != math.MinInt64 {
		t.Fatalf("never-seen state: %d, want math.MinInt64", got)
	}
	// A window that started at 0 with nothing counted is at rest at 0.
	rec.States[0] = kvstate.State{Algorithm: kvstate.FixedWindow}
	if got := recordRestAt(p, &rec); got != 1 {
		t.Fatalf("at rest at 0: %d, want 1", got)
	}
}

// TestOwnerRestAtAfterPolicyChange: the rest time of a record written after
// a transition is the new policy version's.
func TestOwnerRestAtAfterPolicyChange(t *testing.T) {
	p1 := tbPolicy(t, "p", 1, "10/s", 10, "")
	p2 := tbPolicy(t, "p", 2, "1/h", 10, "")
	env := newFakeEnv(p1)
	o := newOwner(env, 8, 0)
	s := &storeAt{}
	now := int64(1000 * sec)
	o.submit(newCall(p1, 5, now+sec))
	mustKind(t, o.next(now), actLoad)
	o.loadedResult(nil, 0, kvstate.ErrNotFound)
	o.written(s.write(t, o.next(now)), nil)
	o.next(now)
	if at, _ := keyrec.PeekRestAt(s.val); at != now+sec/2 {
		t.Fatalf("10/s, 5 spent: rest at +%v", time.Duration(at-now))
	}
	env.add(p2, now)
	o.submit(newCall(p1, 1, now+sec)) // arrived under p1; p2 is in force
	o.written(s.write(t, o.next(now)), nil)
	o.next(now)
	rec, _ := keyrec.Decode(s.val)
	if rec.Revision != 2 || rec.RestAt != now+6*int64(time.Hour) {
		t.Fatalf("after the change: revision %d, rest at +%v", rec.Revision, time.Duration(rec.RestAt-now))
	}
}

// BenchmarkRecordRestAt compares encoding a record (keyrec.Append) with
// computing its rest time and encoding it, as every write does: a rate
// and a quota limit, with request_ids remembered.
func BenchmarkRecordRestAt(b *testing.B) {
	p := mustParse(&testing.T{}, `{"match":{"tenant":"*"},"limits":[
		{"name":"r","algorithm":"token_bucket","rate":"10/s","burst":40},
		{"name":"q","algorithm":"quota","limit":20000000,"period":"month"}]}`)
	limits := []kvstate.Limit{p.Limits[0].Limit, p.Limits[1].Limit}
	now := int64(1_800_000_000) * sec
	_, states := kvstate.DecideAll(limits, nil, now, 3*kvstate.Unit, nil)
	rec := keyrec.Record{Policy: p.Name, Revision: 12, Version: 9, States: states}
	for i := range 8 {
		rec.AddDedupe(keyrec.IDHash(string(rune('a'+i))), now, keyrec.Decision{Allowed: true})
	}
	buf := make([]byte, 0, keyrec.SizeHint(&rec))
	b.Run("append", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			buf = keyrec.Append(buf[:0], &rec)
		}
	})
	b.Run("rest+append", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			rec.RestAt = recordRestAt(p, &rec)
			buf = keyrec.Append(buf[:0], &rec)
		}
	})
}
