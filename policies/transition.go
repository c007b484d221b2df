package policies

import "github.com/limitmesh/limitmesh/kvstate"

// Transition maps one limit key's stored states from policy old to policy
// new at instant at (ns), following §28. states[i] belongs to
// old.Limits[i] (a shorter slice means "never seen" for the rest). Limits
// are matched by name: each limit of new that old also has goes through
// [kvstate.Rebase] (refill under the old parameters up to at, then clamp to
// the new capacity; an algorithm change starts fresh); a limit only new
// has starts fresh (the zero State); a limit only old has is dropped. The
// result is in new's limit order, one State per limit of new, in a new
// slice; states is not modified. A nil old means every limit starts fresh.
//
// Transition does not handle a change of key shape (match or key
// dimensions): the caller computes the limit key under new with
// [Policy.LimitKey], and a different key simply has no stored state, so
// it starts fresh; the old key's state is left to expire. Callers should
// call Transition only for a key whose LimitKey is the same under both.
func Transition(old, new *Policy, states []kvstate.State, at int64) []kvstate.State {
	out := make([]kvstate.State, len(new.Limits))
	if old == nil {
		return out
	}
	for i, nl := range new.Limits {
		for j, ol := range old.Limits {
			if ol.Name != nl.Name {
				continue
			}
			if j < len(states) {
				out[i] = kvstate.Rebase(ol.Limit, nl.Limit, states[j], at)
			}
			break
		}
	}
	return out
}
