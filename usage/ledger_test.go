package usage

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/elector"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
)

// startReconciler runs a reconciler (no elector) until the test ends.
func startReconciler(t *testing.T, js jetstream.JetStream, cfg ReconcilerConfig) *Reconciler {
	t.Helper()
	r, err := NewReconciler(testCtx(t), js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { r.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return r
}

// lastSeq is the usage stream's last sequence.
func lastSeq(t testing.TB, js jetstream.JetStream) uint64 {
	t.Helper()
	s, err := js.Stream(testCtx(t), StreamName("rl"))
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(testCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	return info.State.LastSeq
}

// readLedger returns every totals entry of the ledger by key, as counts
// and micro-units.
func readLedger(t *testing.T, kv jetstream.KeyValue) map[string]sums {
	t.Helper()
	ctx := testCtx(t)
	lister, err := kv.ListKeysFiltered(ctx, "t.>")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]sums{}
	for k := range lister.Keys() {
		e, err := kv.Get(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		tot, err := ParseTotals(e.Value())
		if err != nil {
			t.Fatal(err)
		}
		if k != TotalsKey(tot.Policy, tot.Period, tot.Key) {
			t.Fatalf("entry %s names %s/%s/%s", k, tot.Policy, tot.Period, tot.Key)
		}
		a, ok1 := MicroUnits(&tot.AllowedUnits)
		d, ok2 := MicroUnits(&tot.DeniedUnits)
		if !ok1 || !ok2 {
			t.Fatalf("entry %s: units not micro-units", k)
		}
		out[k] = sums{tot.Allowed, a, tot.Denied, d}
	}
	return out
}

// expect accumulates what the ledger must hold for records of a policy.
type expect map[string]sums

func (x expect) add(policy string, r Record) {
	for _, per := range []string{Day(r.TimeUs), Month(r.TimeUs)} {
		k := TotalsKey(policy, per, r.Key)
		s := x[k]
		if r.Allowed {
			s.allowed++
			s.allowedU += r.Cost
		} else {
			s.denied++
			s.deniedU += r.Cost
		}
		x[k] = s
	}
}

func sameSums(t *testing.T, got, want map[string]sums) {
	t.Helper()
	if fmt.Sprint(sorted(got)) != fmt.Sprint(sorted(want)) {
		t.Fatalf("ledger\n%s\nwant\n%s", strings.Join(sorted(got), "\n"), strings.Join(sorted(want), "\n"))
	}
}

// waitApplied waits until the ledger's cursor (written by any of the
// reconcilers on the ledger bucket kv) covers the last message of the
// usage stream.
func waitApplied(t *testing.T, js jetstream.JetStream, kv jetstream.KeyValue) {
	t.Helper()
	waitCursor(t, kv, lastSeq(t, js), 60*time.Second)
}

// ledgerCursor returns the ledger's cursor entry (docs/protocol.md: every
// usage message up to its seq is wholly in the ledger; node is the
// reconciler that wrote it), the zero cursor when there is none.
func ledgerCursor(t testing.TB, kv jetstream.KeyValue) cursor {
	t.Helper()
	en, err := kv.Get(testCtx(t), cursorKey)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return cursor{}
	}
	if err != nil {
		t.Fatalf("reading the cursor: %v", err)
	}
	var c cursor
	if err := json.Unmarshal(en.Value(), &c); err != nil {
		t.Fatalf("cursor %q: %v", en.Value(), err)
	}
	return c
}

// waitCounter waits until metric name{labels} of reg is want: a group's
// counts are added to the metrics just after its cursor is written, so a
// test that saw the cursor may read them a moment early. A counter that
// passes want never comes back to it: the wait then fails.
func waitCounter(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string, want float64) {
	t.Helper()
	waitFor(t, 10*time.Second, fmt.Sprintf("%s%v to be %v", name, labels, want), func() bool {
		return counterValue(t, reg, name, labels) == want
	})
}

// waitCursor watches the ledger's cursor entry until it reaches seq; it
// fails the test if limit passes first. It watches rather than polls, so
// that a benchmark waiting with it adds no reads to what it measures.
func waitCursor(tb testing.TB, kv jetstream.KeyValue, seq uint64, limit time.Duration) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	w, err := kv.Watch(ctx, cursorKey)
	if err != nil {
		tb.Fatalf("watching the cursor: %v", err)
	}
	defer func() { _ = w.Stop() }()
	at := uint64(0)
	for {
		select {
		case en := <-w.Updates():
			if en == nil || en.Operation() != jetstream.KeyValuePut {
				continue
			}
			var c cursor
			if err := json.Unmarshal(en.Value(), &c); err != nil {
				tb.Fatalf("cursor %q: %v", en.Value(), err)
			}
			if at = c.Seq; at >= seq {
				return
			}
		case <-ctx.Done():
			tb.Fatalf("timed out after %v waiting for the ledger's cursor to reach %d (at %d)", limit, seq, at)
		}
	}
}

// ledgerRecord is a record of key k of policy with a cost in micro-units.
func ledgerRecord(t testing.TB, policy string, k int, tUs, cost int64, allowed bool) Record {
	r := Record{TimeUs: tUs, Revision: 1, Descriptor: desc(t, "tenant", fmt.Sprint("t", k)), Cost: cost, Allowed: allowed}
	if policy != "" {
		r.Key = fmt.Sprintf("p.%s.tenant=t%d", policy, k)
	}
	return r
}

// The ledger's totals equal what was published, to the micro-unit, with
// decimal costs, across days, months, policies and unmatched decisions.
func TestLedgerTotals(t *testing.T) {
	ts := startServer(t)
	_, js := connect(t, ts)
	ensureStream(t, js)
	p, err := NewPublisher(js, PublisherConfig{Node: "n1", Interval: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	want := expect{}
	costs := []int64{1, 2_500_000, 1_000_000, 333_333, 999_999_999_999_999}
	for i := 0; i < 3000; i++ {
		pol := []string{"acme", "birch", ""}[i%3]
		tUs := day0 - usPerDay + int64(i)*(3*usPerDay/3000) // Nov 30 .. Dec 2
		r := ledgerRecord(t, pol, i%11, tUs, costs[i%len(costs)], i%4 != 0)
		p.Add(pol, r)
		want.add(pol, r)
	}
	if err := p.Sync(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	r := startReconciler(t, js, ReconcilerConfig{Node: "n1", Registerer: reg, MaxGroup: 5})
	waitApplied(t, js, r.KV())
	sameSums(t, readLedger(t, r.KV()), want)
	waitCounter(t, reg, "limitmesh_usage_ledger_records_total", map[string]string{"outcome": "counted"}, 3000)
	// The decimals are stored exactly: 3 records of 999999999.999999 and 2.5 ...
	e, err := r.KV().Get(testCtx(t), TotalsKey("acme", "2025-12", "p.acme.tenant=t0"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(e.Value()), `"allowed_units":"`) {
		t.Fatalf("entry %s", e.Value())
	}
	// More records later are added to the same entries.
	for i := 0; i < 100; i++ {
		r := ledgerRecord(t, "acme", 0, day0+int64(i), 1_500_000, true)
		p.Add("acme", r)
		want.add("acme", r)
	}
	if err := p.Close(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	waitApplied(t, js, r.KV())
	sameSums(t, readLedger(t, r.KV()), want)
}

// A journalled record published again (same id, in a later message, by
// another node) is counted once; so is a message the reconciler applied
// in part before it died (simulated between two entry writes).
func TestLedgerRepublishedAndCrash(t *testing.T) {
	ts := startServer(t)
	_, js := connect(t, ts)
	ensureStream(t, js)
	p1, _ := NewPublisher(js, PublisherConfig{Node: "n1", Boot: "b1", Interval: 10 * time.Millisecond})
	p2, _ := NewPublisher(js, PublisherConfig{Node: "n2", Boot: "b2", Interval: 10 * time.Millisecond})
	want := expect{}
	var journal []Record
	for j := 0; j < 200; j++ {
		r := ledgerRecord(t, "acme", j%5, day0+int64(j), int64(j%3+1)*250_000, j%7 != 0)
		r.ID = JournalID("n1", "b1", uint64(10+j/4), uint32(j%4))
		journal = append(journal, r)
		want.add("acme", r)
	}
	for _, r := range journal[:150] {
		p1.Add("acme", r)
	}
	if err := p1.Sync(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	// n2 takes over n1's partition and republishes from record 100 on.
	for _, r := range journal[100:] {
		p2.Add("acme", r)
	}
	if err := p2.Sync(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	// The reconciler dies after writing one entry of its first group.
	reg := prometheus.NewRegistry()
	r, err := NewReconciler(testCtx(t), js, ReconcilerConfig{Node: "n1", Registerer: reg, MaxGroup: 2})
	if err != nil {
		t.Fatal(err)
	}
	r.crashAfter = 1
	if err := r.session(testCtx(t)); err != errCrash {
		t.Fatalf("session: %v, want the simulated crash", err)
	}
	if c := ledgerCursor(t, r.KV()); c.Seq != 0 {
		t.Fatalf("cursor at %d after a crash in the first group", c.Seq)
	}
	r.crashAfter = -1
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { r.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	waitApplied(t, js, r.KV())
	sameSums(t, readLedger(t, r.KV()), want)
	waitCounter(t, reg, "limitmesh_usage_ledger_records_total", map[string]string{"outcome": "duplicate"}, 50)
}

// Garbage on the usage subjects is skipped and counted, and the good
// records around it are applied.
func TestLedgerGarbage(t *testing.T) {
	ts := startServer(t)
	nc, js := connect(t, ts)
	ensureStream(t, js)
	p, _ := NewPublisher(js, PublisherConfig{Node: "n1", Interval: 10 * time.Millisecond})
	want := expect{}
	addSome := func(k int) {
		for i := 0; i < 10; i++ {
			r := ledgerRecord(t, "acme", k, day0+int64(i), 1_000_000, true)
			p.Add("acme", r)
			want.add("acme", r)
		}
		if err := p.Sync(testCtx(t)); err != nil {
			t.Fatal(err)
		}
	}
	addSome(1)
	garbage := []struct{ subj, body string }{
		{"rl.usage.acme", "not json"},
		{"rl.usage.acme", `{"node":"x","policy":"acme","records":[{"id":"x"}]}`},
		{"rl.usage.acme", `{"node":"x","policy":"birch","records":[]}`}, // another policy's subject
		{"rl.usage.a.b", `{"node":"x","policy":"acme","records":[]}`},   // not a usage subject
		{"rl.usage._", `{"node":"x","policy":"","records":[{"id":"x","t_us":1,"revision":0,"key":"p.k","descriptor":{"a":"b"},"cost":1,"result":"allowed"}]}`},
		{"rl.usage.acme", ""},
	}
	for _, g := range garbage {
		if _, err := js.Publish(testCtx(t), g.subj, []byte(g.body)); err != nil {
			t.Fatal(err)
		}
	}
	_ = nc
	addSome(2)
	reg := prometheus.NewRegistry()
	r := startReconciler(t, js, ReconcilerConfig{Node: "n1", Registerer: reg, MaxGroup: 3})
	waitApplied(t, js, r.KV())
	sameSums(t, readLedger(t, r.KV()), want)
	waitCounter(t, reg, "limitmesh_usage_invalid_total", nil, float64(len(garbage)))
	waitCounter(t, reg, "limitmesh_usage_lag_seconds", nil, 0)
}

// Two reconcilers under electors on two connections: the active one's
// connection is closed mid-stream, the other takes over, and the totals are
// exact.
func TestLedgerFailover(t *testing.T) {
	ts := startServer(t)
	_, js := connect(t, ts)
	ensureStream(t, js)
	type member struct {
		node string
		nc   *nats.Conn
		r    *Reconciler
	}
	var members []*member
	for _, node := range []string{"a", "b"} {
		nc, js := connect(t, ts)
		r, err := NewReconciler(testCtx(t), js, ReconcilerConfig{Node: node, MaxGroup: 4})
		if err != nil {
			t.Fatal(err)
		}
		e := elector.New(r.KV(), LedgerLeaderKey, node, 1500*time.Millisecond, nil)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { e.Run(ctx, r.Run); close(done) }()
		t.Cleanup(func() { cancel(); <-done })
		members = append(members, &member{node, nc, r})
	}
	p, _ := NewPublisher(js, PublisherConfig{Node: "n1", Interval: 5 * time.Millisecond, MaxBatch: 20})
	want := expect{}
	var wmu sync.Mutex
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			r := ledgerRecord(t, "acme", i%13, day0+int64(i), int64(i%9+1)*125_000, i%5 != 0)
			if i%2 == 0 {
				r.ID = JournalID("n1", "jb", uint64(i/3), uint32(i%3))
			}
			p.Add("acme", r)
			wmu.Lock()
			want.add("acme", r)
			wmu.Unlock()
			if i%50 == 0 {
				time.Sleep(2 * time.Millisecond)
			}
		}
	}()
	// The elected reconciler is the one whose sessions write the cursor.
	var leader *member
	waitFor(t, 30*time.Second, "a leader applying records", func() bool {
		c := ledgerCursor(t, members[0].r.KV())
		for _, m := range members {
			if c.Node == m.node && c.Seq > 20 {
				leader = m
				return true
			}
		}
		return false
	})
	leader.nc.Close()
	var other *member
	for _, m := range members {
		if m != leader {
			other = m
		}
	}
	at := ledgerCursor(t, other.r.KV()).Seq
	waitFor(t, 30*time.Second, "the other reconciler to take over", func() bool {
		c := ledgerCursor(t, other.r.KV())
		return c.Node == other.node && c.Seq > at+20
	})
	close(stop)
	wg.Wait()
	if err := p.Close(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	waitApplied(t, js, other.r.KV())
	wmu.Lock()
	defer wmu.Unlock()
	sameSums(t, readLedger(t, other.r.KV()), want)
}

// The reconciler compares quota state with the ledger once keys settle and
// counts each difference.
func TestLedgerReconcile(t *testing.T) {
	ts := startServer(t)
	_, js := connect(t, ts)
	ensureStream(t, js)
	p, _ := NewPublisher(js, PublisherConfig{Node: "n1", Interval: 5 * time.Millisecond})
	now := time.Now()
	spent := map[string]int64{}
	for i := 0; i < 60; i++ {
		k := i % 3
		r := ledgerRecord(t, "acme", k, now.UnixMicro(), 1_500_000, true)
		p.Add("acme", r)
		spent[r.Key] += r.Cost
	}
	// Denied records spend nothing; a policy without quotas is not compared.
	p.Add("acme", ledgerRecord(t, "acme", 0, now.UnixMicro(), 7_000_000, false))
	p.Add("birch", ledgerRecord(t, "birch", 0, now.UnixMicro(), 7_000_000, true))
	if err := p.Close(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	var (
		mu    sync.Mutex
		asked []string
	)
	reg := prometheus.NewRegistry()
	r := startReconciler(t, js, ReconcilerConfig{
		Node: "n1", Registerer: reg, Settle: 10 * time.Millisecond, ReconcileInterval: 20 * time.Millisecond,
		QuotaLimits: func(policy string) []QuotaLimit {
			if policy != "acme" {
				return nil
			}
			return []QuotaLimit{{"monthly", "month"}, {"daily", "day"}, {"weekly", "week"}, {"hourly", "hour"}}
		},
		QuotaState: func(ctx context.Context, policy, key string, at time.Time) (map[string]int64, bool, error) {
			mu.Lock()
			asked = append(asked, key)
			mu.Unlock()
			s := spent[key]
			if key == "p.acme.tenant=t2" {
				// The limiter spent one micro-unit more than the ledger has (daily only).
				return map[string]int64{"monthly": s, "daily": s + 1, "weekly": s, "hourly": 5}, true, nil
			}
			return map[string]int64{"monthly": s, "daily": s, "weekly": s, "hourly": 5}, true, nil
		},
	})
	waitApplied(t, js, r.KV())
	// Three keys, each with a month, a day and a week quota compared (an
	// hour quota is not).
	waitFor(t, 30*time.Second, "the three keys compared", func() bool {
		return counterValue(t, reg, "limitmesh_reconcile_checks_total", map[string]string{"policy": "acme"}) >= 9
	})
	if v := counterValue(t, reg, "limitmesh_reconcile_corrections_total", map[string]string{"policy": "acme"}); v != 1 {
		t.Fatalf("corrections %v, want 1", v)
	}
	mu.Lock()
	sort.Strings(asked)
	got := strings.Join(asked, " ")
	mu.Unlock()
	if got != "p.acme.tenant=t0 p.acme.tenant=t1 p.acme.tenant=t2" {
		t.Fatalf("compared %s", got)
	}
}
