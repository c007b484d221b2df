package ownership

import (
	"errors"
	"fmt"
	"slices"
	"time"
)

// The Runner's operations on the ownership bucket: claims, releases and
// renewals of partition entries, each reported back through Runner.done.

// do starts one operation of the core; its result comes back through
// r.done.
func (r *Runner) do(op shardOp) {
	key := partKey(op.part)
	report := func(rev uint64, err error) {
		r.done(result{op: op, rev: rev, err: err, conflict: errors.Is(err, ErrConflict)})
	}
	switch op.kind {
	case opClaim:
		r.claim(op, key, report)
	case opRenew:
		r.cfg.KV.Update(key, appendPartValue(nil, partValue{Node: r.cfg.Self, Epoch: op.epoch}), op.rev, r.renewTimeout(), func(rev uint64, err error) {
			if !errors.Is(err, ErrConflict) {
				report(rev, err)
				return
			}
			r.ownRenewal(key, op, func(rev uint64, ok bool) {
				if ok {
					r.done(result{op: op, rev: rev, landed: true})
					return
				}
				report(0, err)
			})
		})
	case opRelease:
		r.release(op, key, report)
	case opHeartbeat:
		b := fmt.Appendf(nil, `{"node":%q,"partitions":%d}`, r.cfg.Self, r.cfg.Parts)
		r.cfg.KV.Put("node."+r.cfg.Self, b, r.op, report)
	}
}

// renewTimeout bounds a renewal's write: half the time between a renewal
// (lease/3 after the last) and the self-fence (2/3 of the lease after it),
// so that a renewal whose request or answer is lost is sent again (at
// once: the retry pause counts from the send) and lands before the owner
// stops serving. One lost message must not take a partition off the mesh
// (invariant O6).
func (r *Runner) renewTimeout() time.Duration { return r.op / 2 }

// adoptTimeout bounds an adoption and a release's checkpoint.
func (r *Runner) adoptTimeout() time.Duration { return max(r.cfg.Lease, 5*time.Second) }

// claim appends the tenure marker the claim needs (Lifecycle.Mark), then
// writes the claim and adopts the partition's records (Lifecycle.Adopt).
// It reports the claim's revision. A failed adoption leaves the partition
// unserved; the entry names this node with the sources, so the core
// claims it again (or another node does) and adopts from them.
func (r *Runner) claim(op shardOp, key string, report func(uint64, error)) {
	life := r.cfg.Life
	write := func() {
		val := appendPartValue(nil, partValue{Node: r.cfg.Self, From: op.sources})
		r.cfg.KV.Update(key, val, op.rev, r.op, func(rev uint64, err error) {
			if err != nil || life == nil {
				report(rev, err)
				return
			}
			life.Adopt(op.part, op.sources, rev, r.adoptTimeout(), func(err error) {
				if err != nil {
					r.log.Warn("adopting a partition's journalled records", "partition", op.part, "from", op.sources, "error", err.Error())
				}
				report(rev, err)
			})
		})
	}
	if life == nil || slices.Contains(op.sources, r.cfg.Self) {
		write()
		return
	}
	life.Mark(op.part, op.rev, r.op, func(err error) {
		if err != nil {
			report(0, fmt.Errorf("appending a tenure marker: %w", err))
			return
		}
		write()
	})
}

// release drains partition op.part, makes its records durable for the
// next owner (Lifecycle.Release: a checkpoint) and deletes its entry so
// the next owner claims it at once; when the records cannot be made
// durable the entry is left to expire (the next owner adopts from the
// journal).
func (r *Runner) release(op shardOp, key string, report func(uint64, error)) {
	r.cfg.Host.Drain(op.part, func() {
		del := func() {
			r.cfg.KV.Delete(key, op.rev, r.op, func(err error) { report(0, err) })
		}
		if r.cfg.Life == nil {
			del()
			return
		}
		var holdUntil time.Time
		if op.until > 0 {
			holdUntil = r.base.Add(time.Duration(op.until - 1))
		}
		r.cfg.Life.Release(op.part, holdUntil, r.adoptTimeout(), func(err error) {
			if err != nil {
				r.log.Warn("partition not checkpointed before its release; leaving its entry to expire",
					"partition", op.part, "error", err.Error())
				report(0, err)
				return
			}
			del()
		})
	})
}

// ownRenewal reads the entry of a renewal refused as a conflict: if it
// names this node in op's epoch at a revision after op.rev, the conflict
// was with a renewal of this node's own whose acknowledgement was lost
// (invariant O3 of docs/protocol.md). Only this node writes its name with
// that epoch; a claim by another node names that node, and a read that
// lags shows op.rev or older.
func (r *Runner) ownRenewal(key string, op shardOp, done func(rev uint64, ok bool)) {
	r.cfg.KV.Get(key, r.op, func(e Entry, err error) {
		if err != nil || e.Rev <= op.rev || !r.namesSelf(e, op.epoch) {
			done(0, false)
			return
		}
		r.log.Debug("renewal refused, but an earlier one landed", "partition", op.part, "revision", e.Rev)
		done(e.Rev, true)
	})
}

// namesSelf reports whether the shards entry e names this node in epoch
// (a claim's epoch is its own revision).
func (r *Runner) namesSelf(e Entry, epoch uint64) bool {
	if e.Deleted {
		return false
	}
	v, err := decodePartValue(e.Value)
	if err != nil || v.Node != r.cfg.Self {
		return false
	}
	if v.Epoch == 0 {
		return e.Rev == epoch
	}
	return v.Epoch == epoch
}

// WatchStale reports whether the watch of the shards bucket has stopped
// delivering: this node's last heartbeat has not come back through it for
// a third of a lease. The driver then watches anew.
func (r *Runner) WatchStale() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.core.watchStale(r.Mono())
}

// Describe reports, for diagnostics, this node's relation to partition p
// and what it last observed of p's entry.
func (r *Runner) Describe(p int) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	h, o := r.core.mine[p], r.core.obs[p]
	return fmt.Sprintf("hold=%d epoch=%d rev=%d renewedAt=%d; entry exists=%v node=%q epoch=%d from=%v rev=%d seen=%d; now=%d pending=%d kept=%d",
		h.state, h.epoch, h.rev, h.renewedAt, o.exists, o.node, o.epoch, o.from, o.rev, o.seen, r.Mono(), r.pending, r.core.kept[p])
}
