package integration

import (
	"context"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
)

// TestDenialsWriteNoJournal: on a node with the state journal, a key
// flooded with denials and dry runs (no request_id) appends nothing to the
// journal (so nothing reaches the state bucket either: it is written only
// from the journal); a denial with a request_id appends its dedupe entry.
func TestDenialsWriteNoJournal(t *testing.T) {
	_, tn, _ := single(t)
	desc := map[string]string{"tenant": "flooded"}
	if r := decide(t, tn.nc, "rl.v1.decide", req(desc, `"cost":40`)); !r.Allowed {
		t.Fatalf("spending the burst: %+v", r)
	}
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	js, _ := jetstream.New(tn.nc)
	journal, err := js.Stream(ctx, "RL_JOURNAL")
	if err != nil {
		t.Fatal(err)
	}
	last := func() uint64 {
		ji, err := journal.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return ji.State.LastSeq
	}
	j0 := last()
	for i := range 300 {
		extra := ""
		if i%3 == 0 {
			extra = `"dry_run":true`
		}
		if r := decide(t, tn.nc, "rl.v1.decide", req(desc, extra)); r.Code != "" || r.Allowed {
			t.Fatalf("denial %d: %+v", i, r)
		}
	}
	if j1 := last(); j1 != j0 {
		t.Fatalf("300 denials appended %d journal messages, want none", j1-j0)
	}
	if r := decide(t, tn.nc, "rl.v1.decide", req(desc, `"request_id":"r1"`)); r.Allowed {
		t.Fatalf("denial with a request_id: %+v", r)
	}
	waitFor(t, "the dedupe entry journalled", func() bool { return last() == j0+1 })
}
