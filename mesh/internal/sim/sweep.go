package sim

import "github.com/limitmesh/limitmesh/mesh/internal/service"

// sweepLag bounds, in global ns, how long after a reservation's expiry a
// node that knows of it has swept it (its service's sweeps,
// service/reserve_sweep.go): two intervals of a clock that runs up to
// maxDrift slow.
var sweepLag = int64(2*service.SweepInterval) * (1_000_000 + maxDrift) / 1_000_000
