package leasing

import (
	"errors"
	"testing"

	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/keys"
	"github.com/limitmesh/limitmesh/mesh/internal/lease"
)

// TestApplyAcquire: the owner's answer to an acquire, on the holder's
// clock (ms). A grant is spent until 1.8 s (ttl less the margin) after the
// request was sent, however late the answer came; exhausted denies here
// for the owner's retry time (at most a ttl); full, another answer or
// none sends requests to the owner for its retry time (at most a quarter
// ttl; a twentieth without one).
func TestApplyAcquire(t *testing.T) {
	type check struct {
		at    int64 // ms
		want  lease.SpendResult
		retry int64 // ms, for Denied
	}
	for _, c := range []struct {
		name       string
		sent, recv int64 // ms
		r          reply
		err        error
		checks     []check
	}{
		{"granted, answered late", 1000, 1700, reply{Result: resGranted, Grant: 7, Epoch: 41, Units: 10 * u, TTL: 2000 * ms}, nil,
			[]check{{at: 1700, want: lease.Spent}, {at: 2799, want: lease.Spent}, {at: 2800, want: lease.Remote}}},
		{"granted nothing", 1000, 1010, reply{Result: resGranted, Grant: 7, Units: 0, TTL: 2000 * ms}, nil,
			[]check{{at: 1010, want: lease.Remote}}},
		{"exhausted", 1000, 1010, reply{Result: resExhausted, RetryAfter: 300 * ms}, nil,
			[]check{{at: 1010, want: lease.Denied, retry: 300}, {at: 1200, want: lease.Denied, retry: 110}, {at: 1310, want: lease.Remote}}},
		{"exhausted for longer than a ttl", 1000, 1010, reply{Result: resExhausted, RetryAfter: 60_000 * ms}, nil,
			[]check{{at: 3009, want: lease.Denied, retry: 1}, {at: 3010, want: lease.Remote}}},
		{"full", 1000, 1010, reply{Result: resFull, RetryAfter: 300 * ms}, nil, []check{{at: 1010, want: lease.Remote}}},
		{"no answer", 1000, 1500, reply{}, errors.New("timeout"), []check{{at: 1500, want: lease.Remote}}},
	} {
		t.Run(c.name, func(t *testing.T) {
			pl := newPool()
			pl.Spend(c.sent*ms, u) // a request asks for a grant (Remote: none held)
			if _, ask := pl.WantAcquire(c.sent * ms); !ask {
				t.Fatal("no acquire asked")
			}
			applyAcquire(pl, c.sent*ms, c.recv*ms, c.r, c.err)
			if pl.Acquiring() {
				t.Fatal("still acquiring after the answer")
			}
			for _, k := range c.checks {
				r, _, retry := pl.Spend(k.at*ms, u)
				if r != k.want || r == lease.Denied && retry != k.retry*ms {
					t.Fatalf("spend at %d ms: %v (retry %d ns), want %v (retry %d ms)", k.at, r, retry, k.want, k.retry)
				}
			}
		})
	}
}

// TestApplyAcquireBackoff: after full or no answer the pool does not ask
// again before the owner's retry time (capped at a quarter ttl), or a
// twentieth of a ttl when it gave none.
func TestApplyAcquireBackoff(t *testing.T) {
	for _, c := range []struct {
		name  string
		r     reply
		err   error
		again int64 // ms after the answer
	}{
		{"full", reply{Result: resFull, RetryAfter: 300 * ms}, nil, 300},
		{"full for longer than a quarter ttl", reply{Result: resFull, RetryAfter: 5000 * ms}, nil, 500},
		{"not leased", reply{Result: resNotLeased}, nil, 100},
		{"no answer", reply{}, errors.New("no responders"), 100},
	} {
		pl := newPool()
		pl.Spend(0, u)
		pl.WantAcquire(0)
		applyAcquire(pl, 0, 10*ms, c.r, c.err)
		if _, ask := pl.WantAcquire((10+c.again)*ms - 1); ask {
			t.Errorf("%s: asked again before %d ms", c.name, c.again)
		}
		pl.Spend((10+c.again)*ms, u)
		if _, ask := pl.WantAcquire((10 + c.again) * ms); !ask {
			t.Errorf("%s: did not ask again at %d ms", c.name, c.again)
		}
	}
}

// clockAt is a node's monotonic clock: offset + rate·t at real instant t
// (rate in parts per million of real time).
type clockAt struct{ offset, ppm int64 }

func (c clockAt) at(t int64) int64 { return c.offset + t*c.ppm/1_000_000 }

// TestExpiryUnderSkew: a grant travels from the owner (ownerReply: its
// ttl) to the holder (applyAcquire: its deadline), with clocks at
// different rates. The holder never spends it after the owner stopped
// counting it (L4: Expires plus the margin on the owner's clock), while
// the holder's clock runs at most 10% slower than the owner's; the two
// margins leave some room beyond, and a holder clock 20% slow breaks it,
// which the test must see.
func TestExpiryUnderSkew(t *testing.T) {
	const ttl = 2000 * ms
	const sendAt, grantAt, recvAt = 0, 5 * ms, 10 * ms // real instants
	for _, c := range []struct {
		name          string
		holder, owner clockAt
		overlap       bool
	}{
		{"same rate", clockAt{7 * ms, 1_000_000}, clockAt{1 << 40, 1_000_000}, false},
		{"holder 10% slow", clockAt{0, 900_000}, clockAt{0, 1_000_000}, false},
		{"owner 10% fast", clockAt{0, 1_000_000}, clockAt{0, 1_100_000}, false},
		{"owner slow", clockAt{0, 1_000_000}, clockAt{0, 800_000}, false},
		{"holder 20% slow", clockAt{0, 800_000}, clockAt{0, 1_000_000}, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			at := c.owner.at(grantAt)
			g := keyrec.Grant{ID: 1, Epoch: 9, Units: 10 * u, At: at, Expires: at + ttl}
			r := ownerReply(&keys.Call{}, &keys.LeaseOp{Acquire: &lease.AcquireReq{},
				Acquired: lease.AcquireResult{Outcome: lease.Granted, Grant: g}})
			pl := newPool()
			pl.WantAcquire(c.holder.at(sendAt))
			applyAcquire(pl, c.holder.at(sendAt), c.holder.at(recvAt), r, nil)
			overlap := int64(-1)
			for rt := recvAt; rt < 3*ttl; rt += ms {
				spendable := pl.Available(c.holder.at(rt)) > 0
				counted := lease.Outstanding([]keyrec.Grant{g}, c.owner.at(rt), lease.Margin(ttl)) > 0
				if spendable && !counted {
					overlap = rt
					break
				}
			}
			if got := overlap >= 0; got != c.overlap {
				t.Fatalf("spendable while not counted: %v (first at real %d ms), want %v", got, overlap/ms, c.overlap)
			}
		})
	}
}

// TestChores: a pool's work at each tick on one timeline (ms), with the
// owner's answers in between: a prefetch when the pool is in use and what
// lasts another quarter ttl is under half a grant, reports of what was
// used at most every quarter ttl, a return at the grant's deadline, and
// forgetting the pool once it holds nothing and was unused for a ttl.
func TestChores(t *testing.T) {
	pl := newPool()
	type want struct {
		returns, reports []int64 // Used of each grant returned, reported (units)
		acquire          int64   // units
		idle             bool
	}
	step := func(at int64, w want) {
		t.Helper()
		c := choresAt(pl, at*ms)
		used := func(hs []lease.Held) []int64 {
			var out []int64
			for _, h := range hs {
				out = append(out, h.Used/u)
			}
			return out
		}
		if got := used(c.returns); !equal(got, w.returns) {
			t.Fatalf("t=%d ms: returns %v, want %v", at, got, w.returns)
		}
		if got := used(c.reports); !equal(got, w.reports) {
			t.Fatalf("t=%d ms: reports %v, want %v", at, got, w.reports)
		}
		if c.acquire != w.acquire*u || c.idle != w.idle {
			t.Fatalf("t=%d ms: acquire %d, idle %v; want %d units, %v", at, c.acquire, c.idle, w.acquire, w.idle)
		}
	}
	spend := func(at, units int64, want lease.SpendResult) {
		t.Helper()
		if r, _, _ := pl.Spend(at*ms, units*u); r != want {
			t.Fatalf("t=%d ms: spend %v, want %v", at, r, want)
		}
	}
	spend(0, 1, lease.Remote)
	step(0, want{acquire: 10})
	applyAcquire(pl, 0, 20*ms, reply{Result: resGranted, Grant: 7, Epoch: 41, Units: 10 * u, TTL: 2000 * ms}, nil) // deadline 1800
	spend(30, 3, lease.Spent)
	step(100, want{})
	step(500, want{reports: []int64{3}})
	step(520, want{}) // reported less than a quarter ttl ago; used 490 ms ago
	spend(700, 1, lease.Spent)
	spend(1100, 1, lease.Spent)
	step(1100, want{reports: []int64{5}})
	spend(1400, 1, lease.Spent)
	step(1400, want{acquire: 10}) // 400 ms left: nothing lasts another quarter ttl
	spend(1700, 1, lease.Spent)
	step(1800, want{returns: []int64{7}}) // the deadline; the acquire is in flight
	applyAcquire(pl, 1400*ms, 1810*ms, reply{Result: resExhausted, RetryAfter: 5000 * ms}, nil)
	spend(1820, 1, lease.Denied)
	step(3000, want{})
	step(3820, want{})
	step(3821, want{idle: true})
}

func equal(a, b []int64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestSpendDecision(t *testing.T) {
	if d, ok := spendDecision(acme, lease.Spent, 7*u, 0); !ok || d != (keyrec.Decision{Policy: "acme", Revision: 3, Allowed: true, Remaining: 7 * u}) {
		t.Errorf("spent: %+v %v", d, ok)
	}
	if d, ok := spendDecision(acme, lease.Denied, 0, 250*ms); !ok || d != (keyrec.Decision{Policy: "acme", Revision: 3, RetryAfter: 250 * ms}) {
		t.Errorf("denied: %+v %v", d, ok)
	}
	if _, ok := spendDecision(acme, lease.Remote, 0, 0); ok {
		t.Error("remote decided here")
	}
}
