package mesh

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/lease"
	"github.com/limitmesh/limitmesh/policies"
)

// Modes and their overshoot bounds (DESIGN.md, §23). Every mode a node
// implements has a bound on what it can admit per limit key beyond the
// policy's limits, stated as a number of units:
//
//	strict  0: the state is written with compare-and-swap before the reply.
//	async   per owner failure (or lost compare-and-swap) of a key, what the
//	        owner admitted but had not yet written: at most
//	        burst + rate × (interval + write timeout) for bucket algorithms
//	        (the state written last, at most burst, plus the refill during
//	        the longest unwritten span), limit (per window) for window
//	        algorithms.
//	local   (nodes − 1) × burst for buckets, (nodes − 1) × limit (per
//	        window) for windows: each node enforces the whole limit alone.
//	leased  max_outstanding: the most units of a key granted to holders and
//	        neither spent, returned nor expired at any instant (the
//	        policy's lease; package mesh/internal/lease): over any interval
//	        admitted(t1, t2) <= the limit's contract + max_outstanding, per
//	        window for window algorithms.

// DefaultAsyncInterval is the default write-behind interval of async mode
// (NodeConfig.AsyncInterval).
const DefaultAsyncInterval = 100 * time.Millisecond

// BoundParams are the deployment figures an overshoot bound depends on.
type BoundParams struct {
	Nodes         int           // nodes serving the policy; < 1 counts as 1
	AsyncInterval time.Duration // async write-behind interval; 0: DefaultAsyncInterval
	WriteTimeout  time.Duration // longest state write (the decision timeout); 0: DefaultDecisionTimeout
}

// LimitBound is the overshoot bound of one limit of a policy.
type LimitBound struct {
	Name  string // the limit's name
	Units int64  // micro-units admitted beyond the limit at most (per key)
	// Per is "" for a bound over any span, or "window" when the bound is
	// per window of a window algorithm.
	Per string
	// Arithmetic shows how Units is computed, e.g. "(3 − 1) × 40 = 80".
	Arithmetic string
}

// Bound is a policy's overshoot bound in its mode, per limit key.
type Bound struct {
	Mode   policies.Mode
	Limits []LimitBound
}

// OvershootBound computes the overshoot bound of p's mode for the deployment
// bp, per limit key. It is a pure function. It returns an error wrapping
// policies.ErrInvalid for a mode this node does not implement.
func OvershootBound(p *policies.Policy, bp BoundParams) (Bound, error) {
	nodes := int64(max(bp.Nodes, 1))
	interval := bp.AsyncInterval
	if interval <= 0 {
		interval = DefaultAsyncInterval
	}
	wt := bp.WriteTimeout
	if wt <= 0 {
		wt = DefaultDecisionTimeout
	}
	b := Bound{Mode: p.Mode, Limits: make([]LimitBound, 0, len(p.Limits))}
	for _, l := range p.Limits {
		lb := LimitBound{Name: l.Name}
		capName := "burst"
		if !l.Algorithm.Bucket() {
			capName = "limit"
			if p.Mode != policies.ModeStrict {
				lb.Per = "window"
				if l.Algorithm == kvstate.Quota {
					lb.Per = "period"
				}
			}
		}
		capacity := l.Capacity()
		switch p.Mode {
		case policies.ModeStrict:
			lb.Arithmetic = "0"
		case policies.ModeLocal:
			lb.Units = satMul(nodes-1, capacity)
			lb.Arithmetic = fmt.Sprintf("(%d − 1) × %s = %s", nodes, formatUnits(capacity), formatUnits(lb.Units))
		case policies.ModeAsync:
			if l.Algorithm.Bucket() {
				span := int64(interval + wt)
				refill := l.Refill(span)
				lb.Units = satAdd(capacity, refill)
				lb.Arithmetic = fmt.Sprintf("%s + %s × (%s + %s) = %s", formatUnits(capacity), policies.FormatRate(l.Limit),
					interval, wt, formatUnits(lb.Units))
			} else {
				lb.Units = capacity
				lb.Arithmetic = fmt.Sprintf("%s %s = %s", capName, formatUnits(capacity), formatUnits(lb.Units))
			}
		case policies.ModeLeased:
			lb.Units = p.Lease.MaxOutstanding
			lb.Arithmetic = fmt.Sprintf("max_outstanding %s = %s", formatUnits(p.Lease.MaxOutstanding), formatUnits(lb.Units))
		default:
			return Bound{}, &policies.Error{Path: "mode", Reason: strconv.Quote(p.Mode.String()) + " is not implemented by this node"}
		}
		b.Limits = append(b.Limits, lb)
	}
	return b, nil
}

func satMul(a, b int64) int64 {
	if a <= 0 || b <= 0 {
		return 0
	}
	if a > (1<<63-1)/b {
		return 1<<63 - 1
	}
	return a * b
}

func satAdd(a, b int64) int64 {
	if a > (1<<63-1)-b {
		return 1<<63 - 1
	}
	return a + b
}

// formatUnits formats micro-units as a decimal number of units.
func formatUnits(v int64) string { return string(kvstate.AppendUnits(nil, max(v, 0))) }

// String formats the bound as one line per limit, e.g.
// "local: rate: (3 − 1) × 40 = 80 units".
func (b Bound) String() string {
	var sb strings.Builder
	for i, l := range b.Limits {
		if i > 0 {
			sb.WriteByte('\n')
		}
		fmt.Fprintf(&sb, "%s: %s: %s units", b.Mode, l.Name, l.Arithmetic)
		if l.Per != "" {
			sb.WriteString(" per " + l.Per)
		}
	}
	return sb.String()
}

// FormatLimit describes a limit's parameters for people, e.g.
// "token_bucket, rate 10/s, burst 40" or "fixed_window, limit 100 per 1m0s".
func FormatLimit(l kvstate.Limit) string {
	if l.Algorithm.Bucket() {
		return fmt.Sprintf("%s, rate %s, burst %s", l.Algorithm, policies.FormatRate(l), formatUnits(l.Burst))
	}
	if l.Algorithm == kvstate.Quota {
		return fmt.Sprintf("%s, limit %s per %s", l.Algorithm, formatUnits(l.Limit), l.Period)
	}
	return fmt.Sprintf("%s, limit %s per %s", l.Algorithm, formatUnits(l.Limit), time.Duration(l.Window))
}

// LeaseSkewMargin returns the skew margin of a leased policy's grants of
// ttl (CONTRACT §8): a holder stops spending a grant this long before its
// ttl has passed by its own clock, counted from when it asked for it, and
// an owner counts a grant outstanding this long after its expiry by its
// own clock. It is a tenth of the ttl (200ms for the default 2s), so a
// holder's clock may run up to 10% slow, and two owners' clocks may differ
// by up to the margin, without a grant being spent while it is not
// counted.
func LeaseSkewMargin(ttl time.Duration) time.Duration { return lease.MarginOf(ttl) }

// LeaseContract describes, for people, what a leased policy's limit admits
// over an interval with its overshoot bound, e.g.
// "admitted(t1, t2) ≤ 40 + 10/s × (t2 − t1) + 40" or, for a window
// algorithm, "≤ 100 + 40 = 140 per window".
func LeaseContract(l kvstate.Limit, maxOutstanding int64) string {
	if l.Algorithm.Bucket() {
		return fmt.Sprintf("admitted(t1, t2) ≤ %s + %s × (t2 − t1) + %s", formatUnits(l.Burst), policies.FormatRate(l), formatUnits(maxOutstanding))
	}
	per := "window"
	if l.Algorithm == kvstate.Quota {
		per = l.Period.String()
	}
	return fmt.Sprintf("admitted ≤ %s + %s = %s per %s", formatUnits(l.Limit), formatUnits(maxOutstanding),
		formatUnits(satAdd(l.Limit, maxOutstanding)), per)
}
