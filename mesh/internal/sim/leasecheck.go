package sim

import (
	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/keys"
)

// The leased contract (docs/protocol.md, "Leased mode", and "How they are
// checked"):
//
//	M6  a leased key admits, over any span, at most burst + rate × span +
//	    max_outstanding: the admissions its holders spent from grants and
//	    those its owners decided (with M4's slack for the clocks and the
//	    decision deadline);
//	L2  no report or return of a grant made in an epoch older than the
//	    owner's is applied.

// admitLeased records an admission of cost micro-units of leased key k,
// spent now by n from a grant or answered now by its owner (how), and
// checks M6 over every span ending now.
func (c *checker) admitLeased(k *simKey, cost int64, n *node, how string) {
	s := c.s
	t := s.s.now
	ts := append(c.rates[k.name], rateAdmission{at: t, cost: cost})
	c.rates[k.name] = ts
	slack := int64(s.cfg.Timeout) + 2*maxOffset
	var admitted int64
	for i := len(ts) - 1; i >= 0; i-- {
		a := ts[i].at
		admitted += ts[i].cost
		span := (t - a) + (t-a)*2*maxDrift/1_000_000 + slack
		allowed := (int64(leasedBurst+leasedMaxOut) + span*leasedRate/1e9 + 1) * kvstate.Unit
		if admitted > allowed {
			c.fail("M6: %s admitted %s in %.3fs (the last from %s at %s), allowed %s", k.name, fmtUnits(admitted),
				float64(t-a)/1e9, how, n.id, fmtUnits(allowed))
			return
		}
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
