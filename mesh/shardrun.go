package mesh

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// The shard runner: the goroutine around the ownership core (shard.go).
// It watches the shards bucket, ticks the core, does the KV writes the core
// asks for (each in its own goroutine, results back on a channel), and
// applies the core's state to the routing table, the shard subscriptions
// and the key table.

// shardConfigKey is the shards bucket entry that records the partition
// count every node must use.
const shardConfigKey = "config"

type shardConfigValue struct {
	Partitions int `json:"partitions"`
}

type shardResult struct {
	op       shardOp
	rev      uint64
	err      error
	conflict bool
	landed   bool                    // an opRenew conflict that was this node's own renewal (renewLanded)
	entry    jetstream.KeyValueEntry // a verify read (op.kind == 0)
}

type shardRunner struct {
	n     *Node
	kv    jetstream.KeyValue
	core  *shardCore
	log   *slog.Logger
	lease time.Duration

	results chan shardResult
	leaveCh chan struct{}

	mu       sync.Mutex // guards the fields below
	settled  chan struct{}
	empty    chan struct{}
	isSettle bool
	isEmpty  bool

	// Owned by the run goroutine.
	subs    []*nats.Subscription
	pending int
	changes [3]int // claims, releases, losses already counted
}

func newShardRunner(n *Node, kv jetstream.KeyValue) *shardRunner {
	return &shardRunner{
		n:       n,
		kv:      kv,
		core:    newShardCore(n.cfg.NodeID, n.cfg.Partitions, int64(n.cfg.LeaseTime)),
		log:     n.log,
		lease:   n.cfg.LeaseTime,
		results: make(chan shardResult, 4*n.cfg.Partitions+8),
		leaveCh: make(chan struct{}),
		settled: make(chan struct{}),
		empty:   make(chan struct{}),
		subs:    make([]*nats.Subscription, n.cfg.Partitions),
	}
}

// checkShardConfig records the partition count in the shards bucket, or
// checks it against the recorded one.
func checkShardConfig(ctx context.Context, kv jetstream.KeyValue, parts int) error {
	b, _ := json.Marshal(shardConfigValue{Partitions: parts})
	if _, err := kv.Create(ctx, shardConfigKey, b); err == nil {
		return nil
	} else if !errors.Is(err, jetstream.ErrKeyExists) {
		return fmt.Errorf("mesh: recording the partition count: %w", err)
	}
	e, err := kv.Get(ctx, shardConfigKey)
	if err != nil {
		return fmt.Errorf("mesh: reading the partition count: %w", err)
	}
	var v shardConfigValue
	if err := json.Unmarshal(e.Value(), &v); err != nil {
		return fmt.Errorf("%w: shards bucket %s: %v", ErrCorruptRecord, shardConfigKey, err)
	}
	if v.Partitions != parts {
		return fmt.Errorf("%w: this node has %d partitions, the mesh %d (key %q of bucket %s); every node must use the same count",
			ErrPartitionMismatch, parts, v.Partitions, shardConfigKey, kv.Bucket())
	}
	return nil
}

// run drives the core until ctx ends. w is a WatchAll of the shards bucket.
func (s *shardRunner) run(ctx context.Context, w jetstream.KeyWatcher) {
	defer w.Stop()
	tickEvery := max(s.lease/15, 5*time.Millisecond)
	tk := time.NewTicker(tickEvery)
	defer tk.Stop()
	updates := w.Updates()
	leaveCh := s.leaveCh
	initial := false
	defer s.closeSubs()
	for {
		select {
		case <-ctx.Done():
			return
		case e, ok := <-updates:
			if !ok {
				updates = nil
				s.log.Warn("shards watch closed")
				continue
			}
			if e == nil {
				initial = true
			} else {
				s.observe(e)
			}
		case r := <-s.results:
			s.apply(r)
		case <-leaveCh:
			leaveCh = nil
			s.core.leaving = true
		case <-tk.C:
		}
		if !initial {
			continue
		}
		now := s.n.router.mono()
		ops := s.core.tick(now)
		s.sync(now)
		for _, op := range ops {
			s.pending++
			go s.do(ctx, op)
		}
	}
}

func (s *shardRunner) observe(e jetstream.KeyValueEntry) {
	now := s.n.router.mono()
	deleted := e.Operation() != jetstream.KeyValuePut
	key := e.Key()
	switch {
	case strings.HasPrefix(key, "node."):
		s.core.observeNode(strings.TrimPrefix(key, "node."), e.Revision(), deleted, now)
	case strings.HasPrefix(key, "part."):
		n, err := strconv.Atoi(strings.TrimPrefix(key, "part."))
		if err != nil || n < 0 || n >= s.core.parts {
			return
		}
		var v partValue
		if !deleted {
			if v, err = decodePartValue(e.Value()); err != nil {
				// An entry no node wrote: treat it as a foreign owner
				// (it expires like any unrenewed entry).
				s.log.Warn("corrupt shard entry", "key", key, "error", err.Error())
				v = partValue{Node: "?"}
			}
		}
		newer := e.Revision() > s.core.obs[n].rev
		s.core.observePart(n, v, e.Revision(), deleted, now)
		// Another node renewed (so it finished adopting from this node's
		// journal) or the entry was released (checkpointed first); an
		// entry older than one already seen says nothing of the present.
		if j := s.n.journal; j != nil && newer && (deleted || (v.Node != s.core.self && v.Epoch != 0)) {
			j.ownedElsewhere(n)
		}
	}
}

func (s *shardRunner) apply(r shardResult) {
	now := s.n.router.mono()
	switch r.op.kind {
	case 0:
		if r.entry != nil {
			s.observe(r.entry)
		}
		return
	case opClaim:
		s.core.claimed(r.op, r.rev, r.err, now)
		if r.err != nil && !r.conflict {
			s.log.Warn("partition claim failed", "partition", r.op.part, "error", r.err.Error())
		}
	case opRenew:
		if r.landed {
			s.core.renewLanded(r.op, r.rev, now)
		} else {
			s.core.renewed(r.op, r.rev, r.err, r.conflict, now)
		}
		if j := s.n.journal; j != nil && r.err == nil {
			j.renewed(r.op.part)
		}
		if r.err != nil {
			s.log.Warn("partition renewal failed", "partition", r.op.part, "error", r.err.Error())
		}
	case opRelease:
		s.core.released(r.op, r.err == nil, now)
	case opHeartbeat:
		s.core.beat(r.op, r.err)
		if r.err != nil {
			s.log.Warn("heartbeat failed", "error", r.err.Error())
		}
	}
	s.pending--
}

// sync applies the core's state: routing slots, subscriptions, dropped
// keys of lost partitions, metrics, and the settled and empty signals.
func (s *shardRunner) sync(now int64) {
	rt := s.n.router
	for p := range s.core.parts {
		slot := &rt.slots[p]
		if s.core.holds(p) {
			until, _ := s.core.serving(p, now)
			slot.epoch.Store(s.core.mine[p].epoch)
			slot.until.Store(until)
			if s.subs[p] == nil {
				sub, err := s.n.nc.Subscribe(rt.subjects[p], func(m *nats.Msg) { s.n.handleDecide(msgRequest{m}) })
				if err != nil {
					s.log.Warn("subscribing to a shard subject", "subject", rt.subjects[p], "error", err.Error())
					continue
				}
				_ = sub.SetPendingLimits(-1, -1)
				s.subs[p] = sub
			}
			continue
		}
		slot.until.Store(0)
		if s.subs[p] != nil {
			// Drain: requests already delivered are still handled (and
			// forwarded, since the slot no longer serves).
			_ = s.subs[p].Drain()
			s.subs[p] = nil
		}
	}
	for _, p := range s.core.takeLost() {
		s.log.Warn("partition lost", "partition", p)
		s.n.dropPartitionKeys(p)
		if j := s.n.journal; j != nil {
			j.lose(p)
		}
	}
	m := s.n.metrics
	m.ownedPartitions.Set(float64(s.core.owned()))
	for i, c := range [3]int{s.core.claims, s.core.releases, s.core.losses} {
		if d := c - s.changes[i]; d > 0 {
			m.ownershipChanges.WithLabelValues([3]string{"claimed", "released", "lost"}[i]).Add(float64(d))
		}
		s.changes[i] = c
	}
	s.mu.Lock()
	if !s.isSettle && s.core.settled(now) {
		s.isSettle = true
		close(s.settled)
	}
	if !s.isEmpty && s.core.leaving && s.core.empty() && s.pending == 0 {
		s.isEmpty = true
		close(s.empty)
	}
	s.mu.Unlock()
}

func (s *shardRunner) closeSubs() {
	for p, sub := range s.subs {
		if sub != nil {
			_ = sub.Unsubscribe()
			s.subs[p] = nil
		}
		s.n.router.slots[p].until.Store(0)
	}
}

// do performs one KV operation of the core and reports its result.
func (s *shardRunner) do(ctx context.Context, op shardOp) {
	r := shardResult{op: op}
	opTimeout := max(s.lease/3, 50*time.Millisecond)
	opCtx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	key := "part." + strconv.Itoa(op.part)
	switch op.kind {
	case opClaim:
		r.rev, r.err = s.claim(ctx, op, key, opTimeout)
	case opRenew:
		r.rev, r.err = s.kv.Update(opCtx, key, appendPartValue(nil, partValue{Node: s.core.self, Epoch: op.epoch}), op.rev)
		if errors.Is(r.err, jetstream.ErrKeyRevisionMismatch) {
			vctx, cancel := context.WithTimeout(ctx, opTimeout)
			if rev, ok := s.ownRenewal(vctx, key, op); ok {
				r.rev, r.err, r.landed = rev, nil, true
			}
			cancel()
		}
	case opRelease:
		s.drain(ctx, op.part)
		if j := s.n.journal; j != nil {
			// The next owner reads the state bucket, not this node's
			// journal: checkpoint first, or leave the entry to expire
			// (then the next owner adopts from the journal).
			jctx, cancel := context.WithTimeout(ctx, max(s.lease, 5*time.Second))
			r.err = j.release(jctx, op.part)
			cancel()
			if r.err != nil {
				s.log.Warn("partition not checkpointed before its release; leaving its entry to expire",
					"partition", op.part, "error", r.err.Error())
				break
			}
		}
		opCtx2, cancel2 := context.WithTimeout(ctx, opTimeout)
		r.err = s.kv.Delete(opCtx2, key, jetstream.LastRevision(op.rev))
		cancel2()
		if r.err == nil {
			s.log.Debug("partition released", "partition", op.part)
		}
	case opHeartbeat:
		b, _ := json.Marshal(map[string]any{"node": s.core.self, "partitions": s.core.parts})
		_, r.err = s.kv.Put(opCtx, "node."+s.core.self, b)
	}
	r.conflict = errors.Is(r.err, jetstream.ErrKeyRevisionMismatch) || errors.Is(r.err, jetstream.ErrKeyExists)
	select {
	case s.results <- r:
	case <-ctx.Done():
	}
}

// ownRenewal reads the entry of a renewal refused as a conflict: if it
// names this node in op's epoch at a revision after op.rev, the conflict
// was with a renewal of this node's own whose acknowledgement was lost (a
// timeout under load; seen in TestJournalClaimerKilled, where the node then
// gave up partitions nobody else had claimed). Only this node writes its
// name with that epoch; a claim by another node names that node, and a
// read that lags shows op.rev or older.
func (s *shardRunner) ownRenewal(ctx context.Context, key string, op shardOp) (uint64, bool) {
	e, err := s.kv.Get(ctx, key)
	if err != nil || e.Revision() <= op.rev || !s.namesSelf(e, op.epoch) {
		return 0, false
	}
	s.log.Debug("renewal refused, but an earlier one landed", "partition", op.part, "revision", e.Revision())
	return e.Revision(), true
}

// namesSelf reports whether the shards entry e names this node in epoch
// (a claim's epoch is its own revision).
func (s *shardRunner) namesSelf(e jetstream.KeyValueEntry, epoch uint64) bool {
	v, err := decodePartValue(e.Value())
	if err != nil || v.Node != s.core.self {
		return false
	}
	if v.Epoch == 0 {
		return e.Revision() == epoch
	}
	return v.Epoch == epoch
}

// claim appends the tenure marker the claim needs (see journalStore.marker),
// then writes the claim (each within timeout) and adopts the partition's
// records. It returns the claim's revision.
func (s *shardRunner) claim(ctx context.Context, op shardOp, key string, timeout time.Duration) (uint64, error) {
	j := s.n.journal
	if j != nil && !slices.Contains(op.sources, s.core.self) {
		mctx, cancel := context.WithTimeout(ctx, timeout)
		err := j.marker(mctx, op.part, op.rev)
		cancel()
		if err != nil {
			return 0, fmt.Errorf("appending a tenure marker: %w", err)
		}
	}
	cctx, cancel := context.WithTimeout(ctx, timeout)
	rev, err := s.kv.Update(cctx, key, appendPartValue(nil, partValue{Node: s.core.self, From: op.sources}), op.rev)
	cancel()
	if err == nil && j != nil {
		err = s.adopt(ctx, op, rev)
	}
	return rev, err
}

// adopt takes partition op.part over from the journals of op.sources
// before the claim is reported and the partition served. An error leaves
// the partition unserved; the entry names this node with the sources, so
// the core claims it again (or another node does) and adopts from them.
func (s *shardRunner) adopt(ctx context.Context, op shardOp, epoch uint64) error {
	actx, cancel := context.WithTimeout(ctx, max(s.lease, 5*time.Second))
	defer cancel()
	if err := s.n.journal.adopt(actx, op.sources, epoch, op.part); err != nil {
		s.log.Warn("adopting a partition's journalled records", "partition", op.part, "from", op.sources, "error", err.Error())
		return err
	}
	return nil
}

// drain waits until partition p has no call in flight on this node
// (bounded by the decision timeout: the slot no longer serves, so no new
// call starts), writes its keys' unwritten async changes (bounded by the
// decision timeout again), then drops its cached keys.
func (s *shardRunner) drain(ctx context.Context, p int) {
	slot := &s.n.router.slots[p]
	deadline := time.Now().Add(s.n.cfg.DecisionTimeout + 100*time.Millisecond)
	for slot.inflight.Load() > 0 && time.Now().Before(deadline) && ctx.Err() == nil {
		time.Sleep(time.Millisecond)
	}
	s.n.flushPartition(ctx, p, time.Now().Add(s.n.cfg.DecisionTimeout+100*time.Millisecond))
	s.n.dropPartitionKeys(p)
}

// verify reads part.<p> and reports whether it still names this node in
// the epoch it serves. A different entry is fed to the core (which then
// drops the partition) and the slot stops serving at once.
func (s *shardRunner) verify(ctx context.Context, p int) bool {
	e, err := s.kv.Get(ctx, "part."+strconv.Itoa(p))
	if err != nil && !errors.Is(err, jetstream.ErrKeyNotFound) {
		return true // cannot tell: a plain conflict (the CAS still protects the state)
	}
	slot := &s.n.router.slots[p]
	if err == nil && s.namesSelf(e, slot.epoch.Load()) {
		return true
	}
	slot.until.Store(0)
	if e != nil {
		select {
		case s.results <- shardResult{entry: e}:
		default:
		}
	}
	return false
}

// leave makes the node leave the mesh: its heartbeat entry is deleted (the
// other nodes stop assigning partitions to it) and it releases every
// partition gracefully. It returns when it holds none, or when ctx ends.
func (s *shardRunner) leave(ctx context.Context) error {
	if err := s.kv.Delete(ctx, "node."+s.core.self); err != nil {
		s.log.Warn("deleting the heartbeat entry", "error", err.Error())
	}
	select {
	case s.leaveCh <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case <-s.empty:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("mesh: releasing partitions: %w", ctx.Err())
	}
}

// dropPartitionKeys drops the idle cached keys of partition p from the key
// table (a key with a runner still working is left to finish; its next
// write is fenced). It uses keyTable's fields: keys.go has no such hook.
func (n *Node) dropPartitionKeys(p int) {
	t := n.keys
	t.mu.Lock()
	defer t.mu.Unlock()
	for k, e := range t.m {
		if partitionOf(k, n.router.parts) != p {
			continue
		}
		e.mu.Lock()
		if !e.running && e.o.idle() {
			t.removeLocked(k, e)
		}
		e.mu.Unlock()
	}
}
