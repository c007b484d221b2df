package keys

import (
	"errors"
	"testing"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/lease"
)

func leaseCall(c *Call, op *LeaseOp) *Call { c.Lease = op; return c }

// TestOwnerLeaseOps: an acquire is answered only once the record holding
// its grant is written (and a plain decision after it sees the debit); a
// report of an older epoch is refused without a write; a return refunds
// and is written; an acquire of a policy that is not leased is refused.
func TestOwnerLeaseOps(t *testing.T) {
	p := tbPolicy(t, "p", 3, "10/s", 40, `,"mode":"leased","lease":{"size":10,"max_outstanding":40}`)
	o := newOwner(newFakeEnv(p), 8, 0)
	st := &storeAt{}
	now := int64(1000 * sec)
	acq := &LeaseOp{Acquire: &lease.AcquireReq{Holder: "n1", Want: 10 * kvstate.Unit, Min: kvstate.Unit}, Epoch: 5}
	c1 := leaseCall(newCall(p, 1, now+sec), acq)
	o.submit(c1)
	mustKind(t, o.next(now), actLoad)
	o.loadedResult(nil, 0, kvstate.ErrNotFound)
	a := o.next(now)
	mustKind(t, a, actWrite)
	if len(a.finished) != 0 {
		t.Fatal("an acquire answered before its write")
	}
	rec, err := keyrec.Decode(a.value)
	if err != nil || len(rec.Grants) != 1 || rec.Grants[0].Epoch != 5 || rec.Grants[0].Units != 10*kvstate.Unit {
		t.Fatalf("written record %+v, %v", rec, err)
	}
	o.written(st.write(t, a), nil)
	if a := o.next(now); len(a.finished) != 1 || acq.Acquired.Outcome != lease.Granted || acq.Acquired.Grant.ID != 1 {
		t.Fatalf("acquire: finished %d, %+v", len(a.finished), acq.Acquired)
	}
	// A strict decision sees the 30 units left.
	c2 := newCall(p, 31, now+sec)
	o.submit(c2)
	if a := o.next(now); a.kind != actNone || len(a.finished) != 1 || c2.Out.Allowed || c2.Out.Remaining != 30*kvstate.Unit {
		t.Fatalf("decision after the grant: %+v", c2.Out)
	}
	// A report of epoch 4 is refused and writes nothing.
	stale := &LeaseOp{Report: &lease.ReportReq{ID: 1, Epoch: 4, Spent: kvstate.Unit}, Epoch: 5}
	o.submit(leaseCall(newCall(p, 1, now+sec), stale))
	if a := o.next(now); a.kind != actNone || !errors.Is(stale.Refused, lease.ErrStaleEpoch) {
		t.Fatalf("stale report: %+v %v", a, stale.Refused)
	}
	// The return refunds 6 and is written first.
	ret := &LeaseOp{Report: &lease.ReportReq{ID: 1, Epoch: 5, Spent: 4 * kvstate.Unit, Return: true}, Epoch: 5}
	o.submit(leaseCall(newCall(p, 1, now+sec), ret))
	a = o.next(now)
	mustKind(t, a, actWrite)
	o.written(st.write(t, a), nil)
	if a := o.next(now); len(a.finished) != 1 || ret.Refused != nil || ret.Refunded != 6*kvstate.Unit {
		t.Fatalf("return: %+v", ret)
	}
	// Not leased any more: acquires are refused.
	strict := tbPolicy(t, "p", 4, "10/s", 40, "")
	o.env.(*fakeEnv).add(strict, now)
	na := &LeaseOp{Acquire: &lease.AcquireReq{Holder: "n1", Want: kvstate.Unit}, Epoch: 5}
	o.submit(leaseCall(newCall(strict, 1, now+sec), na))
	if o.next(now); !errors.Is(na.Refused, ErrNotLeased) {
		t.Fatalf("acquire of a strict policy: %v", na.Refused)
	}
}
