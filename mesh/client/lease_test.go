package client

import (
	"context"
	"encoding/json"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/jstest"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
)

// fakeNode answers the lease protocol (docs/protocol.md, "Leased mode")
// for the SDK's tests: acquires on rl.v1.lease with grants of its own
// making (or the answer next returns), reports and returns on its node
// subject, which it records. It stands for a node's gateway side; the
// node itself is tested in integration/leased_test.go.
type fakeNode struct {
	t    testing.TB
	next func(min int64) string // the reply to an acquire

	mu       sync.Mutex
	acquires int
	seq      uint64
	reports  []fakeReport
}

type fakeReport struct {
	Op    string `json:"op"`
	Grant uint64 `json:"grant"`
	Epoch uint64 `json:"epoch"`
	Spent int64  `json:"spent"`
}

const fakeNodeSubject = "rl.v1.lease.node.fake"

func startFakeNode(t testing.TB, nc *nats.Conn, next func(min int64) string) *fakeNode {
	t.Helper()
	f := &fakeNode{t: t, next: next}
	if _, err := nc.Subscribe("rl.v1.lease", func(m *nats.Msg) {
		var req struct {
			Op         string            `json:"op"`
			Holder     string            `json:"holder"`
			Min        int64             `json:"min"`
			Descriptor map[string]string `json:"descriptor"`
		}
		if err := json.Unmarshal(m.Data, &req); err != nil || req.Op != "acquire" || req.Holder == "" || len(req.Descriptor) == 0 {
			t.Errorf("bad acquire %s: %v", m.Data, err)
		}
		f.mu.Lock()
		f.acquires++
		f.mu.Unlock()
		_ = m.Respond([]byte(f.next(req.Min)))
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := nc.Subscribe(fakeNodeSubject, func(m *nats.Msg) {
		var r fakeReport
		if err := json.Unmarshal(m.Data, &r); err != nil {
			t.Errorf("bad report %s: %v", m.Data, err)
		}
		f.mu.Lock()
		f.reports = append(f.reports, r)
		f.mu.Unlock()
		_ = m.Respond([]byte(`{"result":"ok"}`))
	}); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	return f
}

// grantOf returns a granted reply of units micro-units for ttl.
func (f *fakeNode) grantOf(units int64, ttl time.Duration) string {
	f.mu.Lock()
	f.seq++
	id := f.seq
	f.mu.Unlock()
	b, _ := json.Marshal(map[string]any{"result": "granted", "policy": "acme", "revision": 7, "grant": id, "epoch": 3,
		"units": units, "ttl_ns": int64(ttl), "report_to": fakeNodeSubject})
	return string(b)
}

func (f *fakeNode) counts() (int, []fakeReport) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.acquires, append([]fakeReport(nil), f.reports...)
}

var acmeD = map[string]string{"tenant": "acme", "operation": "search"}

// TestLeaseSpendsLocally: the first decision asks for a grant and spends
// from it; the next ones are local (no decide request at all); spending
// past half the grant prefetches the next, so a run of decisions never
// waits; Close returns what was not spent.
func TestLeaseSpendsLocally(t *testing.T) {
	s := startServer(t)
	nc := jstest.Connect(t, s)
	var f *fakeNode
	f = startFakeNode(t, jstest.Connect(t, s), func(int64) string { return f.grantOf(10_000_000, 2*time.Second) })
	remote := startResponder(t, jstest.Connect(t, s), "rl", func(seenRequest) answer {
		return answer{Reply: `{"allowed":true,"policy":"acme","revision":7,"remaining":1}`}
	})
	c := newClient(t, nc, Leasing("gw-1"))
	ctx := context.Background()
	for i := range 6 {
		r, err := c.Decide(ctx, acmeD, 1)
		if err != nil || !r.Allowed || r.Source != SourceLease || r.Policy != "acme" || r.Revision != 7 {
			t.Fatalf("decision %d: %+v %v", i, r, err)
		}
	}
	if r, _ := c.Decide(ctx, acmeD, 1); r.Remaining != "3" {
		t.Fatalf("remaining %q after 7 of 10", r.Remaining)
	}
	l, err := c.Lease(acmeD)
	if err != nil {
		t.Fatal(err)
	}
	// The prefetch is installed once its reply arrives: wait for it.
	waitUntil(t, "the prefetch", func() bool { n, _ := f.counts(); return n == 2 && l.Held() == 13_000_000 })
	for range 13 {
		if !l.Spend(1) {
			t.Fatal("a spend of the held units failed")
		}
	}
	if len(remote.requests()) != 0 {
		t.Fatalf("%d remote decisions", len(remote.requests()))
	}
	l.Spend(0) // invalid: no effect
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	_, reps := f.counts()
	returned := map[uint64]int64{}
	for _, r := range reps {
		if r.Op == "return" {
			returned[r.Grant] = r.Spent
		}
	}
	if len(returned) != 2 || returned[1] != 10_000_000 || returned[2] != 10_000_000 {
		t.Fatalf("returns %v, want both grants wholly spent", reps)
	}
	if r, err := c.Decide(ctx, acmeD, 1); err != nil || r.Source != SourceService {
		t.Fatalf("after Close: %+v %v, want a remote decision", r, err)
	}
}

// TestLeaseDeadline: a grant is spent until the client's own clock,
// counted from the request's send, passes the ttl less the margin (a
// tenth); then it is returned with what was spent and no longer spent.
func TestLeaseDeadline(t *testing.T) {
	s := startServer(t)
	var now atomic.Int64
	clock := func() time.Time { return time.Unix(1000, now.Load()) }
	var f *fakeNode
	f = startFakeNode(t, jstest.Connect(t, s), func(int64) string {
		if n, _ := f.counts(); n > 1 {
			return `{"result":"remote","policy":"acme","revision":7}`
		}
		return f.grantOf(100_000_000, 2*time.Second)
	})
	startResponder(t, jstest.Connect(t, s), "rl", func(seenRequest) answer {
		return answer{Reply: `{"allowed":false,"policy":"acme","revision":7,"remaining":0,"retry_after_ms":100}`}
	})
	c := newClient(t, jstest.Connect(t, s), Leasing("gw-1"), Clock(clock))
	t.Cleanup(func() { _ = c.Close() })
	l, _ := c.Lease(acmeD)
	if r, err := l.Decide(context.Background(), 1); err != nil || r.Source != SourceLease {
		t.Fatalf("first: %+v %v", r, err)
	}
	now.Store(int64(1799 * time.Millisecond))
	if !l.Spend(2) {
		t.Fatal("no spend 1 ms before the deadline")
	}
	now.Store(int64(1800 * time.Millisecond))
	if l.Spend(1) {
		t.Fatal("spent at the deadline (send + ttl − ttl/10)")
	}
	if r, err := l.Decide(context.Background(), 1); err != nil || r.Source != SourceService || r.Allowed {
		t.Fatalf("after the deadline: %+v %v, want the remote denial", r, err)
	}
	waitUntil(t, "the expired grant's return", func() bool {
		_, reps := f.counts()
		return len(reps) > 0 && reps[len(reps)-1].Op == "return" && reps[len(reps)-1].Spent == 3_000_000
	})
}

// TestLeaseRefusals: "exhausted" denies locally for the retry time, with
// no decide request; "not_leased" and no lease responders decide remotely.
func TestLeaseRefusals(t *testing.T) {
	s := startServer(t)
	var next atomic.Value
	next.Store(`{"result":"exhausted","policy":"acme","revision":7,"retry_after_ns":300000000}`)
	startFakeNode(t, jstest.Connect(t, s), func(int64) string { return next.Load().(string) })
	remote := startResponder(t, jstest.Connect(t, s), "rl", func(seenRequest) answer {
		return answer{Reply: `{"allowed":true,"policy":"strictly","revision":2,"remaining":5}`}
	})
	c := newClient(t, jstest.Connect(t, s), Leasing(""))
	t.Cleanup(func() { _ = c.Close() })
	r, err := c.Decide(context.Background(), acmeD, 1)
	if err != nil || r.Allowed || r.Source != SourceLease || r.RetryAfter != 300*time.Millisecond {
		t.Fatalf("exhausted: %+v %v", r, err)
	}
	if r, _ := c.Decide(context.Background(), acmeD, 1); r.Allowed || r.Source != SourceLease || len(remote.requests()) != 0 {
		t.Fatalf("second while denied: %+v (%d remote)", r, len(remote.requests()))
	}
	next.Store(`{"result":"not_leased","policy":"strictly","revision":2}`)
	other := map[string]string{"tenant": "birch"}
	if r, err := c.Decide(context.Background(), other, 1); err != nil || !r.Allowed || r.Source != SourceService || r.Policy != "strictly" {
		t.Fatalf("not leased: %+v %v", r, err)
	}
	c2 := newClient(t, jstest.Connect(t, startServerWithDecide(t)), Leasing(""))
	t.Cleanup(func() { _ = c2.Close() })
	if r, err := c2.Decide(context.Background(), other, 1); err != nil || r.Source != SourceService {
		t.Fatalf("no lease responders: %+v %v", r, err)
	}
	// A request_id is always decided remotely.
	if r, _ := c.Decide(context.Background(), acmeD, 1, RequestID("x")); r.Source != SourceService {
		t.Fatalf("request_id: %+v", r)
	}
}

// startServerWithDecide starts a server with only a decide responder.
func startServerWithDecide(t *testing.T) *server.Server {
	s := startServer(t)
	startResponder(t, jstest.Connect(t, s), "rl", func(seenRequest) answer {
		return answer{Reply: `{"allowed":true,"policy":"","revision":0,"remaining":0}`}
	})
	return s
}

// TestLeaseConcurrentSpends: goroutines racing on one grant spend exactly
// its units, never more.
func TestLeaseConcurrentSpends(t *testing.T) {
	s := startServer(t)
	var f *fakeNode
	f = startFakeNode(t, jstest.Connect(t, s), func(int64) string {
		if n, _ := f.counts(); n > 1 {
			return `{"result":"exhausted","retry_after_ns":1000000000}`
		}
		return f.grantOf(1000, 2*time.Second)
	})
	c := newClient(t, jstest.Connect(t, s), Leasing("gw"))
	t.Cleanup(func() { _ = c.Close() })
	l, _ := c.Lease(acmeD)
	if _, err := l.Decide(context.Background(), 0, Cost("0.000001")); err != nil {
		t.Fatal(err)
	}
	var ok atomic.Int64
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 500 {
				if l.SpendMicro(1) {
					ok.Add(1)
				}
			}
		})
	}
	wg.Wait()
	if got := ok.Load(); got != 999 {
		t.Fatalf("%d spends of a 1000 micro-unit grant after 1, want 999", got)
	}
}

// BenchmarkLeaseSpend: a spend on a held grant, one goroutine per CPU
// (the grant's counter is shared: -cpu 1,2 shows how it scales).
func BenchmarkLeaseSpend(b *testing.B) {
	s := startServer(b)
	c := newClient(b, jstest.Connect(b, s), Leasing("gw"))
	b.Cleanup(func() { _ = c.Close() })
	l, _ := c.Lease(acmeD)
	g := &grant{units: 1 << 62, low: 0, deadline: 1 << 62, ttl: int64(time.Hour), reportTo: "nowhere"}
	g.left.Store(1 << 62)
	l.slots[0].Store(g)
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if !l.Spend(1) {
				b.Fatal("spend failed")
			}
		}
	})
}

// waitUntil polls cond every few ms, failing after 10 s.
func waitUntil(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// TestLeaseCoarseClock: with the default clock the spend path reads the
// coarse clock, and a grant still stops being spent after its deadline.
func TestLeaseCoarseClock(t *testing.T) {
	s := startServer(t)
	var f *fakeNode
	f = startFakeNode(t, jstest.Connect(t, s), func(int64) string {
		if n, _ := f.counts(); n > 1 {
			return `{"result":"remote"}`
		}
		return f.grantOf(1<<50, 100*time.Millisecond)
	})
	c := newClient(t, jstest.Connect(t, s), Leasing("gw"))
	t.Cleanup(func() { _ = c.Close() })
	l, _ := c.Lease(acmeD)
	sent := time.Now()
	if r, err := l.Decide(context.Background(), 1); err != nil || r.Source != SourceLease {
		t.Fatalf("first: %+v %v", r, err)
	}
	waitUntil(t, "the grant's deadline", func() bool { return !l.Spend(1) })
	// The coarse clock reads a tick ahead: spending may stop up to a
	// tick early, never late; far earlier would be a wrong deadline.
	if elapsed := time.Since(sent); elapsed < 80*time.Millisecond {
		t.Fatalf("stopped spending after %v, long before the deadline (90ms)", elapsed)
	}
}
