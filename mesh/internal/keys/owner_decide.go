package keys

import (
	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/policies"
)

// An owner's decisions: a call against the cached record, under the
// policy version that decides it.

// decide decides c at now against rec, updating rec, and reports whether
// rec changed in a way that must be written.
func (o *owner) decide(rec *keyrec.Record, c *Call, now int64) bool {
	return o.decideWith(rec, c, o.policyFor(c), now)
}

// decideWith is decide with c's policy resolved already (policyFor).
func (o *owner) decideWith(rec *keyrec.Record, c *Call, p *policies.Policy, now int64) bool {
	c.mode = p.Mode
	if rec.Policy != p.Name || rec.Revision != p.Revision {
		o.transition(rec, p, now)
	}
	rec.PruneDedupe(now)
	if c.Lease != nil {
		return o.decideLease(rec, c, p, o.limitsFor(p), now)
	}
	if c.Res != nil {
		return o.decideRes(rec, c, p, now)
	}
	if c.HasID && !c.DryRun {
		if d, ok := rec.FindDedupe(c.ID); ok {
			d.Policy = p.Name
			c.Out, c.Deduped = d, true
			return false
		}
	}
	o.limitsFor(p)
	// Decide into the spare buffer; on admission the buffers swap (rec is
	// the owner's own record, never shared: writes carry encoded bytes).
	kd, states := kvstate.DecideAll(o.limits, rec.States, now, c.Cost, o.spare)
	o.denying = !kd.Allowed
	c.Out = decisionOf(kd, p)
	c.At = now
	if c.DryRun {
		return false
	}
	changed := false
	if kd.Allowed {
		o.noteDebit(rec, o.limits, now)
		rec.States, o.spare = states, rec.States
		changed = true
		if c.Desc != nil && p.Mode != policies.ModeLocal {
			o.usage = append(o.usage, keyrec.Usage{At: now, Revision: p.Revision, Cost: c.Cost, Desc: c.Desc, RequestID: c.RequestID})
			o.usageAsync = append(o.usageAsync, p.Mode == policies.ModeAsync)
			o.usagePolicy = p.Name
		}
	} else {
		o.spare = states
	}
	if c.HasID {
		rec.AddDedupe(c.ID, now, c.Out)
		changed = true
	}
	return changed
}

// limitsFor returns p's limits as DecideAll takes them (cached).
func (o *owner) limitsFor(p *policies.Policy) []kvstate.Limit {
	if o.limitsOf != p {
		o.limits = o.limits[:0]
		for _, l := range p.Limits {
			o.limits = append(o.limits, l.Limit)
		}
		o.limitsOf = p
	}
	return o.limits
}

// transition brings rec's states to policy p (§28). The instant of the
// change is when p's revision was written (now if unknown). A keyrec.Record of
// another policy starts fresh. When the old version is unknown, states
// are kept by position where the algorithm matches, clamped to p's limits.
func (o *owner) transition(rec *keyrec.Record, p *policies.Policy, now int64) {
	at := now
	if _, created, ok := o.env.Version(p.Name, p.Revision); ok && created > 0 && created < now {
		at = created
	}
	var states []kvstate.State
	switch {
	case rec.Policy != p.Name || len(rec.States) == 0:
		states = make([]kvstate.State, len(p.Limits))
	default:
		if old, _, ok := o.env.Version(rec.Policy, rec.Revision); ok {
			states = policies.Transition(old, p, rec.States, at)
		} else {
			states = make([]kvstate.State, len(p.Limits))
			for i, l := range p.Limits {
				if i < len(rec.States) && rec.States[i].Algorithm == l.Algorithm {
					states[i] = kvstate.Rebase(l.Limit, l.Limit, rec.States[i], at)
				}
			}
		}
	}
	if rec.Policy != p.Name {
		rec.Dedupe = nil
		rec.Grants = nil // another policy's grants: its states are gone too
		rec.Reservations, rec.ResSeq = nil, 0
	}
	rec.Policy, rec.Revision, rec.States = p.Name, p.Revision, states
}

// emptyRecord is the conservative keyrec.Record of a key whose stored keyrec.Record is
// unreadable: p's limits at now as they are right after spending their
// whole capacity (no tokens, full windows), so it never over-admits.
func emptyRecord(p *policies.Policy, now int64) keyrec.Record {
	rec := keyrec.Record{Policy: p.Name, Revision: p.Revision, States: make([]kvstate.State, len(p.Limits))}
	for i, l := range p.Limits {
		_, rec.States[i] = kvstate.Decide(l.Limit, kvstate.State{}, now, l.Capacity())
	}
	return rec
}

// decisionOf is the reply of limits decision kd under policy p.
func decisionOf(kd kvstate.Decision, p *policies.Policy) keyrec.Decision {
	return keyrec.Decision{
		Allowed:    kd.Allowed,
		Policy:     p.Name,
		Revision:   p.Revision,
		Remaining:  kd.Remaining,
		RetryAfter: kd.RetryAfter,
		ResetAfter: kd.ResetAfter,
	}
}
