// Package rt is the runtime the mesh's machines reach time, concurrency and
// other nodes through: the current time, timers, new goroutines and
// requests to other nodes (Requester). Production uses [Real] and [NATS];
// the deterministic simulation (mesh/internal/sim) supplies its own, in
// which time is simulated, messages cross a simulated network and every
// callback runs on one scheduler, so a schedule replays exactly from its
// seed.
//
// A machine that uses a Runtime never calls time.Now, time.AfterFunc,
// time.Sleep or the go statement itself, and never blocks on a channel,
// a context or a wait group: it starts an operation with a callback and
// continues in the callback.
package rt

import (
	"context"
	"time"

	"github.com/nats-io/nats.go"
)

// Runtime gives a machine its clock, its timers and its goroutines.
type Runtime interface {
	// Now returns the current time. Durations between two readings of
	// one Runtime are monotonic; readings of different nodes' Runtimes
	// are never compared.
	Now() time.Time
	// AfterFunc calls f once, on a goroutine of its own, after d (at
	// once when d <= 0). stop cancels the call and reports whether it
	// did (false: f has run or is running).
	AfterFunc(d time.Duration, f func()) (stop func() bool)
	// Go runs f on a goroutine of its own. Callbacks use it to avoid
	// running a caller's continuation under the callee's locks.
	Go(f func())
}

// Real is the production Runtime: the system clock, time.AfterFunc and
// the go statement.
var Real Runtime = realRuntime{}

type realRuntime struct{}

func (realRuntime) Now() time.Time { return time.Now() }

func (realRuntime) AfterFunc(d time.Duration, f func()) func() bool {
	return time.AfterFunc(d, f).Stop
}

func (realRuntime) Go(f func()) { go f() }

// Mono returns the nanoseconds from base to now on r's clock, plus one (so
// a valid instant is never 0). Leases measure durations on one node with
// it.
func Mono(r Runtime, base time.Time) int64 { return int64(r.Now().Sub(base)) + 1 }

// Requester sends a request to whichever node subscribes to its subject
// and delivers the reply: over a NATS connection in production ([NATS]),
// over the simulated network in the simulation.
type Requester interface {
	// Request sends m (its Subject set; its Reply is the Requester's)
	// and calls done exactly once, never before Request returns, with
	// the reply or the error: nats.ErrNoResponders when nothing
	// subscribes to the subject, context.DeadlineExceeded when no reply
	// came by deadline, or the connection's error.
	Request(m *nats.Msg, deadline time.Time, done func(reply *nats.Msg, err error))
}

// NATS returns the Requester over nc: each request waits for its reply
// on a goroutine of its own.
func NATS(nc *nats.Conn) Requester { return natsRequester{nc} }

type natsRequester struct{ nc *nats.Conn }

func (q natsRequester) Request(m *nats.Msg, deadline time.Time, done func(*nats.Msg, error)) {
	go func() {
		ctx, cancel := context.WithDeadline(context.Background(), deadline)
		resp, err := q.nc.RequestMsgWithContext(ctx, m)
		cancel()
		done(resp, err)
	}()
}
