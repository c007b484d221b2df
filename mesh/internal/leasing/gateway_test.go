package leasing

import (
	"errors"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/mesh/internal/lease"
	"github.com/limitmesh/limitmesh/policies"
)

func TestDescriptorOf(t *testing.T) {
	d, err := descriptorOf(map[string]string{"tenant": "acme", "operation": "search", "b": "1"})
	if err != nil {
		t.Fatal(err)
	}
	want, _ := policies.NewDescriptor([]policies.Dim{{Name: "b", Value: "1"}, {Name: "operation", Value: "search"}, {Name: "tenant", Value: "acme"}})
	if fmt.Sprint(d) != fmt.Sprint(want) {
		t.Errorf("descriptor %v, want %v (in name order)", d, want)
	}
	if _, err := descriptorOf(nil); err == nil {
		t.Error("an empty descriptor")
	}
}

// TestGatewaySize: a gateway's sub-grant is what it asks for, the grant
// size when it names none, never below its minimum, and at least a
// micro-unit.
func TestGatewaySize(t *testing.T) {
	for _, c := range []struct {
		want, min, gotWant, gotLeast int64
	}{
		{0, 0, 10 * u, 1},
		{3 * u, 0, 3 * u, 1},
		{0, 2 * u, 10 * u, 2 * u},
		{u, 4 * u, 4 * u, 4 * u},
		{50 * u, u, 50 * u, u}, // the pool caps it at the grant size
	} {
		w, l := gatewaySize(gatewayRequest{Op: opAcquire, Want: c.want, Min: c.min}, acme)
		if w != c.gotWant || l != c.gotLeast {
			t.Errorf("want %d min %d: (%d, %d), want (%d, %d)", c.want, c.min, w, l, c.gotWant, c.gotLeast)
		}
	}
}

// TestCarveOnce: the steps of carving a sub-grant (ms on the node's
// clock), with the owner's answers in between.
func TestCarveOnce(t *testing.T) {
	pl := newPool()
	step := func(at, want, least int64, result string, ask int64) carveStep {
		t.Helper()
		st := carveOnce(pl, at*ms, "gw-1", want*u, least*u)
		if st.result != result || st.ask != ask*u {
			t.Fatalf("t=%d ms: %+v, want result %q ask %d units", at, st, result, ask)
		}
		return st
	}
	step(0, 4, 1, "", 10)                                                                                         // nothing held: ask the owner, then wait
	step(1, 4, 1, "", 0)                                                                                          // the acquire is in flight: wait for it
	applyAcquire(pl, 0, 5*ms, reply{Result: resGranted, Grant: 7, Epoch: 41, Units: 10 * u, TTL: 2000 * ms}, nil) // deadline 1800
	st := step(10, 4, 1, resGranted, 0)
	if st.sub.Units != 4*u || st.sub.Epoch != 41 || st.sub.Grant != 7 || st.ttl != 1790*ms {
		t.Fatalf("sub-grant %+v ttl %d", st.sub, st.ttl)
	}
	st = step(20, 50, 1, resGranted, 0) // capped by what the grant holds
	if st.sub.Units != 6*u {
		t.Fatalf("second sub-grant %+v", st.sub)
	}
	// Nothing left in the grant: ask for the next one and wait.
	step(30, 1, 1, "", 10)
	applyAcquire(pl, 30*ms, 40*ms, reply{Result: resFull, RetryAfter: 200 * ms}, nil)
	step(50, 1, 1, resRemote, 0) // the owner has no room: remote until 240
	step(240, 1, 1, "", 10)
	applyAcquire(pl, 240*ms, 250*ms, reply{Result: resExhausted, RetryAfter: 300 * ms}, nil)
	st = step(300, 1, 1, resExhausted, 0)
	if st.retry != 250*ms {
		t.Fatalf("retry %d, want 250 ms", st.retry)
	}
	// A grant ending within a quarter ttl is not carved from.
	pl = newPool()
	pl.WantAcquire(0)
	applyAcquire(pl, 0, 5*ms, reply{Result: resGranted, Grant: 8, Epoch: 41, Units: 10 * u, TTL: 2000 * ms}, nil) // deadline 1800
	step(1300, 1, 1, resGranted, 0)
	step(1301, 1, 1, "", 10)
}

func TestReplies(t *testing.T) {
	st := carveStep{result: resGranted, sub: lease.Sub{ID: 90211, Epoch: 41, Units: 4 * u}, ttl: 1700 * ms}
	want := reply{Result: resGranted, Policy: "acme", Revision: 3, Grant: 90211, Epoch: 41, Units: 4 * u, TTL: 1700 * ms, ReportTo: "rl.v1.lease.node.eu-1"}
	if got := subGrantReply(acme, st, "rl.v1.lease.node.eu-1"); got != want {
		t.Errorf("granted: %+v, want %+v", got, want)
	}
	want = reply{Result: resExhausted, Policy: "acme", Revision: 3, RetryAfter: 250 * ms}
	if got := subGrantReply(acme, carveStep{result: resExhausted, retry: 250 * ms}, "x"); got != want {
		t.Errorf("exhausted: %+v, want %+v", got, want)
	}
	want = reply{Result: resRemote, Policy: "acme", Revision: 3}
	if got := subGrantReply(acme, carveStep{result: resRemote}, "x"); got != want {
		t.Errorf("remote: %+v, want %+v", got, want)
	}
	for err, res := range map[error]string{
		nil: resOK, lease.ErrBadSpend: resBadSpend, fmt.Errorf("x: %w", lease.ErrBadSpend): resBadSpend,
		lease.ErrUnknownGrant: resUnknown, errors.New("other"): resUnknown,
	} {
		if got := subReportReply(err); got.Result != res {
			t.Errorf("%v: %s, want %s", err, got.Result, res)
		}
	}
}

// TestHolderSubGrants: the holder registers each sub-grant it carves, so
// a gateway's report or return reaches the pool it came from; a return
// gives the unspent units back to the node's grant and forgets the
// sub-grant; a sub-grant past its deadline is unknown. No request leaves
// the node: the pool holds the grant the sub-grants are carved from.
func TestHolderSubGrants(t *testing.T) {
	clk := newClock()
	m, err := newMetrics(nil)
	if err != nil {
		t.Fatal(err)
	}
	h := newHolder(Config{Runtime: clk, Timeout: time.Second, Log: slog.New(slog.DiscardHandler)}, m)
	const key = "p.acme.tenant=a"
	e := h.entry(acme, key, 3)
	e.pool.WantAcquire(h.now())
	applyAcquire(e.pool, h.now(), h.now(), reply{Result: resGranted, Grant: 7, Epoch: 41, Units: 10 * u, TTL: 2000 * ms}, nil)
	e.mu.Unlock()

	st, _ := h.carve(acme, key, 3, "gw-1", 4*u, u)
	if st.result != resGranted || st.sub.Units != 4*u {
		t.Fatalf("carve: %+v", st)
	}
	id := st.sub.ID
	for _, c := range []struct {
		name  string
		id    uint64
		epoch uint64
		spent int64
		ret   bool
		want  error
	}{
		{"report", id, 41, 1 * u, false, nil},
		{"another epoch", id, 40, 1 * u, false, lease.ErrUnknownGrant},
		{"another node's", id + 1000, 41, 1 * u, false, lease.ErrUnknownGrant},
		{"return overspent", id, 41, 5 * u, true, lease.ErrBadSpend},
		{"return", id, 41, 3 * u, true, nil},
		{"returned twice", id, 41, 3 * u, true, lease.ErrUnknownGrant},
	} {
		if err := h.subReport(c.id, c.epoch, c.spent, c.ret); !errors.Is(err, c.want) && err != c.want {
			t.Fatalf("%s: %v, want %v", c.name, err, c.want)
		}
	}
	// The unspent unit is back in the node's grant: 10 − 3 spent by the
	// gateway.
	e = h.entry(acme, key, 3)
	avail := e.pool.Available(h.now())
	e.mu.Unlock()
	if avail != 7*u {
		t.Fatalf("available after the return: %d, want 7 units", avail)
	}
	st, _ = h.carve(acme, key, 3, "gw-2", 2*u, u)
	if st.result != resGranted {
		t.Fatalf("carve: %+v", st)
	}
	clk.advance(1800 * time.Millisecond) // the grant's deadline, and its sub-grant's
	if err := h.subReport(st.sub.ID, 41, u, false); !errors.Is(err, lease.ErrUnknownGrant) {
		t.Fatalf("report past the deadline: %v", err)
	}
}
