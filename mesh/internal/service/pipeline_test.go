package service

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/mesh/internal/member"

	"github.com/nats-io/nats.go/jetstream"
)

// jsNode is an offline node (no micro service, no ownership) on the real
// JetStream store of an embedded server, so the key runners use the
// pipelined operations; it returns the state bucket too.
func jsNode(t *testing.T, timeout time.Duration, burst int) (*offline, jetstream.JetStream, jetstream.KeyValue) {
	t.Helper()
	js, kv, st := jsStateStore(t)
	n := offlineService(t, member.BucketStore{Bucket: st}, timeout, tbPolicy(t, "p", 1, "1/h", burst, ""))
	return n, js, kv
}

// decideAll sends perKey concurrent requests for each of keys tenants and
// returns the admissions per tenant; any reply other than a decision
// fails the test.
func decideAll(t *testing.T, n *offline, keys, perKey int) []int {
	t.Helper()
	var (
		mu      sync.Mutex
		allowed = make([]int, keys)
		wg      sync.WaitGroup
		fail    = make(chan string, keys*perKey)
	)
	for k := range keys {
		for range perKey {
			wg.Go(func() {
				r := &fakeRequest{data: fmt.Appendf(nil, `{"descriptor":{"tenant":"t%d"}}`, k), out: make(chan fakeReply, 1)}
				n.Handle(r)
				select {
				case rep := <-r.out:
					var d struct{ Allowed bool }
					if rep.code != "" || json.Unmarshal(rep.body, &d) != nil {
						fail <- fmt.Sprintf("t%d: %s %s", k, rep.code, rep.body)
						return
					}
					if d.Allowed {
						mu.Lock()
						allowed[k]++
						mu.Unlock()
					}
				case <-time.After(10 * time.Second):
					fail <- fmt.Sprintf("t%d: no reply", k)
				}
			})
		}
	}
	wg.Wait()
	close(fail)
	for f := range fail {
		t.Error(f)
	}
	return allowed
}

// Strict decisions through the pipelined store are exact: with many keys'
// writes in flight at once and other writers bumping every key's revision
// in between (each owner's next write loses its CAS and reloads), every
// key admits exactly its burst.
func TestPipelinedStrictExact(t *testing.T) {
	const keys, burst = 24, 5
	n, _, kv := jsNode(t, 5*time.Second, burst)
	first := decideAll(t, n, keys, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for k := range keys {
		if first[k] != 2 {
			t.Fatalf("t%d: %d of 2 admitted on a fresh key", k, first[k])
		}
	}
	// Another writer rewrites every key (same value, new revision).
	names, err := kv.ListKeys(ctx)
	if err != nil {
		t.Fatal(err)
	}
	count := 0
	for name := range names.Keys() {
		e, err := kv.Get(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := kv.Put(ctx, name, e.Value()); err != nil {
			t.Fatal(err)
		}
		count++
	}
	if count != keys {
		t.Fatalf("%d keys stored, want %d", count, keys)
	}
	second := decideAll(t, n, keys, 3*burst)
	for k := range keys {
		if got := first[k] + second[k]; got != burst {
			t.Errorf("t%d: %d admitted in all, want exactly %d", k, got, burst)
		}
	}
	if c := n.counterValue(t, "limitmesh_cas_conflicts_total"); c < keys {
		t.Errorf("%v lost CAS writes, want at least one per key (%d)", c, keys)
	}
}

// A write that gets no answer in time fails its requests with 503, and
// the key is reloaded before it decides again.
func TestPipelinedWriteTimeoutIs503(t *testing.T) {
	n, js, _ := jsNode(t, 50*time.Millisecond, 5)
	if rep := n.decideOffline(t, `{"descriptor":{"tenant":"a"}}`); rep.code != "" {
		t.Fatalf("first request: %s %s", rep.code, rep.body)
	}
	// The stream goes away and a silent subscriber takes its subjects:
	// writes and reads are never answered.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := js.DeleteKeyValue(ctx, "rl_state"); err != nil {
		t.Fatal(err)
	}
	sub, err := js.Conn().SubscribeSync("$KV.rl_state.>")
	if err != nil {
		t.Fatal(err)
	}
	if err := js.Conn().Flush(); err != nil {
		t.Fatal(err)
	}
	rep := n.decideOffline(t, `{"descriptor":{"tenant":"a"}}`)
	if rep.code != "503" {
		t.Fatalf("unanswered write: %s %s, want 503", rep.code, rep.body)
	}
	if m, err := sub.NextMsg(time.Second); err != nil || m.Header.Get("Nats-Expected-Last-Subject-Sequence") == "" {
		t.Fatalf("the write was not published as a compare-and-swap: %v", err)
	}
	// The bucket is back, empty: the key reloads (absent) and starts full.
	if err := sub.Unsubscribe(); err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "rl_state"}); err != nil {
		t.Fatal(err)
	}
	want := `{"allowed":true,"policy":"p","revision":1,"remaining":4,`
	if rep := n.decideOffline(t, `{"descriptor":{"tenant":"a"}}`); rep.code != "" || string(rep.body[:len(want)]) != want {
		t.Fatalf("after the reload: %s %s, want prefix %s", rep.code, rep.body, want)
	}
}
