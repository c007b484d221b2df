package keys

import (
	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/lease"
	"github.com/limitmesh/limitmesh/policies"
)

// Grant operations of leased keys (CONTRACT §8, package lease). A Call
// with a LeaseOp is an acquire, a report or a return of a grant: its owner
// applies it to the key's record like a strict decision (the record,
// grants included, is written before the call is answered, so a failover
// never forgets a grant) and sets the op's results. Plain decisions of a
// leased key that reach the owner are strict decisions against the states
// the grants were debited from.

// LeaseOp is a grant operation; exactly one of Acquire and Report is set.
type LeaseOp struct {
	Acquire *lease.AcquireReq
	Report  *lease.ReportReq
	// Epoch is the owner's epoch of the key's partition when the call
	// was submitted: grants are made in it, and reports of older epochs
	// are refused.
	Epoch uint64

	// Results, set when the call is decided (Call.Err nil).
	Acquired lease.AcquireResult // Acquire
	Refunded int64               // Report: micro-units taken back
	// Refused is why a report or return was refused (lease.ErrStaleEpoch,
	// lease.ErrUnknownGrant, lease.ErrBadSpend), or ErrNotLeased for an
	// acquire of a key whose policy is not leased (any more).
	Refused error
}

// leaseParams returns the grant parameters of p: its lease, or the
// defaults when p is not leased (any more), so grants it still holds
// keep their margin.
func leaseParams(p *policies.Policy) lease.Params {
	if p.Mode == policies.ModeLeased {
		return lease.ParamsOf(p.Lease)
	}
	return lease.ParamsOf(policies.DefaultLease(p.Limits))
}

// decideLease applies c's grant operation to rec at now and reports
// whether rec changed.
func (o *owner) decideLease(rec *keyrec.Record, c *Call, p *policies.Policy, limits []kvstate.Limit, now int64) bool {
	op := c.Lease
	c.Out = keyrec.Decision{Allowed: true, Policy: p.Name, Revision: p.Revision}
	c.At = now
	params := leaseParams(p)
	if op.Acquire != nil {
		if p.Mode != policies.ModeLeased {
			op.Refused = ErrNotLeased
			return lease.Prune(rec, now, lease.Margin(params.TTL))
		}
		o.noteDebit(rec, limits, now) // a grant debits the buckets
		res, changed := lease.Acquire(params, limits, rec, now, op.Epoch, *op.Acquire)
		op.Acquired = res
		c.Out.Remaining = res.Remaining
		c.Out.Allowed = res.Outcome == lease.Granted
		c.Out.RetryAfter = res.RetryAfter
		return changed
	}
	refunded, changed, err := lease.Report(params, limits, rec, now, op.Epoch, *op.Report)
	op.Refunded, op.Refused = refunded, err
	return changed
}
