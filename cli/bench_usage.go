package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	lmusage "github.com/limitmesh/limitmesh/usage"
)

// The usage lag of a bench run: at the end of the last decide slice, how
// far the usage ledger is behind the usage stream (lmusage.MeasureLag): the
// age of the oldest record in the stream that the ledger's consumer has not
// acknowledged, and how many batches are in that state. Records the nodes
// still buffer (at most --usage-interval old) are not in the stream yet and
// not counted.

// measureUsageLag measures the lag of the deployment js reaches; nil
// figures and a note when there is none to measure (usage off, no stream,
// a failed request).
func measureUsageLag(ctx context.Context, js jetstream.JetStream, c *benchConfig) (lagMs *float64, pending *uint64, note string) {
	if !c.usage {
		return nil, nil, "off (--usage=false)"
	}
	mctx, cancel := context.WithTimeout(ctx, c.cf.timeout+5*time.Second)
	defer cancel()
	l, err := lmusage.MeasureLag(mctx, js, c.cf.prefix, time.Now())
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound):
		return nil, nil, "none (no usage stream " + lmusage.StreamName(c.cf.prefix) + ": usage is off)"
	case err != nil:
		return nil, nil, "not measured: " + err.Error()
	}
	ms := math.Round(float64(l.Oldest.Microseconds())) / 1e3
	return &ms, &l.Pending, ""
}

// printUsageLag writes the report's usage lag line.
func (rep *benchReport) printUsageLag(w io.Writer) {
	if rep.UsageLagMs == nil {
		if rep.usageNote == "" {
			return // not measured (leased mode)
		}
		fmt.Fprintf(w, "usage lag: %s\n", rep.usageNote)
		return
	}
	fmt.Fprintf(w, "usage lag: %.3f s (%d usage batches not yet in the ledger at the end of the run)\n",
		*rep.UsageLagMs/1e3, *rep.UsagePending)
}
