package sim

import (
	"github.com/limitmesh/limitmesh/mesh/internal/keys"
)

// The leased contract (docs/protocol.md, "Leased mode", and "How they are
// checked"):
//
//	M6  a leased key admits, over any span, at most burst + rate × span +
//	    max_outstanding: the admissions its holders spent from grants and
//	    those its owners decided (with M4's slack for the clocks);
//	L2  no report or return of a grant made in an epoch older than the
//	    owner's is applied.

// admitLeased records an admission of cost micro-units of leased key k,
// spent by n from a grant or decided by its owner n (how) within
// [lo, now], and checks M6 (checker.envelope, with max_outstanding on top
// of the burst).
func (c *checker) admitLeased(k *simKey, lo, cost int64, n *node, how string) {
	admitted, allowed, span, _, ok := c.envelope(k, rateAdmission{lo: lo, at: c.s.s.now, cost: cost, by: n}, leasedBurst+leasedMaxOut, leasedRate)
	if !ok {
		c.fail("M6: %s admitted %s in %.3fs (the last from %s at %s), allowed %s", k.name, fmtUnits(admitted),
			float64(span)/1e9, how, n.id, fmtUnits(allowed))
	}
}

// leaseOp checks a grant operation of k that owner's key core decided as
// kc: an applied report or return names a grant of the owner's epoch
// (L2), and counts what the owners did.
func (c *checker) leaseOp(k *simKey, owner *node, kc *keys.Call, op *keys.LeaseOp) {
	if kc.Err != nil {
		return
	}
	if op.Acquire != nil {
		if op.Acquired.Grant.Units > 0 {
			c.grants++
		}
		return
	}
	r := op.Report
	if op.Refused != nil {
		c.refusedReports++
		return
	}
	c.reports++
	if r.Epoch < op.Epoch {
		c.fail("L2: %s's owner %s applied a report of grant %d of epoch %d in its epoch %d", k.name, owner.id, r.ID, r.Epoch, op.Epoch)
	}
}
