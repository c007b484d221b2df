package lease

import (
	"errors"
	"testing"
)

// TestPoolSteps: a node's pool spends its grants for plain decisions
// (the one ending first), carves sub-grants for gateways from the one
// ending last, takes returned sub-grant units back, asks the owner for
// more when under half a grant is held for the next quarter ttl, and
// returns its grants at their deadline or when unused for a quarter ttl.
func TestPoolSteps(t *testing.T) {
	seq := uint64(100)
	pl := NewPool(acmeParams, func() uint64 { seq++; return seq }) // size 10, ttl 2 s: deadline = sent + 1.8 s
	if r, _, _ := pl.Spend(0, u); r != Remote {
		t.Fatalf("empty pool spends: %v", r)
	}
	want, ok := pl.WantAcquire(0)
	if !ok || want != 10*u {
		t.Fatalf("WantAcquire = %d %v", want, ok)
	}
	if _, ok := pl.WantAcquire(0); ok {
		t.Fatal("a second acquire while one is in flight")
	}
	pl.Granted(0, 1, 7, 10*u, 2*s) // deadline 1.8 s
	if r, left, _ := pl.Spend(10*ms, 3*u); r != Spent || left != 7*u {
		t.Fatalf("spend = %v %d", r, left)
	}
	// 7 held for the next quarter ttl: no acquire; after spending 3
	// more, 4 < 5: acquire.
	if _, ok := pl.WantAcquire(10 * ms); ok {
		t.Fatal("acquire with 7 held")
	}
	pl.Spend(20*ms, 3*u)
	if _, ok := pl.WantAcquire(20 * ms); !ok {
		t.Fatal("no acquire with 4 held")
	}
	pl.Granted(100*ms, 2, 7, 10*u, 2*s) // deadline 1.9 s
	// A gateway's sub-grant comes from grant 2 (ends last).
	sub, ok := pl.Carve(200*ms, "gw-1", 10*u, u)
	if !ok || sub.Grant != 2 || sub.Units != 10*u || sub.ID != 101 || sub.Deadline != 1900*ms {
		t.Fatalf("carve = %+v %v", sub, ok)
	}
	// Plain spends use grant 1 (4 left); a cost of 5 fits nowhere.
	if r, _, _ := pl.Spend(300*ms, 5*u); r != Remote {
		t.Fatalf("spend 5 = %v", r)
	}
	if r, left, _ := pl.Spend(300*ms, u); r != Spent || left != 3*u {
		t.Fatalf("spend 1 = %v %d", r, left)
	}
	if err := pl.SubReport(400*ms, sub.ID, 7, 2*u, false); err != nil {
		t.Fatal(err)
	}
	if err := pl.SubReport(400*ms, sub.ID, 8, 2*u, true); !errors.Is(err, ErrUnknownGrant) {
		t.Fatalf("wrong epoch: %v", err)
	}
	if err := pl.SubReport(400*ms, sub.ID, 7, 11*u, true); !errors.Is(err, ErrBadSpend) {
		t.Fatalf("overspent: %v", err)
	}
	// Returned having spent 3: 7 back into grant 2.
	if err := pl.SubReport(500*ms, sub.ID, 7, 3*u, true); err != nil {
		t.Fatal(err)
	}
	if got := pl.Available(500 * ms); got != 3*u+7*u {
		t.Fatalf("available %d, want 10", got)
	}
	if err := pl.SubReport(500*ms, sub.ID, 7, 3*u, true); !errors.Is(err, ErrUnknownGrant) {
		t.Fatalf("returned twice: %v", err)
	}
	// Reports: both grants changed.
	rets, reps, _ := pl.Due(600 * ms)
	if len(rets) != 0 || len(reps) != 2 || reps[0].Used != 7*u || reps[1].Used != 3*u {
		t.Fatalf("due = %+v %+v", rets, reps)
	}
	// The owner refused grant 1's report (a new owner): no more reports
	// of it, but it is still spent.
	pl.MarkStale(1, 7)
	if r, _, _ := pl.Spend(700*ms, u); r != Spent {
		t.Fatal("a stale grant is not spent")
	}
	rets, reps, _ = pl.Due(1100 * ms)
	if len(rets) != 0 || len(reps) != 0 {
		t.Fatalf("due after MarkStale: %+v %+v", rets, reps)
	}
	// Unused since 700 ms, a quarter ttl later both go back, with what
	// they used.
	rets, _, _ = pl.Due(1200 * ms)
	if len(rets) != 2 || rets[0].Used != 8*u || rets[1].Used != 3*u || !pl.Idle() {
		t.Fatalf("returns = %+v, idle %v", rets, pl.Idle())
	}
}

// TestPoolRefusals: an Exhausted answer denies here until its retry time;
// a Full (or failed) answer sends decisions to the owner for a while; a
// sub-grant is never carved from a grant ending within a quarter ttl.
func TestPoolRefusals(t *testing.T) {
	var seq uint64
	pl := NewPool(acmeParams, func() uint64 { seq++; return seq })
	pl.Spend(0, u)
	pl.WantAcquire(0)
	pl.Refused(0, Exhausted, 300*ms)
	if r, _, ra := pl.Spend(100*ms, u); r != Denied || ra != 200*ms {
		t.Fatalf("spend = %v %d", r, ra)
	}
	if _, ok := pl.WantAcquire(100 * ms); ok {
		t.Fatal("acquire while denied")
	}
	if _, ok := pl.WantAcquire(300 * ms); !ok {
		t.Fatal("no acquire after the retry time")
	}
	pl.Refused(300*ms, Full, 5*s)
	if r, _, _ := pl.Spend(400*ms, u); r != Remote {
		t.Fatal("Full denies")
	}
	if _, ok := pl.WantAcquire(799 * ms); ok {
		t.Fatal("acquire within a quarter ttl of Full")
	}
	if _, ok := pl.WantAcquire(800 * ms); !ok {
		t.Fatal("no acquire a quarter ttl after Full")
	}
	pl.Granted(800*ms, 1, 1, 10*u, 2*s) // deadline 2.6 s
	if _, ok := pl.Carve(2101*ms, "gw", u, u); ok {
		t.Fatal("carved from a grant ending within a quarter ttl")
	}
	if _, ok := pl.Carve(2100*ms, "gw", u, u); !ok {
		t.Fatal("no carve from a grant ending in a quarter ttl")
	}
	if h := pl.Drain(); len(h) != 1 || pl.Idle() {
		t.Fatalf("drain = %+v (the sub-grant stays until it ends)", h)
	}
	if _, _, ended := pl.Due(2600 * ms); len(ended) != 1 || !pl.Idle() {
		t.Fatalf("the sub-grant did not end with its grant: %v", ended)
	}
}

// TestPoolReturnsUsedUp: a grant used up (holding less than the last
// cost asked), with no sub-grant of it out, is returned at the next Due
// (it only counts against max_outstanding); one with a sub-grant out waits
// for it.
func TestPoolReturnsUsedUp(t *testing.T) {
	var seq uint64
	pl := NewPool(acmeParams, func() uint64 { seq++; return seq })
	pl.Granted(0, 1, 7, 10*u, 2*s)
	pl.Granted(0, 2, 7, 10*u, 2*s)
	pl.Spend(10*ms, 10*u) // grant 1 (both end together: the first)
	sub, _ := pl.Carve(10*ms, "gw", 10*u, u)
	rets, _, _ := pl.Due(20 * ms)
	if len(rets) != 1 || rets[0].ID != 1 || rets[0].Used != 10*u {
		t.Fatalf("returns %+v, want grant 1 wholly used", rets)
	}
	if err := pl.SubReport(30*ms, sub.ID, 7, 10*u, true); err != nil {
		t.Fatal(err)
	}
	if rets, _, _ := pl.Due(30 * ms); len(rets) != 1 || rets[0].ID != 2 {
		t.Fatalf("returns %+v, want grant 2 once its sub-grant came back", rets)
	}
}

// TestPoolIdleAsksNothing: a pool whose key was used and then left idle
// neither keeps nor asks for grants: from a quarter ttl without use, Due
// returns what it holds and WantAcquire asks for nothing, so an idle key
// costs its owner no grant written and returned every look.
func TestPoolIdleAsksNothing(t *testing.T) {
	var seq uint64
	pl := NewPool(acmeParams, func() uint64 { seq++; return seq }) // ttl 2 s
	if _, ok := pl.WantAcquire(0); !ok {
		t.Fatal("no acquire for a new pool")
	}
	pl.Granted(0, 1, 7, 10*u, 2*s)
	pl.Spend(0, 7*u)
	pl.Spend(50*ms, u) // 2 left: under half a grant
	acquires, returns := 0, 0
	for now := 60 * ms; now < 2*s; now += 10 * ms {
		rets, _, _ := pl.Due(now)
		returns += len(rets)
		if want, ok := pl.WantAcquire(now); ok {
			acquires++
			pl.Granted(now, 100+uint64(acquires), 7, want, 2*s)
		}
	}
	// While used (until 50 ms + a quarter ttl) one more grant may come;
	// both are returned once idle, and nothing more is asked.
	if acquires > 1 || returns != acquires+1 {
		t.Fatalf("%d acquires and %d returns for a key idle from 50 ms", acquires, returns)
	}
}
