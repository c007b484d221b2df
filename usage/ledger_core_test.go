package usage

import (
	"fmt"
	"sort"
	"testing"

	"github.com/cockroachdb/apd/v3"
	"pgregory.net/rapid"
)

// memLedger is a durable ledger in memory for the core's tests: the bytes
// of every entry with its revision, written the way the reconciler writes
// them (totals, then watermarks, then the cursor; any prefix of the
// totals when a crash is simulated).
type memLedger struct {
	vals   map[string][]byte
	revs   map[string]uint64
	rev    uint64
	cursor uint64
}

func newMemLedger() *memLedger {
	return &memLedger{vals: map[string][]byte{}, revs: map[string]uint64{}}
}

func (l *memLedger) put(key string, v []byte) uint64 {
	l.rev++
	l.vals[key], l.revs[key] = v, l.rev
	return l.rev
}

// stored is one stream message.
type stored struct {
	seq uint64
	b   Batch
}

// runGroup applies msgs (the ones after the cursor) with a fresh or given
// core, loading what is missing from l, and writes the result, crashing
// after crashAfter totals entries when crashAfter >= 0. It returns the core
// (nil after a crash: a crashed process forgets it).
// failer is what runGroup needs of a *testing.T or *rapid.T.
type failer interface {
	Helper()
	Fatal(args ...any)
	Fatalf(format string, args ...any)
}

func runGroup(t failer, l *memLedger, c *ledgerCore, msgs []stored, crashAfter int) *ledgerCore {
	t.Helper()
	if c == nil {
		c = newLedgerCore()
	}
	for _, m := range msgs {
		c.missing(&m.b, func(id entryID) {
			k := TotalsKey(id.policy, id.period, id.key)
			var tot Totals
			if v, ok := l.vals[k]; ok {
				var err error
				if tot, err = ParseTotals(v); err != nil {
					t.Fatal(err)
				}
			}
			c.hold(id, l.revs[k], tot)
		}, func(o string) {
			k := marksKey(o)
			var m *marks
			if v, ok := l.vals[k]; ok {
				var err error
				if m, err = parseMarks(v); err != nil {
					t.Fatal(err)
				}
			}
			c.holdOrigin(o, l.revs[k], m)
		})
	}
	var last uint64
	for _, m := range msgs {
		c.apply(m.seq, &m.b)
		last = m.seq
	}
	for i, e := range c.dirtyE {
		if crashAfter >= 0 && i == crashAfter {
			return nil
		}
		e.settle()
		v, err := e.t.MarshalJSON()
		if err != nil {
			t.Fatal(err)
		}
		if l.revs[e.kvKey] != e.rev {
			t.Fatalf("CAS on %s: stored revision %d, expected %d", e.kvKey, l.revs[e.kvKey], e.rev)
		}
		e.rev = l.put(e.kvKey, v)
	}
	for _, o := range c.dirtyO {
		v, err := o.m.encode()
		if err != nil {
			t.Fatal(err)
		}
		o.rev = l.put(o.kvKey, v)
	}
	l.cursor = last
	c.written()
	return c
}

// totals sums the stored totals by (policy, key, period): counts and
// micro-units.
type sums struct{ allowed, allowedU, denied, deniedU int64 }

func ledgerSums(t *testing.T, l *memLedger) map[string]sums {
	t.Helper()
	out := map[string]sums{}
	for k, v := range l.vals {
		if len(k) < 2 || k[:2] != "t." {
			continue
		}
		tot, err := ParseTotals(v)
		if err != nil {
			t.Fatal(err)
		}
		a, _ := MicroUnits(&tot.AllowedUnits)
		d, _ := MicroUnits(&tot.DeniedUnits)
		out[k] = sums{tot.Allowed, a, tot.Denied, d}
	}
	return out
}

func rec(id string, tUs int64, key string, cost int64, allowed bool) Record {
	return Record{ID: id, TimeUs: tUs, Key: key, Cost: cost, Allowed: allowed}
}

const day0 = int64(1764547200000000) // 2025-12-01T00:00:00Z

func TestCoreTotalsAndPeriods(t *testing.T) {
	l := newMemLedger()
	msgs := []stored{
		{1, Batch{Node: "n1", Policy: "acme", Records: []Record{
			rec("n1.b.1", day0+5, "p.acme.t=a", 2_500_000, true),
			rec("n1.b.2", day0+6, "p.acme.t=a", 1, true),
			rec("n1.b.3", day0+7, "p.acme.t=a", 3_000_000, false),
			rec("n1.b.4", day0+usPerDay, "p.acme.t=a", 1_000_000, true), // next day, same month
		}}},
		{2, Batch{Node: "n1", Policy: "", Records: []Record{rec("n1.b.5", day0-1, "", 500_000, true)}}}, // November 30
	}
	runGroup(t, l, nil, msgs, -1)
	got := ledgerSums(t, l)
	want := map[string]sums{
		"t.acme.2025-12-01.p.acme.t=a": {2, 2_500_001, 1, 3_000_000},
		"t.acme.2025-12-02.p.acme.t=a": {1, 1_000_000, 0, 0},
		"t.acme.2025-12.p.acme.t=a":    {3, 3_500_001, 1, 3_000_000},
		"t._.2025-11-30._":             {1, 500_000, 0, 0},
		"t._.2025-11._":                {1, 500_000, 0, 0},
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("got  %v\nwant %v", got, want)
	}
	v := l.vals["t.acme.2025-12.p.acme.t=a"]
	if string(v) != `{"policy":"acme","key":"p.acme.t=a","period":"2025-12","allowed":3,"allowed_units":"3.500001","denied":1,"denied_units":"3","seq":1,"last_us":1764633600000000}` {
		t.Fatalf("stored %s", v)
	}
}

// A reservation's end (CONTRACT.md §10) counts like any allowed record:
// allowed +1, allowed_units + its settled cost, also when that is 0 (a
// release), also journalled and published again, and the same whether
// it comes as a v1.1 record or grouped by key (where a group of releases
// only has totals of 0 units).
func TestCoreReservationEnds(t *testing.T) {
	res := func(r Record, id string) Record { r.Reservation = id; return r }
	records := []Record{
		res(rec("n1.b.j4.0", day0+1, "p.acme.t=a", 0, true), "r.1"),         // released
		res(rec("n1.b.j4.1", day0+2, "p.acme.t=a", 2_500_000, true), "r.2"), // settled at 2.5
		rec("n1.b.j4.2", day0+3, "p.acme.t=a", 1_000_000, true),             // an ordinary decision
		rec("n1.b.7", day0+4, "p.acme.t=a", 3_000_000, false),               // a denied reserve
		res(rec("n1.b.8", day0+5, "p.acme.t=b", 0, true), "r.3"),            // a group of releases only
		res(rec("n1.b.9", day0+6, "p.acme.t=b", 0, true), "r.4"),
	}
	for i := range records {
		records[i].Descriptor = desc(t, "t", records[i].Key[len("p.acme.t="):])
	}
	for _, grouped := range []bool{false, true} {
		b := Batch{Node: "n1", Policy: "acme", Records: records}
		if grouped {
			var err error
			if b, err = DecodeBatch(EncodeGrouped("n1", "acme", "n1.b.acme.1", records)); err != nil {
				t.Fatal(err)
			}
			if len(b.Groups) != 2 || b.Groups[1].Allowed != 2 || b.Groups[1].AllowedUnits != 0 {
				t.Fatalf("groups %+v", b.Groups)
			}
		}
		l := newMemLedger()
		c := runGroup(t, l, nil, []stored{{1, b}}, -1)
		// The journalled ones again, in a later message of another node.
		again := Batch{Node: "n2", Policy: "acme", Records: records[:2]}
		runGroup(t, l, c, []stored{{2, again}}, -1)
		got := ledgerSums(t, l)
		want := map[string]sums{
			"t.acme.2025-12-01.p.acme.t=a": {3, 3_500_000, 1, 3_000_000},
			"t.acme.2025-12.p.acme.t=a":    {3, 3_500_000, 1, 3_000_000},
			"t.acme.2025-12-01.p.acme.t=b": {2, 0, 0, 0},
			"t.acme.2025-12.p.acme.t=b":    {2, 0, 0, 0},
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("grouped %v: got  %v\nwant %v", grouped, got, want)
		}
		if v := string(l.vals["t.acme.2025-12.p.acme.t=b"]); v != `{"policy":"acme","key":"p.acme.t=b","period":"2025-12","allowed":2,"allowed_units":"0","denied":0,"denied_units":"0","seq":1,"last_us":1764547200000006}` {
			t.Fatalf("grouped %v: stored %s", grouped, v)
		}
		if tu := c.takeTouched(); tu[policyKey{"acme", "p.acme.t=b"}] != day0+6 {
			t.Fatalf("grouped %v: touched %v", grouped, tu)
		}
	}
}

// A message delivered again after every entry was written changes nothing;
// after some were written, it completes the others.
func TestCoreRedelivery(t *testing.T) {
	m1 := stored{7, Batch{Node: "n1", Policy: "acme", Records: []Record{
		rec("n1.b.1", day0, "p.acme.t=a", 1_000_000, true),
		rec("n1.b.2", day0, "p.acme.t=b", 1_000_000, true),
	}}}
	l := newMemLedger()
	runGroup(t, l, nil, []stored{m1}, -1)
	want := ledgerSums(t, l)
	runGroup(t, l, nil, []stored{m1}, -1) // redelivered, fresh process
	if got := ledgerSums(t, l); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("after redelivery %v, want %v", got, want)
	}
	for crash := 0; crash < 4; crash++ {
		l := newMemLedger()
		if runGroup(t, l, nil, []stored{m1}, crash) != nil {
			t.Fatal("no crash")
		}
		runGroup(t, l, nil, []stored{m1}, -1)
		if got := ledgerSums(t, l); fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("crash after %d entries: %v, want %v", crash, got, want)
		}
	}
}

// A journalled record published again (same id, later message, another
// node) is counted once; its neighbours above the watermark count.
func TestCoreRepublished(t *testing.T) {
	l := newMemLedger()
	c := runGroup(t, l, nil, []stored{{1, Batch{Node: "n1", Policy: "acme", Records: []Record{
		rec("n1.b.j10.0", day0, "p.acme.t=a", 1_000_000, true),
		rec("n1.b.j10.1", day0, "p.acme.t=a", 1_000_000, true),
	}}}}, -1)
	// n2 republishes n1's journal from j10.1 on, plus a new j11.0.
	m2 := stored{2, Batch{Node: "n2", Policy: "acme", Records: []Record{
		rec("n1.b.j10.1", day0, "p.acme.t=a", 1_000_000, true),
		rec("n1.b.j11.0", day0, "p.acme.t=a", 1_000_000, true),
	}}}
	// The same record on another policy's subject has its own watermark.
	m3 := stored{3, Batch{Node: "n2", Policy: "birch", Records: []Record{
		rec("n1.b.j10.1", day0, "p.birch.t=a", 1_000_000, true),
	}}}
	runGroup(t, l, c, []stored{m2, m3}, -1)
	got := ledgerSums(t, l)
	if got["t.acme.2025-12.p.acme.t=a"].allowed != 3 || got["t.birch.2025-12.p.birch.t=a"].allowed != 1 {
		t.Fatalf("%v", got)
	}
	// Watermarks survive a restart: the republished range again counts nothing.
	runGroup(t, l, nil, []stored{{4, m2.b}}, -1)
	if got := ledgerSums(t, l); got["t.acme.2025-12.p.acme.t=a"].allowed != 3 {
		t.Fatalf("after restart: %v", got)
	}
}

// Property: for any stream whose journalled records first appear in
// increasing order per (origin, policy) (republished ranges may repeat any
// earlier part), applied in groups with crashes between any two writes
// and redelivery from the cursor, the ledger equals the reference: every
// distinct journalled id once, every ordinary record once per message.
func TestCoreExactlyOnceProperty(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		nMsgs := rapid.IntRange(1, 25).Draw(rt, "messages")
		keys := []string{"p.acme.t=a", "p.acme.t=b", "p.acme.t=c"}
		origins := []string{"n1.b", "n2.c"}
		next := map[string]int{} // origin|policy -> the position after the highest published
		var stream []stored
		ordinary := 0
		for s := 1; s <= nMsgs; s++ {
			policy := rapid.SampledFrom([]string{"acme", "birch"}).Draw(rt, "policy")
			b := Batch{Node: "x", Policy: policy}
			n := rapid.IntRange(1, 6).Draw(rt, "records")
			if rapid.Bool().Draw(rt, "journalled") {
				o := rapid.SampledFrom(origins).Draw(rt, "origin")
				mk := o + "|" + policy
				start := rapid.IntRange(0, next[mk]).Draw(rt, "start")
				for p := start; p < start+n; p++ {
					id := fmt.Sprintf("%s.j%d.%d", o, p/3, p%3)
					key := keys[(p*7+len(o))%len(keys)]
					key = "p." + policy + key[6:]
					b.Records = append(b.Records, rec(id, day0+int64(p)*3_600_000_000, key, int64(p%4+1)*250_000, p%5 != 0))
				}
				next[mk] = max(next[mk], start+n)
			} else {
				for i := 0; i < n; i++ {
					ordinary++
					key := "p." + policy + keys[i%3][6:]
					b.Records = append(b.Records, rec(fmt.Sprintf("x.y.%d", ordinary), day0+int64(ordinary)*1_000_000_000, key, 1_500_000, i%2 == 0))
				}
			}
			stream = append(stream, stored{uint64(s), b})
		}
		// Reference.
		want := map[string]sums{}
		seen := map[string]bool{}
		for _, m := range stream {
			for _, r := range m.b.Records {
				if _, _, ok := ParseJournalID(r.ID); ok {
					k := m.b.Policy + "|" + r.ID
					if seen[k] {
						continue
					}
					seen[k] = true
				}
				for _, per := range []string{Day(r.TimeUs), Month(r.TimeUs)} {
					k := TotalsKey(m.b.Policy, per, r.Key)
					s := want[k]
					if r.Allowed {
						s.allowed++
						s.allowedU += r.Cost
					} else {
						s.denied++
						s.deniedU += r.Cost
					}
					want[k] = s
				}
			}
		}
		// Run with crashes.
		l := newMemLedger()
		var c *ledgerCore
		for steps := 0; l.cursor < uint64(len(stream)); steps++ {
			if steps > 200 {
				rt.Fatal("no progress")
			}
			from := int(l.cursor)
			n := rapid.IntRange(1, len(stream)-from).Draw(rt, "group")
			crash := -1
			if rapid.IntRange(0, 3).Draw(rt, "crash?") == 0 {
				crash = rapid.IntRange(0, 10).Draw(rt, "crashAfter")
			}
			c = runGroup(rt, l, c, stream[from:from+n], crash)
		}
		got := map[string]sums{}
		for k, v := range l.vals {
			if k[:2] != "t." {
				continue
			}
			tot, err := ParseTotals(v)
			if err != nil {
				rt.Fatal(err)
			}
			a, _ := MicroUnits(&tot.AllowedUnits)
			d, _ := MicroUnits(&tot.DeniedUnits)
			got[k] = sums{tot.Allowed, a, tot.Denied, d}
		}
		if fmt.Sprint(sorted(got)) != fmt.Sprint(sorted(want)) {
			rt.Fatalf("ledger %v\nreference %v", sorted(got), sorted(want))
		}
	})
}

func sorted(m map[string]sums) []string {
	var out []string
	for k, v := range m {
		out = append(out, fmt.Sprintf("%s=%v", k, v))
	}
	sort.Strings(out)
	return out
}

func TestFormatUnits(t *testing.T) {
	for _, c := range []struct {
		micro []int64
		want  string
	}{{nil, "0"}, {[]int64{1}, "0.000001"}, {[]int64{2_500_000, 500_000}, "3"}, {[]int64{1_000_000_000_000_000}, "1000000000"}, {[]int64{1<<62 + 1, 1 << 62}, "9223372036854.775809"}} {
		var d apd.Decimal
		for _, m := range c.micro {
			addMicro(&d, m)
		}
		if got := FormatUnits(&d); got != c.want {
			t.Errorf("%v: %s, want %s", c.micro, got, c.want)
		}
	}
}
