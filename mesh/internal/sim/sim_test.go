package sim

import (
	"flag"
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/bugs"
)

var (
	seedFlag  = flag.Uint64("sim.seed", 0, "run only this seed (a failing seed's reproduction)")
	seedsFlag = flag.Int("sim.seeds", 0, "how many seeds TestSimulation runs (default: 1500, 150 with -short)")
	traceFlag = flag.Bool("sim.trace", false, "print the run's trace")
	plantFlag = flag.String("sim.plant", "", "plant this bug (internal/bugs: SelfFence, JournalFence, ...) in TestSimulation's runs")
	noLeased  = flag.Bool("sim.noleased", false, "run TestSimulation without the leased keys (Config.NoLeased)")
)

// TestMain runs the simulation's tests with the garbage collector set to
// collect at five times the live heap, not twice: a schedule allocates
// short-lived events and messages by the million and keeps little, so the
// default spends about a third of the CPU collecting (measured: 20.7 s of
// CPU for 200 seeds, 14.3 s at 400; the peak heap grew by 9%).
func TestMain(m *testing.M) {
	debug.SetGCPercent(400)
	os.Exit(m.Run())
}

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
	if *plantFlag != "" {
		b, ok := bugs.Parse(*plantFlag)
		if !ok {
			t.Fatalf("-sim.plant=%s: no such bug", *plantFlag)
		}
		defer bugs.Plant(b)()
	}
	start := time.Now()
	var (
		next     atomic.Uint64
		wg       sync.WaitGroup
		mu       sync.Mutex
		failures []string
		known    = map[string][]uint64{} // known bug -> the seeds that hit it
		steps    atomic.Int64
		unserved float64 // the runs' shares of partition-time without an owner after converging
	)
	next.Store(first)
	for range runtime.GOMAXPROCS(0) {
		wg.Go(func() {
			for {
				seed := next.Add(1) - 1
				if seed >= first+seeds {
					return
				}
				s, err := New(Config{Seed: seed, Faults: true, Debug: *traceFlag, NoLeased: *noLeased})
				if err != nil {
					t.Error(err)
					return
				}
				err = s.Run()
				steps.Add(int64(s.Steps()))
				mu.Lock()
				unserved += s.check.unservedShare()
				mu.Unlock()
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
						failures = append(failures, fmt.Sprintf("seed %d: %v\n%s\nreproduce: %s", seed, err, s.Trace(), reproduce(seed)))
					}
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	share := unserved / float64(seeds)
	t.Logf("%d schedules, %d steps in %v; partitions without an owner %.4f%% of the time after converging",
		seeds, steps.Load(), time.Since(start).Round(time.Millisecond), 100*share)
	if seeds >= 100 && share > maxUnserved {
		// M5 over many runs: with 1% of messages lost, one lost message
		// must not take a partition off the mesh (O6: 0.65% when a lost
		// renewal timed out at the self-fence; about 0.015% since).
		t.Errorf("M5: partitions went without an owner %.4f%% of the time after converging, over %d seeds (at most %.2f%%)",
			100*share, seeds, 100*maxUnserved)
	}
	for _, b := range knownBugs {
		if ss := known[b.sign]; len(ss) > 0 {
			slices.Sort(ss)
			t.Logf("KNOWN PROTOCOL BUG, not fixed yet (%s): %d seeds hit it, first %d (%s)", b.name, len(ss), ss[0], reproduce(ss[0]))
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

// reproduce is the command that replays seed as TestSimulation ran it.
func reproduce(seed uint64) string {
	plant := ""
	if *plantFlag != "" {
		plant = " -sim.plant=" + *plantFlag
	}
	if *noLeased {
		plant += " -sim.noleased"
	}
	return fmt.Sprintf("go test ./mesh/internal/sim -run TestSimulation%s -sim.seed=%d -sim.trace -v", plant, seed)
}

// maxUnserved bounds the share of partition-time without an owner after
// the mesh converged, over TestSimulation's seeds.
const maxUnserved = 0.001

// knownBugs are the protocol bugs the reservation checks found that are
// not fixed yet, each with the words its failures' messages carry
// (rescheck.go). TestSimulation reports the seeds whose every violation
// names one of them instead of failing on them, so the rest of the
// invariants keep guarding every run; -sim.seed=N still fails on them.
// Remove a bug's entry with its fix (TestKnownBugsStillOccur then says
// so).
var knownBugs = []struct{ name, sign string }{}

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

// TestKnownBugsStillOccur: every known bug is still hit by one of the
// first 200 seeds (the run that found it, or a later one: a change to the
// simulation or the mesh changes what a seed schedules, so no seed is
// kept). When one is no longer hit, its fix has landed or the simulation
// no longer reaches it: remove its entry, or find why.
func TestKnownBugsStillOccur(t *testing.T) {
	for _, b := range knownBugs {
		seed, err := firstViolation(200, func(err error) bool { return strings.Contains(err.Error(), b.sign) })
		if err == nil {
			t.Errorf("known bug %q: no violation naming %q in 200 seeds: fixed, or no longer reached", b.name, b.sign)
			continue
		}
		t.Logf("known bug %q: first at seed %d (go test ./mesh/internal/sim -run TestSimulation -sim.seed=%d -sim.trace -v)", b.name, seed, seed)
	}
}
