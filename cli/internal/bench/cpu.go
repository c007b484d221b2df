package bench

import (
	"math"
	"syscall"
	"time"
)

// The CPU cost of a bench run's phases: this process's CPU time (user and
// system, all its threads) during each phase's slices, per reply. On a
// shared machine, where the CPU a run gets varies with everything else
// running, the CPU time a decision costs varies far less than the
// decisions per second, so builds and settings are compared by it as
// well. It counts everything the process does meanwhile: the load
// workers always, and, with the embedded node, the node and its NATS
// server (their background work, such as the usage ledger, included).

// processCPU returns this process's CPU time so far (0 if it cannot be
// read).
func processCPU() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// cpuPer is cpu per reply in µs, rounded to 0.01 (0 without replies).
func cpuPer(cpu time.Duration, replies int64) float64 {
	if replies <= 0 {
		return 0
	}
	return math.Round(float64(cpu.Nanoseconds())/float64(replies)/10) / 100
}
