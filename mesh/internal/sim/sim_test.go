package sim

import (
	"flag"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

var (
	seedFlag  = flag.Uint64("sim.seed", 0, "run only this seed (a failing seed's reproduction)")
	seedsFlag = flag.Int("sim.seeds", 0, "how many seeds TestSimulation runs (default: 1500, 150 with -short)")
	traceFlag = flag.Bool("sim.trace", false, "print the run's trace")
)

// TestSimulation runs many seeded schedules of a three-node mesh with
// faults and checks the invariants after every step (check.go). A failure
// names its seed; the command in the message replays it exactly.
func TestSimulation(t *testing.T) {
	seeds := uint64(1500)
	if testing.Short() {
		seeds = 150
	}
	if *seedsFlag > 0 {
		seeds = uint64(*seedsFlag)
	}
	first := uint64(1)
	if *seedFlag != 0 {
		first, seeds = *seedFlag, 1
	}
	start := time.Now()
	var (
		next     atomic.Uint64
		wg       sync.WaitGroup
		mu       sync.Mutex
		failures []string
		known    = map[string][]uint64{} // known bug -> the seeds that hit it
		steps    atomic.Int64
	)
	next.Store(first)
	for range runtime.GOMAXPROCS(0) {
		wg.Go(func() {
			for {
				seed := next.Add(1) - 1
				if seed >= first+seeds {
					return
				}
				s, err := New(Config{Seed: seed, Faults: true, Debug: *traceFlag})
				if err != nil {
					t.Error(err)
					return
				}
				err = s.Run()
				steps.Add(int64(s.Steps()))
				if *traceFlag {
					t.Logf("seed %d: %s\n%s", seed, s.check.Stats(), s.Trace())
				}
				if err != nil {
					mu.Lock()
					if bugs := knownBug(err); len(bugs) > 0 && *seedFlag == 0 {
						for _, b := range bugs {
							known[b] = append(known[b], seed)
						}
					} else {
						failures = append(failures, fmt.Sprintf("seed %d: %v\n%s\nreproduce: go test ./mesh/internal/sim -run TestSimulation -sim.seed=%d -sim.trace -v",
							seed, err, s.Trace(), seed))
					}
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	t.Logf("%d schedules, %d steps in %v", seeds, steps.Load(), time.Since(start).Round(time.Millisecond))
	for _, b := range knownBugs {
		if ss := known[b.sign]; len(ss) > 0 {
			slices.Sort(ss)
			t.Logf("KNOWN PROTOCOL BUG, not fixed yet (%s): %d seeds hit it, first %d (go test ./mesh/internal/sim -run TestSimulation -sim.seed=%d -v)",
				b.name, len(ss), ss[0], ss[0])
		}
	}
	for i, f := range failures {
		if i == 3 {
			t.Errorf("... and %d more failing seeds", len(failures)-3)
			break
		}
		t.Error(f)
	}
}

// foundBugs are the seeds whose schedules found the failover bugs fixed
// since the simulation exists (the rules that fixed them: docs/protocol.md,
// "Invariants"). A change to the simulation changes what a seed schedules,
// so these are kept as a quick check on every run (also with -short), next
// to the scenario tests that pin each rule down (the journal's
// scenario_test.go, the ownership core's tests).
var foundBugs = []uint64{
	54,   // O4: an earlier incarnation's entry was released, not claimed back
	194,  // J12: one slow step used up a whole adoption's deadline
	232,  // J3: a restarted node's mark passed its earlier incarnation's records
	256,  // J8, J9: a stale cached read; a late checkpoint over a newer owner
	334,  // J8
	372,  // J8
	2532, // J10: a source named later held the older record of a key
	2722, // J10
	158,  // J15: an abandoned batch that landed was skipped (U1); J15's first fix found it only at the sequence after
	1415, // J15
}

// TestSimulationFoundBugs runs the seeds of foundBugs, without
// reservations (the schedules that found those bugs).
func TestSimulationFoundBugs(t *testing.T) {
	for _, seed := range foundBugs {
		s, err := New(Config{Seed: seed, Faults: true, NoReservations: true})
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Run(); err != nil {
			t.Errorf("seed %d: %v\n%s\nreproduce: go test ./mesh/internal/sim -run TestSimulation -sim.seed=%d -sim.trace -v",
				seed, err, s.Trace(), seed)
		}
	}
}

// knownBugs are the protocol bugs the reservation checks found that are
// not fixed yet, each with the words its failures' messages carry
// (rescheck.go). TestSimulation reports the seeds whose every violation
// names one of them instead of failing on them, so the rest of the
// invariants keep guarding every run; -sim.seed=N still fails on them.
// Remove a bug's entry with its fix (and its seed's skip in
// TestSimulationReservationBugs).
var knownBugs = []struct{ name, sign string }{
	{"service/reserve_sweep.go: a new owner sweeps the keys it loads or adopts from a journal, not those whose record was checkpointed and is never touched again", unswept},
}

// knownBug returns the signs of the known bugs err's lines name, if every
// line names one, or nil.
func knownBug(err error) []string {
	var signs []string
	for _, line := range strings.Split(err.Error(), "\n") {
		i := slices.IndexFunc(knownBugs, func(b struct{ name, sign string }) bool { return strings.Contains(line, b.sign) })
		if i < 0 {
			return nil
		}
		if !slices.Contains(signs, knownBugs[i].sign) {
			signs = append(signs, knownBugs[i].sign)
		}
	}
	return signs
}

// reservationBugs are seeds that found protocol bugs of reservations,
// kept as one-line reproductions (the checks that found them are in
// rescheck.go). Three more were found with these two patched; their
// schedules depend on how these are fixed, so no seed is kept for them
// (docs/protocol.md, "Reservations (R)", names them).
var reservationBugs = []struct {
	seed uint64
	bug  string
}{
	{20, "R4: service/reserve_sweep.go learns the keys with open reservations from the calls its node decides, the records it loads and the journals it adopts; after a failover, a handover or a restart an abandoned reservation of a key whose record was checkpointed and that no call touches again is never expired, and its usage never recorded (the fix: a per-partition index of such keys, written with the checkpoints and read at adoption)"},
}

// TestSimulationReservationBugs runs the seeds of reservationBugs. The
// protocol bugs they found are not fixed yet: remove the skip with the
// fixes.
func TestSimulationReservationBugs(t *testing.T) {
	var names []string
	for _, b := range reservationBugs {
		names = append(names, fmt.Sprintf("seed %d (%s)", b.seed, b.bug))
	}
	t.Skip("protocol bugs not fixed yet: " + strings.Join(names, "; "))
	for _, b := range reservationBugs {
		s, err := New(Config{Seed: b.seed, Faults: true})
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Run(); err != nil {
			t.Errorf("seed %d: %v\n%s\nreproduce: go test ./mesh/internal/sim -run TestSimulation -sim.seed=%d -sim.trace -v",
				b.seed, err, s.Trace(), b.seed)
		}
	}
}
