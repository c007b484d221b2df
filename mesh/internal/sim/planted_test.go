package sim

import (
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/limitmesh/limitmesh/internal/bugs"
)

// plantedBugs are the mechanisms whose planted bug (internal/bugs)
// the simulation must find: within seeds schedules of the normal run, one
// reports a violation of an invariant named in want (the prefix of a
// violation's message). The bounds are four to twenty times the seeds the
// simulation needed when the test was written (noted with each); noLeased
// runs the schedules without the leased keys (Config.NoLeased). The
// journal fence is reached through the appends a cut-off node's client
// buffers and sends when it reconnects (node.request).
var plantedBugs = []struct {
	bug      bugs.Bug
	seeds    uint64
	want     []string
	noLeased bool
}{
	{bugs.SelfFence, 20, []string{"M1"}, false},                                                 // seed 2: M1
	{bugs.AdoptBeforeServe, 20, []string{"M3", "M4", "R1", "R2", "R3", "U2", "U3"}, false},      // seed 1: R1
	{bugs.ExpectedRecord, 300, []string{"M3", "M4", "R1", "R2", "R3", "U1", "U2", "U3"}, false}, // seed 7: R2
	{bugs.LedgerWatermark, 20, []string{"U3", "R2"}, false},                                     // seed 1: U3
	{bugs.StaleEpochReport, 20, []string{"L2"}, false},                                          // seed 2: L2
	{bugs.RefundSpent, 20, []string{"M6"}, false},                                               // seed 1: M6
	{bugs.JournalFence, 200, []string{"M3", "M4", "R1", "R2", "R3", "U1", "U2", "U3"}, false},   // seed 19: R2
}

// TestPlantedBugs: with each mechanism disabled in turn (a planted bug),
// the simulation reports a violation within a bounded number of seeds. A
// check that never fails is believed but proves nothing: this shows the
// simulation can fail where it matters.
func TestPlantedBugs(t *testing.T) {
	for _, pb := range plantedBugs {
		t.Run(pb.bug.String(), func(t *testing.T) {
			undo := bugs.Plant(pb.bug)
			defer undo()
			flags := ""
			if pb.noLeased {
				flags = " -sim.noleased"
			}
			seed, err := firstViolationIn(Config{NoLeased: pb.noLeased}, pb.seeds, func(err error) bool { return knownBug(err) == nil })
			if err == nil {
				t.Fatalf("with %v planted, %d seeds (leased keys off: %v) report no violation: the simulation does not check the mechanism (go test ./mesh/internal/sim -run TestSimulation -sim.plant=%v%s -sim.seeds=%d -v)",
					pb.bug, pb.seeds, pb.noLeased, pb.bug, flags, pb.seeds)
			}
			first, _, _ := strings.Cut(err.Error(), "\n")
			if !violates(err, pb.want) {
				t.Fatalf("with %v planted, seed %d reports %q; want a violation of %v\nreproduce: go test ./mesh/internal/sim -run TestSimulation -sim.plant=%v%s -sim.seed=%d -sim.trace -v",
					pb.bug, seed, first, pb.want, pb.bug, flags, seed)
			}
			t.Logf("seed %d of %d: %s (go test ./mesh/internal/sim -run TestSimulation -sim.plant=%v%s -sim.seed=%d -sim.trace -v)", seed, pb.seeds, first, pb.bug, flags, seed)
		})
	}
}

// violates reports whether one of err's violations names an invariant of
// want.
func violates(err error, want []string) bool {
	for _, line := range strings.Split(err.Error(), "\n") {
		_, msg, ok := strings.Cut(line, "s: ") // "at 1.234567s: M3: ..."
		if !ok || !strings.HasPrefix(line, "at ") {
			msg = line
		}
		for _, w := range want {
			if strings.HasPrefix(msg, w+":") || strings.HasPrefix(msg, w+" ") {
				return true
			}
		}
	}
	return false
}

// firstViolation runs the normal configuration's seeds 1..seeds in
// parallel and returns the lowest seed whose violations match, and its
// error (nil: none). Every seed below the one returned is run, so the
// answer does not depend on the scheduling.
func firstViolation(seeds uint64, match func(error) bool) (uint64, error) {
	return firstViolationIn(Config{}, seeds, match)
}

// firstViolationIn is firstViolation of base's seeds 1..seeds (with faults).
func firstViolationIn(base Config, seeds uint64, match func(error) bool) (uint64, error) {
	var (
		next  atomic.Uint64
		mu    sync.Mutex
		found uint64 // 0: none yet
		ferr  error
		wg    sync.WaitGroup
	)
	next.Store(1)
	for range runtime.GOMAXPROCS(0) {
		wg.Go(func() {
			for {
				seed := next.Add(1) - 1
				mu.Lock()
				done := seed > seeds || found != 0 && seed > found
				mu.Unlock()
				if done {
					return
				}
				cfg := base
				cfg.Seed, cfg.Faults = seed, true
				s, err := New(cfg)
				if err == nil {
					err = s.Run()
				}
				if err == nil || !match(err) {
					continue
				}
				mu.Lock()
				if found == 0 || seed < found {
					found, ferr = seed, errors.New(err.Error())
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return found, ferr
}

// TestSameSeedSameTrace: a seed run twice schedules the same events in the
// same order: the two runs' full traces (every node's debug log, every
// decision and shards write) and step counts are identical. A failing seed
// is a one-line reproduction only if this holds. The lines of one instant
// are compared in sorted order: a debug log may list a map's entries (the
// records an adoption reads) in the map's order, which does not change
// the schedule (a different order of events would change what follows).
func TestSameSeedSameTrace(t *testing.T) {
	for _, seed := range []uint64{3, 158, 345} {
		run := func() ([]string, int, string) {
			s, err := New(Config{Seed: seed, Faults: true, Debug: true})
			if err != nil {
				t.Fatal(err)
			}
			err = s.Run()
			return byInstant(s.trace), s.Steps(), fmt.Sprint(err)
		}
		a, aSteps, aErr := run()
		b, bSteps, bErr := run()
		for i := range min(len(a), len(b)) {
			if a[i] != b[i] {
				t.Fatalf("seed %d: the runs differ at trace line %d:\n%s\n%s\nreproduce: go test ./mesh/internal/sim -run TestSimulation -sim.seed=%d -sim.trace -v (twice)", seed, i, a[i], b[i], seed)
			}
		}
		if len(a) != len(b) || aSteps != bSteps || aErr != bErr {
			t.Fatalf("seed %d: %d and %d trace lines, %d and %d steps, errors %q and %q", seed, len(a), len(b), aSteps, bSteps, aErr, bErr)
		}
		if len(a) < 1000 {
			t.Fatalf("seed %d: %d trace lines: a debug trace holds every decision", seed, len(a))
		}
	}
}

// byInstant returns trace with the lines of each instant sorted.
func byInstant(trace []string) []string {
	out := slices.Clone(trace)
	for i := 0; i < len(out); {
		j := i + 1
		for j < len(out) && out[j][:10] == out[i][:10] {
			j++
		}
		slices.Sort(out[i:j])
		i = j
	}
	return out
}

// faultKinds are the seven faults fault() draws, as the trace names them.
var faultKinds = []string{" crashes", " leaves", " cut off", " reads from a cut-off leader", " elects a leader", "'s watch stalls", " pauses for"}

// TestEveryFaultOccurs: each of the seven fault draws injects its fault in
// the first 10 seeds (a draw whose conditions never hold checks nothing).
func TestEveryFaultOccurs(t *testing.T) {
	seen := map[string]int{}
	for seed := uint64(1); seed <= 10; seed++ {
		s, err := New(Config{Seed: seed, Faults: true})
		if err != nil {
			t.Fatal(err)
		}
		s.Run()
		for _, line := range s.trace {
			for _, f := range faultKinds {
				if strings.Contains(line, f) {
					seen[f]++
				}
			}
		}
	}
	for _, f := range faultKinds {
		if seen[f] == 0 {
			t.Errorf("no fault %q in 10 seeds", strings.TrimSpace(f))
		}
	}
	t.Logf("faults in 10 seeds: %v", seen)
}
