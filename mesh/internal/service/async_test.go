package service

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/mesh/internal/member"
)

// TestAsyncBlindStartOnJetStream drives the blind async start through a
// node on a real JetStream store: a node that has never read a key which
// another node already spent decides its first call against the empty
// record (the documented overshoot), its write-behind loses the create,
// and after the reload it decides from the stored record.
func TestAsyncBlindStartOnJetStream(t *testing.T) {
	_, kv, st := jsStateStore(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	p := tbPolicy(t, "p", 1, "1/h", 5, `,"mode":"async"`)
	poll := func(what string, done func() bool) {
		t.Helper()
		tk := time.NewTicker(2 * time.Millisecond)
		defer tk.Stop()
		for !done() {
			select {
			case <-ctx.Done():
				t.Fatalf("waiting for %s: %v", what, ctx.Err())
			case <-tk.C:
			}
		}
	}
	decide := func(n *offline, cost int, allowed bool, remaining int) {
		t.Helper()
		rep := n.decideOffline(t, `{"descriptor":{"tenant":"a"},"cost":`+fmt.Sprint(cost)+`}`)
		want := `{"allowed":` + map[bool]string{true: "true", false: "false"}[allowed] + `,"policy":"p","revision":1,"remaining":` + fmt.Sprint(remaining) // whole units (a denial may show a refilled fraction)
		if rep.code != "" || !strings.HasPrefix(string(rep.body), want) {
			t.Fatalf("cost %d: %s %s, want prefix %s", cost, rep.code, rep.body, want)
		}
	}

	n1 := offlineService(t, member.BucketStore{Bucket: st}, time.Second, p)
	decide(n1, 5, true, 0)
	poll("the first node's write-behind", func() bool {
		keys, err := kv.ListKeys(ctx)
		if err != nil {
			t.Fatal(err)
		}
		count := 0
		for range keys.Keys() {
			count++
		}
		return count == 1
	})

	n2 := offlineService(t, member.BucketStore{Bucket: st}, time.Second, p)
	decide(n2, 1, true, 4) // blind: decided against the empty record
	poll("the lost create", func() bool { return n2.counterValue(t, "limitmesh_async_lost_writes_total") >= 1 })
	decide(n2, 1, false, 0) // reloaded: the stored record has nothing left
	// A lost blind create is an expected conflict, retried: counted.
	if c := n2.counterValue(t, "limitmesh_cas_conflicts_total"); c != 1 {
		t.Fatalf("a lost blind create counted as %v CAS conflicts, want 1", c)
	}
}
