// Package elector runs a job on one node at a time among the nodes that
// share a KV entry: the usage ledger's reconciler (mesh wires it) and the
// shadow evaluator (shadow). The lease's timing is package fence's rule,
// the one partition ownership keeps; core.go is that lease as a pure state
// machine, elector.go the driver that does the KV reads and writes and runs
// the job (docs/protocol.md, "The elector").
//
// elector imports fence and nats.go's jetstream, nothing else of the
// module.
package elector

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/limitmesh/limitmesh/internal/fence"
	"github.com/nats-io/nats.go/jetstream"
)

// Elector runs a job on one node at a time across the nodes that share a KV
// entry (a singleton lease, see leaseCore for the rules): the ledger's
// reconciler, the shadow evaluator. Its lease entry holds JSON naming the
// holder, {"node":"n1","id":"<random per Elector>","lease_ms":3000}, written
// only with compare-and-swap (kv.Create, kv.Update), and deleted (with
// compare-and-swap) when the holder stops, so another elector takes over at
// once; when a holder dies without deleting, another takes over within
// about 1.33 lease (it must see the entry unchanged for a whole lease).
//
// Create one with [New] and call [Elector.Run] once.
type Elector struct {
	kv    jetstream.KeyValue
	key   string
	node  string
	id    string
	lease time.Duration
	log   *slog.Logger

	base time.Time // the monotonic clock's origin
	ran  atomic.Bool
}

// JobRestartDelay is the pause before a job that returned while its
// elector still leads is started again.
const JobRestartDelay = 500 * time.Millisecond

// leaseValue is the JSON of a lease entry.
type leaseValue struct {
	Node    string `json:"node"`
	ID      string `json:"id"`
	LeaseMs int64  `json:"lease_ms"`
}

// New returns an elector for the entry key of bucket kv (for
// example key "leader.ledger" of the ledger bucket) naming nodeID as the
// holder. lease is the lease duration (at least 30 ms; a few seconds in
// production: a dead holder's job moves within about 1.33 lease). log may
// be nil.
func New(kv jetstream.KeyValue, key, nodeID string, lease time.Duration, log *slog.Logger) *Elector {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	var id [8]byte
	_, _ = rand.Read(id[:])
	return &Elector{
		kv: kv, key: key, node: nodeID, id: hex.EncodeToString(id[:]), lease: lease,
		log:  log.With("elector", key),
		base: time.Now(),
	}
}

// mono is the elector's monotonic clock, ns.
func (e *Elector) mono() int64 { return int64(time.Since(e.base)) }

// Run takes part in the election until ctx is done, running job whenever
// this elector leads. job's context is cancelled when the lease is lost
// (at the self-fence instant, even while the server cannot be reached) or
// ctx ends; a job that returns while the elector still leads is started
// again after JobRestartDelay (its error is logged). When ctx ends, Run
// waits for job to return, deletes the entry if it still holds it, and
// returns nil. Run returns ErrClosed when called a second time, or an
// error wrapping ErrConfig for a lease below 30 ms or a key that is not a
// valid KV key (jetstream.ErrInvalidKey).
func (e *Elector) Run(ctx context.Context, job func(ctx context.Context) error) error {
	if !e.ran.CompareAndSwap(false, true) {
		return ErrClosed
	}
	if e.lease < 30*time.Millisecond {
		return fmt.Errorf("%w: lease %v is below 30ms", ErrConfig, e.lease)
	}
	value, _ := json.Marshal(leaseValue{Node: e.node, ID: e.id, LeaseMs: e.lease.Milliseconds()})
	core := leaseCore{lease: fence.Lease(e.lease)}
	var (
		jobCancel  context.CancelFunc
		jobDone    chan error
		fenceTimer *time.Timer
		restartAt  int64
	)
	stopJob := func() {
		if jobCancel == nil {
			return
		}
		jobCancel()
		if err := <-jobDone; err != nil && !errors.Is(err, context.Canceled) {
			e.log.Warn("job ended", "err", err)
		}
		fenceTimer.Stop()
		jobCancel, jobDone = nil, nil
	}
	defer func() {
		stopJob()
		if core.mine {
			dctx, cancel := context.WithTimeout(context.Background(), e.lease/3)
			err := e.kv.Delete(dctx, e.key, jetstream.LastRevision(core.rev))
			cancel()
			if err != nil {
				e.log.Debug("release failed", "err", err)
			} else {
				e.log.Info("released leadership", "node", e.node)
			}
		}
	}()
	wasLeader := false
	for {
		if ctx.Err() != nil {
			return nil
		}
		now := e.mono()
		leads := core.leads(now)
		if leads != wasLeader {
			wasLeader = leads
			if leads {
				e.log.Info("leading", "node", e.node, "revision", core.rev)
			} else {
				e.log.Info("not leading", "node", e.node)
			}
		}
		if !leads && jobCancel != nil {
			stopJob()
			continue
		}
		if leads && jobCancel == nil && now >= restartAt {
			jctx, cancel := context.WithCancel(ctx)
			done := make(chan error, 1)
			jobCancel, jobDone = cancel, done
			fenceTimer = time.AfterFunc(time.Duration(core.fence-now), cancel)
			go func() { done <- job(jctx) }()
		}

		op := core.next(now)
		switch op.kind {
		case opRead:
			rctx, cancel := context.WithTimeout(ctx, e.lease/3)
			ent, err := e.kv.Get(rctx, e.key)
			cancel()
			switch {
			case err == nil:
				var v leaseValue
				_ = json.Unmarshal(ent.Value(), &v)
				core.observe(e.mono(), true, ent.Revision(), v.ID == e.id)
			case errors.Is(err, jetstream.ErrKeyNotFound):
				core.observe(e.mono(), false, 0, false)
			case errors.Is(err, jetstream.ErrInvalidKey):
				return fmt.Errorf("%w: lease key %q", ErrConfig, e.key)
			default:
				if ctx.Err() == nil {
					e.log.Debug("read failed", "err", err)
				}
				core.readFailed(e.mono())
			}
		case opClaim, opWrite:
			wctx, cancel := context.WithTimeout(ctx, e.lease/3)
			sendAt := e.mono()
			var (
				rev uint64
				err error
			)
			if op.kind == opClaim {
				rev, err = e.kv.Create(wctx, e.key, value)
			} else {
				rev, err = e.kv.Update(wctx, e.key, value, op.rev)
			}
			cancel()
			now := e.mono()
			switch {
			case err == nil:
				core.wrote(sendAt, now, writeOK, rev)
				if jobCancel != nil && fenceTimer.Stop() {
					fenceTimer.Reset(time.Duration(core.fence - now))
				}
			case errors.Is(err, jetstream.ErrKeyRevisionMismatch) || errors.Is(err, jetstream.ErrKeyExists):
				core.wrote(sendAt, now, writeConflict, 0)
			default:
				if ctx.Err() == nil {
					e.log.Debug("write failed", "err", err)
				}
				core.wrote(sendAt, now, writeFailed, 0)
			}
		case opWait:
			wait := op.at - now
			if leads && jobCancel == nil && restartAt > now {
				wait = min(wait, restartAt-now)
			}
			t := time.NewTimer(time.Duration(wait))
			select {
			case <-ctx.Done():
			case <-t.C:
			case err := <-jobDone:
				// The job returned while leading: restart it later.
				jobCancel()
				fenceTimer.Stop()
				jobCancel, jobDone = nil, nil
				if err != nil && !errors.Is(err, context.Canceled) {
					e.log.Warn("job failed; restarting", "err", err, "after", JobRestartDelay)
				}
				restartAt = e.mono() + int64(JobRestartDelay)
			}
			t.Stop()
		}
	}
}
