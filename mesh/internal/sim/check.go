package sim

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/nats-io/nats.go"
)

// The invariants the simulation checks (docs/protocol.md, "Invariants"):
//
//	M1  at most one node serves a partition at any instant;
//	M2  a node serves a partition only in an epoch that is the revision of
//	    its own claim of it;
//	M3  no admission is forgotten and none is decided twice: every
//	    admission of a count key reports a count (its admissions so far) no
//	    earlier admission reported;
//	M4  the contract: a count key admits at most its limit; a rate key at
//	    most burst + rate × elapsed over any span, elapsed on the deciding
//	    nodes' clocks (checker.envelope);
//	M5  after the faults end, every partition gets exactly one owner and
//	    every key is decided again, from a record holding every admission
//	    (after every step from convergeLeases after the faults end: no
//	    partition without an owner for more than a lease; at the end; and
//	    over TestSimulation's seeds, the share of time without an owner);
//	U1-U3 (usage.go) the usage the journal offers reaches the ledger once;
//	R1-R4 (rescheck.go) reservations are never forgotten, end once, hold
//	    no limit beyond its capacity and give back what expires;
//	M6, L2 (leasecheck.go) a leased key admits at most burst + rate ×
//	    span + max_outstanding; no report of an old epoch is applied.
//
// M1 and M2 are checked after every step (step), M3 and M4 at every
// answer a node makes (outcome, admitRate: where it is made, whether or
// not it then reaches its client), M3 and M5 at the end too
// (final).

// checker holds what the checks need and the first violation.
type checker struct {
	s   *Sim
	err error

	calls, unavailable, lost, errs, admitted, denied int
	counts                                           map[string]map[int64]bool  // count key -> counts admitted
	rates                                            map[string][]rateAdmission // rate key -> admissions
	owner                                            []*node                    // scratch of step: the node serving each partition
	// M5 after every step once the mesh has converged: since when each
	// partition has had no owner (0: it has one), the instant of the
	// previous step, and the partition-time without an owner (ns).
	unservedSince []int64
	lastStep      int64
	unserved      int64
	// countUntil is the global instant of the last admission of a count
	// key (they admit through the faults: Config.Limit).
	countUntil int64
	// the calls clients were told were admitted and denied (U2, U3)
	admittedIDs, deniedIDs map[string]bool
	// grant operations the owners applied (leasecheck.go)
	grants, reports, refusedReports int
	violations                      []error // the first ones found during the run (fail)
}

func newChecker(s *Sim) *checker {
	return &checker{s: s, counts: map[string]map[int64]bool{}, rates: map[string][]rateAdmission{},
		owner: make([]*node, s.cfg.Parts), unservedSince: make([]int64, s.cfg.Parts), admittedIDs: map[string]bool{}, deniedIDs: map[string]bool{}}
}

// fail records a violation: the first is err; the first ten are kept,
// and the run goes on, so a run shows every invariant it breaks, not only
// the first (sim_test.go's knownBugs needs them all).
func (c *checker) fail(format string, a ...any) {
	if len(c.violations) == maxViolations {
		return
	}
	err := fmt.Errorf("at %.6fs: %s", float64(c.s.s.now)/1e9, fmt.Sprintf(format, a...))
	c.s.logf("VIOLATION: %v", err)
	c.violations = append(c.violations, err)
	if c.err == nil {
		c.err = err
	}
}

// maxViolations is how many violations a run keeps.
const maxViolations = 10

// converged is the global instant from which M5 holds: the faults ended a
// few leases before (a node stopping when they ended restarts within 3
// leases, I5).
func (c *checker) converged() int64 {
	return int64(c.s.cfg.Duration) + convergeLeases*int64(c.s.cfg.Lease)
}

// convergeLeases is how many leases after the faults end M5 holds from.
const convergeLeases = 4

// step checks M1 and M2 after an event, and M5 once the mesh has
// converged.
func (c *checker) step() {
	s := c.s
	defer func() { c.lastStep = s.s.now }()
	clear(c.owner)
	for _, n := range s.nodes {
		if !n.up {
			continue
		}
		rt := n.m.Route
		mono := rt.Mono()
		for p := range s.cfg.Parts {
			if !rt.ServingAt(p, mono) {
				continue
			}
			if o := c.owner[p]; o != nil {
				c.fail("M1: partition %d served by %s and %s", p, o.id, n.id)
				return
			}
			c.owner[p] = n
			if e := rt.EpochOf(p); s.claims[p][e] != n.id {
				c.fail("M2: %s serves partition %d in epoch %d, which is %q's claim", n.id, p, e, s.claims[p][e])
				return
			}
		}
	}
	if s.s.now < c.converged() {
		return
	}
	lease := int64(s.cfg.Lease)
	for p, o := range c.owner {
		if c.unservedSince[p] != 0 {
			c.unserved += s.s.now - c.lastStep
		}
		switch {
		case o != nil:
			c.unservedSince[p] = 0
		case c.unservedSince[p] == 0:
			c.unservedSince[p] = s.s.now
		default:
			if since := c.unservedSince[p]; s.s.now-since > lease {
				c.fail("M5: partition %d has had no owner for %.3fs, %.3fs after the faults ended:\n%s",
					p, float64(s.s.now-since)/1e9, float64(s.s.now-int64(s.cfg.Duration))/1e9, c.describe(p))
				c.unservedSince[p] = s.s.now // once per gap
			}
		}
	}
}

// describe reports every running node's relation to partition p.
func (c *checker) describe(p int) string {
	var states []string
	for _, n := range c.s.nodes {
		if n.up {
			states = append(states, n.id+": "+n.m.Owner.Describe(p))
		}
	}
	return strings.Join(states, "\n")
}

// outcome records the answer a to decide call cc, which n made (its
// request reached n at arrived), and checks M3 and M4.
func (c *checker) outcome(cc *clientCall, n *node, arrived int64, a answer) {
	s := c.s
	if a.code != "" {
		c.errs++
		if a.code == "503" {
			c.unavailable++
		}
		return
	}
	if !a.allowed {
		c.denied++
		c.deniedIDs[cc.id] = true
		return
	}
	c.admitted++
	k := cc.k
	if k.leased && s.spentByHolder[cc.id] {
		// Spent from n's grant: the service publishes its usage, not
		// the journal.
		c.admitLeased(k, arrived, kvstate.Unit, n, "a grant")
		return
	}
	c.admittedIDs[cc.id] = true
	if k.count {
		c.countUntil = s.s.now
		count := int64(s.cfg.Limit) - a.remaining/kvstate.Unit
		m := c.counts[k.name]
		if m == nil {
			m = map[int64]bool{}
			c.counts[k.name] = m
		}
		if s.cfg.Debug {
			s.logf("%s admits %s at count %d", n.id, k.name, count)
		}
		if m[count] {
			c.fail("M3: %s admitted a second time at count %d (by %s): an admission was forgotten", k.name, count, n.id)
		}
		m[count] = true
		if len(m) > s.cfg.Limit || count > int64(s.cfg.Limit) || count < 1 {
			c.fail("M4: %s admitted %d times (count %d), limit %d", k.name, len(m), count, s.cfg.Limit)
		}
		return
	}
	if k.leased {
		c.admitLeased(k, arrived, kvstate.Unit, n, "the owner")
		return
	}
	c.admitRate(k, arrived, kvstate.Unit, nil, n)
}

// rateAdmission is an admission of a rate key (or a leased one): decided
// within [lo, at], global instants (its request reached the deciding
// node's process at lo; the node answered at at), of cost micro-units or
// the reservation r made.
type rateAdmission struct {
	lo, at int64
	cost   int64
	r      *simRes
	by     *node // the node that decided it
}

// envelope records admission a of key k and checks that, over any span of
// its admissions, k admitted at most burst + perSec × span units, span
// read on the owners' clocks: for every run of admissions ending with a
// (in answer order), the units they admitted against the longest span
// their decisions can cover on any clocks: from the earliest reading of
// any node's clock at the earliest start of their intervals to the latest
// reading at the end of a's (the clocks' offsets and rate errors: a new
// owner whose clock is ahead refills more, CONTRACT: at most skew ×
// rate). A violation is thus reported only when no timing of the
// decisions within their intervals keeps the bound. A reservation counts
// at what it keeps as far as the answers tell (R3): its reserved units
// while open or once expired, what its settle kept once it ended, and at
// least what its settle or release asks once one is sent (its outcome may
// be unknown). It returns the first run that breaks the bound: its units,
// span (global) and allowed units, and whether it holds a reservation.
func (c *checker) envelope(k *simKey, a rateAdmission, burst, perSec int64) (admitted, allowed, span int64, reserved, ok bool) {
	ts := append(c.rates[k.name], a)
	c.rates[k.name] = ts
	earliest := a.lo
	_, whi := c.s.wallRange(a.at)
	for i := len(ts) - 1; i >= 0; i-- {
		if r := ts[i].r; r != nil {
			admitted += r.kept()
			reserved = true
		} else {
			admitted += ts[i].cost
		}
		earliest = min(earliest, ts[i].lo)
		span = a.at - earliest
		wlo, _ := c.s.wallRange(earliest)
		allowed = (burst + (whi-wlo)*perSec/1e9 + 1) * kvstate.Unit
		if admitted > allowed {
			if c.s.cfg.Debug {
				for _, x := range ts[i:] {
					kept := x.cost
					if x.r != nil {
						kept = x.r.kept()
					}
					c.s.logf("run: lo %.6f at %.6f by %s (wall %.6f) kept %s", float64(x.lo)/1e9, float64(x.at)/1e9, x.by.id, float64(x.by.wallAt(x.lo)-epoch)/1e9, fmtUnits(kept))
				}
			}
			return admitted, allowed, span, reserved, false
		}
	}
	return 0, 0, 0, false, true
}

// admitRate records an admission of rate key k decided by n within
// [lo, now], a decide's of cost or reservation r's (nil: none), and checks
// M4 and R3 (envelope).
func (c *checker) admitRate(k *simKey, lo, cost int64, r *simRes, n *node) {
	admitted, allowed, span, reserved, ok := c.envelope(k, rateAdmission{lo: lo, at: c.s.s.now, cost: cost, r: r, by: n}, rateBurst, ratePerSec)
	if !ok {
		what := "M4"
		if reserved {
			what = "M4 (R3)"
		}
		c.fail("%s: %s admitted %s in %.3fs (by %s), allowed %s", what, k.name, fmtUnits(admitted), float64(span)/1e9, n.id, fmtUnits(allowed))
	}
}

// final checks M5 at the end of the run: every partition has one owner
// (M1 forbids more; messages are still lost, so a renewal may be under
// way: the check waits up to a lease for it), and a dry run of every
// count key, decided (a client asks again up to probeTries times when it
// gets no decision), reports a count at least the highest admitted (M3).
func (c *checker) final() error {
	s := c.s
	lease := int64(s.cfg.Lease)
	c.step()
	for limit := s.s.now + lease; ; {
		p := slices.IndexFunc(c.owner, func(n *node) bool { return n == nil })
		if p < 0 {
			break
		}
		if s.s.now >= limit {
			return errors.Join(append(c.violations, fmt.Errorf("M5: %.3fs after the faults ended, partition %d has no owner:\n%s",
				float64(s.s.now-int64(s.cfg.Duration))/1e9, p, c.describe(p)))...)
		}
		s.s.runUntil(s.s.now + lease/15)
		c.step()
	}
	var errs []error
	for _, k := range s.keys {
		if !k.count {
			continue
		}
		var got *answer
		for try := 0; try < probeTries && (got == nil || got.code != ""); try++ {
			got = nil
			s.send(&clientCall{k: k}, s.nodes[try%len(s.nodes)], decideEndpoint, decideBody(k, "", true), func(m *nats.Msg) {
				if a, err := decodeAnswer(m); err == nil {
					got = &a
				}
			})
			s.s.runUntil(s.s.now + 2*int64(s.cfg.Timeout))
		}
		if got == nil || got.code != "" {
			errs = append(errs, fmt.Errorf("M5: %s not decided %d times after the faults ended: %+v", k.name, probeTries, got))
			continue
		}
		count := int64(s.cfg.Limit) - got.remaining/kvstate.Unit
		var highest int64
		for n := range c.counts[k.name] {
			highest = max(highest, n)
		}
		if count < highest {
			errs = append(errs, fmt.Errorf("M3: %s holds count %d, but count %d was admitted: admissions forgotten", k.name, count, highest))
		}
	}
	if !s.cfg.NoReservations {
		// R4: the clients done and every reservation expired and swept
		// (the faults are over), the usage stream holds every end.
		limit := s.s.now + int64(10*time.Second)
		for s.res.active > 0 || s.res.quietAt() > s.s.now {
			if s.s.now >= limit {
				errs = append(errs, fmt.Errorf("sim: %d reserving clients still active 10s after the run", s.res.active))
				break
			}
			s.s.runUntil(min(max(s.res.quietAt(), s.s.now+int64(s.cfg.Lease)), limit))
		}
	}
	counted, err := s.usage.check(c.admittedIDs, c.deniedIDs)
	if err != nil {
		errs = append(errs, err)
	} else if !s.cfg.NoReservations {
		errs = append(errs, s.res.final(counted)...)
	}
	return errors.Join(append(c.violations, errs...)...)
}

// probeTries is how many times the final check asks for a key's decision.
const probeTries = 5

// Stats summarizes the run's traffic.
func (c *checker) Stats() string {
	return fmt.Sprintf("%d calls: %d admitted, %d denied, %d errors, %d unavailable, %d lost with their node; count keys admitted until %.3fs; partitions unserved %.3f%% of the time after converging; %s; %d grants, %d reports applied, %d refused",
		c.calls, c.admitted, c.denied, c.errs, c.unavailable, c.lost, float64(c.countUntil)/1e9, 100*c.unservedShare(), c.s.res.Stats(), c.grants, c.reports, c.refusedReports)
}

// unservedShare is the share of partition-time without an owner from
// converged to the end of the run.
func (c *checker) unservedShare() float64 {
	span := c.s.s.now - c.converged()
	if span <= 0 {
		return 0
	}
	return float64(c.unserved) / float64(span*int64(c.s.cfg.Parts))
}
