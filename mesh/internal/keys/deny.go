package keys

import (
	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/policies"
)

// Cheap denials (§30 item 14: rejected traffic alone must not overload
// the limiter). A strict call that changes nothing needs no write, and so
// no trip through the queue and the runner: when the key is loaded and
// idle (nothing queued, no store operation outstanding, no runner), its
// last decision was a denial, and the call is a dry run or is denied
// without a request_id, denyInline answers it at once from the cached
// record, allocating nothing. Anything else (an admission, a request_id, a
// keep-alive that is due, a policy revision the record is not on yet)
// takes the ordinary path, which decides it again.

// denyInline decides strict call c at now when that writes nothing (see
// above) and reports whether it did; then c is finished (the caller
// replies). Otherwise c and the owner are as before.
func (o *owner) denyInline(c *Call, now int64) bool {
	if !o.denying || !o.loaded || o.busy || len(o.queue) > 0 || c.HasID || c.Res != nil || c.Lease != nil || now >= c.Deadline || o.keepAliveDue(now) {
		return false
	}
	p := o.policyFor(c)
	if p.Mode != policies.ModeStrict || o.rec.Policy != p.Name || o.rec.Revision != p.Revision || o.limitsOf != p {
		return false
	}
	kd, states := kvstate.DecideAll(o.limits, o.rec.States, now, c.Cost, o.spare)
	o.spare = states
	if kd.Allowed && !c.DryRun {
		return false
	}
	c.mode = p.Mode
	c.Out = decisionOf(kd, p)
	c.At = now
	return true
}
