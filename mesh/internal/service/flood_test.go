package service

import (
	"encoding/json"
	"sync/atomic"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/storetest"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
)

// countingStore is a memStore that counts the writes started.
type countingStore struct {
	memStore
	updates atomic.Int64
}

func (c *countingStore) UpdateAsync(key string, val []byte, us []keyrec.Usage, rev uint64, timeout time.Duration, done func(uint64, error)) {
	c.updates.Add(1)
	c.memStore.UpdateAsync(key, val, us, rev, timeout, done)
}

// benchmarkHandleDenied is the node's own cost of one decision that is
// denied (decode, match, key, owner core, reply, metrics) on a key whose
// burst is spent, without NATS: the cost of a request in a flood of
// rejected traffic.
func benchmarkHandleDenied(b *testing.B, mode string) {
	p := tbPolicy(b, "p", 4, "1/h", 1, `,"mode":"`+mode+`"`)
	st := &countingStore{memStore: memStore{storetest.NewMem()}}
	n := offlineService(b, st, time.Second, p)
	req := &nopRequest{data: []byte(`{"descriptor":{"tenant":"flood"},"cost":"1"}`)}
	// The first request spends the burst: every later one is denied. Wait
	// for its write (strict) before measuring.
	r := &fakeRequest{data: req.data, out: make(chan fakeReply, 1)}
	n.Handle(r)
	<-r.out
	for range 10 {
		n.Handle(req)
	}
	// Wait for the admission's write (strict: before its reply; async:
	// the write-behind).
	for n.Inflight() != 0 || st.updates.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(10 * time.Millisecond)
	writes := st.updates.Load()
	b.ReportAllocs()
	for b.Loop() {
		n.Handle(req)
	}
	b.StopTimer()
	for n.Inflight() != 0 {
		time.Sleep(time.Millisecond)
	}
	if w := st.updates.Load(); w != writes {
		b.Fatalf("denials wrote state: %d writes, want %d", w, writes)
	}
}

func BenchmarkHandleDeniedStrict(b *testing.B) { benchmarkHandleDenied(b, "strict") }
func BenchmarkHandleDeniedAsync(b *testing.B)  { benchmarkHandleDenied(b, "async") }

// TestMaxKeysOverflowKey: keys beyond a policy's max_keys share its
// overflow key (one state, the policy's limits) and are counted in
// limitmesh_overflow_total; the live keys keep their own state; dry runs
// are answered from the overflow key but not counted.
func TestMaxKeysOverflowKey(t *testing.T) {
	for _, mode := range []string{"strict", "async", "local"} {
		t.Run(mode, func(t *testing.T) {
			p := tbPolicy(t, "p", 1, "1/h", 1, `,"max_keys":2,"mode":"`+mode+`"`)
			n := offlineService(t, memStore{storetest.NewMem()}, 5*time.Second, p)
			body := func(tenant, extra string) string { return `{"descriptor":{"tenant":"` + tenant + `"}` + extra + `}` }
			steps := []struct {
				tenant, extra string
				allowed       bool
				overflow      float64
			}{
				{"t1", "", true, 0},
				{"t2", "", true, 0},
				{"t3", `,"dry_run":true`, true, 0}, // the overflow key, fresh
				{"t3", "", true, 1},                // the overflow key's burst
				{"t4", "", false, 2},               // shares it: spent
				{"t3", "", false, 3},
				{"t5", `,"request_id":"r1"`, false, 4},
				{"t1", "", false, 4}, // its own state, spent
				{"t2", `,"dry_run":true`, false, 4},
			}
			for i, s := range steps {
				rep := n.decideOffline(t, body(s.tenant, s.extra))
				var d struct {
					Allowed bool
					Policy  string
				}
				if rep.code != "" || json.Unmarshal(rep.body, &d) != nil || d.Allowed != s.allowed || d.Policy != "p" {
					t.Fatalf("step %d (%s%s): %s %s, want allowed %v by p", i, s.tenant, s.extra, rep.code, rep.body, s.allowed)
				}
				if got := n.counterValue(t, "limitmesh_overflow_total"); got != s.overflow {
					t.Fatalf("step %d: limitmesh_overflow_total %v, want %v", i, got, s.overflow)
				}
			}
		})
	}
}

// BenchmarkHandleOverflowed is the node's own cost of a request for a key
// beyond its policy's max_keys, decided (denied) against the policy's
// overflow key: the key is known absent, so no read; the call goes to the
// overflow key's owner (here).
func BenchmarkHandleOverflowed(b *testing.B) {
	p := tbPolicy(b, "p", 4, "1/h", 1, `,"max_keys":1`)
	n := offlineService(b, memStore{storetest.NewMem()}, time.Second, p)
	for _, body := range []string{`{"descriptor":{"tenant":"live"}}`, `{"descriptor":{"tenant":"over"}}`, `{"descriptor":{"tenant":"over"}}`} {
		r := &fakeRequest{data: []byte(body), out: make(chan fakeReply, 1)}
		n.Handle(r)
		<-r.out
	}
	req := &nopRequest{data: []byte(`{"descriptor":{"tenant":"over"},"cost":"1"}`)}
	for range 10 {
		n.Handle(req)
	}
	for n.Inflight() != 0 {
		time.Sleep(time.Millisecond)
	}
	b.ReportAllocs()
	for b.Loop() {
		n.Handle(req)
	}
}
