package sim

import "encoding/json"

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

// leaseReply checks the reply owner sent to a holder's request on a
// lease subject (both as they crossed the wire, CONTRACT §8): an applied
// report or return names a grant of the owner's epoch (L2), and counts
// what the owners did. A report whose call was decided in an earlier epoch
// of the owner would have been fenced, not applied: the owner's epoch of
// the partition when it answers is the one the call was decided in.
func (c *checker) leaseReply(owner *node, part int, req, reply []byte) {
	var q struct {
		Op    string `json:"op"`
		Key   string `json:"key"`
		Grant uint64 `json:"grant"`
		Epoch uint64 `json:"epoch"`
	}
	var r struct {
		Result string `json:"result"`
		Units  int64  `json:"units"`
	}
	if json.Unmarshal(req, &q) != nil || json.Unmarshal(reply, &r) != nil {
		c.fail("L2: %s's lease request or reply does not decode: %s: %s", owner.id, req, reply)
		return
	}
	switch {
	case q.Op == "acquire":
		if r.Result == "granted" && r.Units > 0 {
			c.grants++
		}
	case r.Result == "ok":
		c.reports++
		if e := owner.m.Route.EpochOf(part); q.Epoch < e {
			c.fail("L2: %s's owner %s applied a %s of grant %d of epoch %d in its epoch %d", q.Key, owner.id, q.Op, q.Grant, q.Epoch, e)
		}
	case r.Result == "stale_epoch" || r.Result == "unknown_grant" || r.Result == "bad_spend":
		c.refusedReports++
	}
}
