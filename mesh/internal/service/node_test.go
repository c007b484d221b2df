package service

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/storetest"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/rt"
)

func TestNodeOffline(t *testing.T) {
	p := tbPolicy(t, "p", 4, "1/h", 2, "")
	// The clock stands still: a 1/h bucket refills a micro-unit every
	// 3.6 ms of real time, so exact counts need a clock that does not move.
	n := offlineServiceOn(t, frozen{rt.Real, time.Now()}, memStore{storetest.NewMem()}, time.Second, p)
	for i, want := range []string{
		`{"allowed":true,"policy":"p","revision":4,"remaining":1,`,
		`{"allowed":true,"policy":"p","revision":4,"remaining":0,`,
		`{"allowed":false,"policy":"p","revision":4,"remaining":0,`,
	} {
		rep := n.decideOffline(t, `{"descriptor":{"tenant":"a"}}`)
		if rep.code != "" || len(rep.body) < len(want) || string(rep.body[:len(want)]) != want {
			t.Fatalf("request %d: %s %s, want prefix %s", i, rep.code, rep.body, want)
		}
	}
	if rep := n.decideOffline(t, `{"descriptor":{"nope":"x"}}`); string(rep.body) != `{"allowed":true,"policy":"","revision":0,"remaining":0,"retry_after_ms":0,"reset_after_ms":0}` {
		t.Fatalf("unmatched: %s", rep.body)
	}
	if rep := n.decideOffline(t, `{"descriptor":`); rep.code != "400" || !json.Valid(rep.body) {
		t.Fatalf("malformed: %s %s", rep.code, rep.body)
	}
}

// panicStore panics when asked to write: a bug in the store's callback
// path (where the key runners continue).
type panicStore struct{ memStore }

func (panicStore) UpdateAsync(string, []byte, []keyrec.Usage, uint64, time.Duration, func(uint64, error)) {
	panic("store bug")
}

// TestNodePanicIs500: a panic while a key's runner starts its write is
// answered with a 500, and the key is reset: the next request is decided
// again (and panics again here).
func TestNodePanicIs500(t *testing.T) {
	n := offlineService(t, panicStore{memStore{storetest.NewMem()}}, time.Second, tbPolicy(t, "p", 1, "1/s", 2, ""))
	rep := n.decideOffline(t, `{"descriptor":{"tenant":"a"}}`)
	var body struct{ Error string }
	if rep.code != "500" || json.Unmarshal(rep.body, &body) != nil || body.Error != "internal" {
		t.Fatalf("panicking store: %s %s, want 500 internal", rep.code, rep.body)
	}
	if rep := n.decideOffline(t, `{"descriptor":{"tenant":"a"}}`); rep.code != "500" {
		t.Fatalf("second request: %s %s", rep.code, rep.body)
	}
}

// slowStore answers every operation only at its timeout, with no answer:
// a store that cannot be reached.
type slowStore struct{}

func (slowStore) GetAsync(_ string, timeout time.Duration, done func([]byte, uint64, error)) {
	time.AfterFunc(timeout, func() { done(nil, 0, fmt.Errorf("no answer in time: %w", context.DeadlineExceeded)) })
}

func (slowStore) UpdateAsync(_ string, _ []byte, _ []keyrec.Usage, _ uint64, timeout time.Duration, done func(uint64, error)) {
	time.AfterFunc(timeout, func() { done(0, fmt.Errorf("no answer in time: %w", context.DeadlineExceeded)) })
}

// TestNodeUnreachableStoreIs503: a store that does not answer makes the
// request a 503 at its deadline.
func TestNodeUnreachableStoreIs503(t *testing.T) {
	n := offlineService(t, slowStore{}, 20*time.Millisecond, tbPolicy(t, "p", 1, "1/s", 2, ""))
	rep := n.decideOffline(t, `{"descriptor":{"tenant":"a"}}`)
	var body struct{ Error string }
	if rep.code != "503" || json.Unmarshal(rep.body, &body) != nil || body.Error != "unavailable" {
		t.Fatalf("unreachable store: %s %s, want 503 unavailable", rep.code, rep.body)
	}
}
