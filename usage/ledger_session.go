package usage

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/limitmesh/limitmesh/kvstate"
)

// errOutOfOrder ends a session whose deliveries are not in order.
var errOutOfOrder = errors.New("usage: ledger delivery out of order")

// errCrash is the simulated death of crashAfter.
var errCrash = errors.New("usage: simulated crash")

// session is one run of the reconciler from the cursor.
type session struct {
	r       *Reconciler
	core    *ledgerCore
	cons    jetstream.Consumer
	applied uint64 // last stream sequence applied (in memory)
	curRev  uint64 // the cursor entry's revision: the floor of reads
	nextD   uint64 // the next consumer delivery sequence expected

	lastReconcile time.Time
	lastPrune     time.Time
	retention     time.Duration

	// The open group: applied in memory, not yet written.
	replies  []string // the reply subjects of its messages, to acknowledge them
	records  int      // records in it
	started  time.Time
	caughtUp bool // its last message had no message after it
	counted  int
	dup      int
	invalid  int
}

func (r *Reconciler) session(ctx context.Context) error {
	s := &session{r: r, core: newLedgerCore(), nextD: 1, lastReconcile: time.Now(), lastPrune: time.Now()}
	octx, cancel := context.WithTimeout(ctx, r.cfg.OpTimeout)
	defer cancel()
	data, rev, err := r.store.Get(octx, cursorKey)
	var cur cursor
	switch {
	case errors.Is(err, kvstate.ErrNotFound):
		// rev is a delete marker's or 0.
	case err != nil:
		return fmt.Errorf("read cursor: %w", err)
	default:
		if err := json.Unmarshal(data, &cur); err != nil {
			return fmt.Errorf("%w: cursor: %v", ErrCorruptEntry, err)
		}
	}
	// Write the cursor first: its revision is the floor of every read in
	// this session, and a stale holder's later write of it fails.
	if s.curRev, err = s.writeCursor(ctx, cur.Seq, rev); err != nil {
		return err
	}
	s.applied = cur.Seq
	stream, err := r.js.Stream(octx, r.stream)
	if err != nil {
		return fmt.Errorf("usage stream: %w", err)
	}
	info, err := stream.Info(octx)
	if err != nil {
		return fmt.Errorf("usage stream info: %w", err)
	}
	s.retention = info.Config.MaxAge
	if cur.Seq > info.State.LastSeq {
		// The stream was deleted and created again: its sequences restarted
		// below the ledger's, whose entries would skip the new messages.
		r.log.Error("the ledger is ahead of the usage stream (was the stream re-created? delete the ledger bucket with it)",
			"cursor", cur.Seq, "stream_last", info.State.LastSeq)
	}
	s.cons, err = stream.CreateOrUpdateConsumer(octx, jetstream.ConsumerConfig{
		Durable:       LedgerConsumer,
		Description:   "limitmesh usage ledger",
		DeliverPolicy: jetstream.DeliverAllPolicy,
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       time.Minute,
		MaxAckPending: 2*r.cfg.MaxGroup + r.cfg.FetchBatch,
	})
	if err != nil {
		return fmt.Errorf("consumer %s: %w", LedgerConsumer, err)
	}
	if _, err := stream.ResetConsumerToSequence(octx, LedgerConsumer, cur.Seq+1); err != nil {
		return fmt.Errorf("reset consumer %s to %d: %w", LedgerConsumer, cur.Seq+1, err)
	}
	r.log.Info("ledger session started", "from", cur.Seq+1)
	for ctx.Err() == nil {
		msgs, err := s.fetch(ctx)
		if err != nil {
			return err
		}
		if len(msgs) > 0 {
			if err := s.ingest(ctx, msgs); err != nil {
				return err
			}
		}
		if len(s.replies) > 0 && (s.due() || (len(msgs) == 0 || s.caughtUp) && !s.lingers()) {
			if err := s.commit(ctx); err != nil {
				return err
			}
			continue
		}
		if len(msgs) == 0 {
			r.m.lag.Set(0)
			if err := s.idle(ctx); err != nil {
				return err
			}
		}
	}
	return nil
}

// due reports whether the open group must be written now: it holds
// MaxGroup messages or MaxGroupRecords records, or it started
// GroupInterval ago.
func (s *session) due() bool {
	c := &s.r.cfg
	return len(s.replies) >= c.MaxGroup || s.records >= c.MaxGroupRecords || time.Since(s.started) >= c.GroupInterval
}

// lingerEntries is the number of changed totals entries above which an open
// group that caught up with the stream waits for more messages (until it
// is due) rather than being written at once.
const lingerEntries = 256

// lingers reports whether the open group, caught up, waits for more
// messages: it changed more than lingerEntries entries. Each changed entry
// costs one write however many records it took, and under load the same
// keys come back within a group interval, so waiting writes each key once
// per GroupInterval instead of once per publisher interval; a small group
// (a quiet stream) is written at once.
func (s *session) lingers() bool { return len(s.core.dirtyE) > lingerEntries }

// fetch returns the next messages (up to FetchBatch): those available
// now; when there are none, for an open group that lingers, those that
// arrive until it is due; with no group open, the first to arrive within
// idleWait and those available with it.
func (s *session) fetch(ctx context.Context) ([]jetstream.Msg, error) {
	n := min(s.r.cfg.FetchBatch, s.r.cfg.MaxGroup-len(s.replies))
	msgs, err := s.pull(ctx, func() (jetstream.MessageBatch, error) { return s.cons.FetchNoWait(n) })
	if err != nil || len(msgs) > 0 {
		return msgs, err
	}
	if len(s.replies) > 0 {
		due := s.started.Add(s.r.cfg.GroupInterval)
		if !s.lingers() || time.Until(due) < 10*time.Millisecond {
			return nil, nil
		}
		// Until the group is due, or the session ends.
		fctx, cancel := context.WithDeadline(ctx, due)
		defer cancel()
		return s.pull(ctx, func() (jetstream.MessageBatch, error) {
			return s.cons.Fetch(n, jetstream.FetchContext(fctx))
		})
	}
	msgs, err = s.pull(ctx, func() (jetstream.MessageBatch, error) {
		return s.cons.Fetch(1, jetstream.FetchMaxWait(idleWait))
	})
	if err != nil || len(msgs) == 0 || n == 1 {
		return msgs, err
	}
	more, err := s.pull(ctx, func() (jetstream.MessageBatch, error) { return s.cons.FetchNoWait(n - 1) })
	return append(msgs, more...), err
}

func (s *session) pull(ctx context.Context, f func() (jetstream.MessageBatch, error)) ([]jetstream.Msg, error) {
	if ctx.Err() != nil {
		return nil, nil
	}
	b, err := f()
	if err != nil {
		return nil, fmt.Errorf("fetch: %w", err)
	}
	var msgs []jetstream.Msg
	for m := range b.Messages() {
		msgs = append(msgs, m)
	}
	if err := b.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) && !errors.Is(err, context.DeadlineExceeded) {
		if len(msgs) > 0 {
			// What arrived is in order; a lost delivery is seen by its
			// sequence.
			return msgs, nil
		}
		return nil, fmt.Errorf("fetch: %w", err)
	}
	return msgs, nil
}

// item is one fetched message.
type item struct {
	seq   uint64
	batch Batch
	valid bool
}

// ingest applies msgs (in delivery order) to the open group.
func (s *session) ingest(ctx context.Context, msgs []jetstream.Msg) error {
	r := s.r
	items := make([]item, 0, len(msgs))
	minUs := int64(-1)
	for _, m := range msgs {
		meta, err := m.Metadata()
		if err != nil {
			return fmt.Errorf("message metadata: %w", err)
		}
		if meta.Sequence.Consumer != s.nextD {
			return fmt.Errorf("%w: delivery %d, want %d", errOutOfOrder, meta.Sequence.Consumer, s.nextD)
		}
		s.nextD++
		seq := meta.Sequence.Stream
		if seq <= s.applied {
			_ = m.Ack() // applied already (a redelivery after a slow ack)
			continue
		}
		if meta.NumDelivered > 1 {
			return fmt.Errorf("%w: stream sequence %d delivered %d times", errOutOfOrder, seq, meta.NumDelivered)
		}
		s.caughtUp = meta.NumPending == 0
		it := item{seq: seq}
		if policy, ok := PolicyOfSubject(r.cfg.Prefix, m.Subject()); ok {
			b, err := decodeLedger(m.Data())
			switch {
			case err != nil:
				r.log.Debug("invalid usage message skipped", "seq", seq, "subject", m.Subject(), "err", err)
			case b.Policy != policy:
				r.log.Debug("invalid usage message skipped", "seq", seq, "subject", m.Subject(), "err", "policy "+b.Policy+" on another policy's subject")
			default:
				it.batch, it.valid = b, true
				for i := range b.Records {
					if t := b.Records[i].TimeUs; minUs < 0 || t < minUs {
						minUs = t
					}
				}
				for i := range b.Groups {
					if t := b.Groups[i].MinUs; minUs < 0 || t < minUs {
						minUs = t
					}
				}
			}
		} else {
			r.log.Debug("usage message on an unknown subject skipped", "seq", seq, "subject", m.Subject())
		}
		items = append(items, it)
		if len(s.replies) == 0 {
			s.started = time.Now()
		}
		s.replies = append(s.replies, m.Reply())
	}
	if len(items) == 0 {
		return nil
	}
	if minUs >= 0 && s.records == 0 {
		r.m.lag.Set(max(0, time.Since(time.UnixMicro(minUs)).Seconds()))
	}
	if err := s.load(ctx, items); err != nil {
		return err
	}
	for i := range items {
		if !items[i].valid {
			s.invalid++
			continue
		}
		c, d := s.core.apply(items[i].seq, &items[i].batch)
		s.counted += c
		s.dup += d
		s.records += items[i].batch.Len()
	}
	s.applied = items[len(items)-1].seq
	return nil
}

// commit writes the open group to the ledger and acknowledges its
// messages.
func (s *session) commit(ctx context.Context) error {
	r := s.r
	tFlush := time.Now()
	nE, nO := len(s.core.dirtyE), len(s.core.dirtyO)
	if err := s.flush(ctx); err != nil {
		return err
	}
	r.log.Debug("ledger group written", "messages", len(s.replies), "records", s.records,
		"entries", nE, "watermarks", nO, "took", time.Since(tFlush), "applied", s.applied)
	nc := r.js.Conn()
	for _, reply := range s.replies {
		if reply != "" {
			_ = nc.Publish(reply, ackBody)
		}
	}
	r.m.counted.Add(float64(s.counted))
	r.m.duplicate.Add(float64(s.dup))
	r.m.invalid.Add(float64(s.invalid))
	if s.caughtUp {
		r.m.lag.Set(0)
	}
	s.replies, s.records, s.counted, s.dup, s.invalid = s.replies[:0], 0, 0, 0, 0
	s.track()
	if len(s.core.entries) > r.cfg.MaxCachedEntries {
		s.core.entries = make(map[entryID]*ledgerEntry)
	}
	return nil
}

// ackBody acknowledges a JetStream message (what Msg.Ack sends).
var ackBody = []byte("+ACK")

// load reads the entries and watermarks the valid items need that the
// core does not hold.
func (s *session) load(ctx context.Context, items []item) error {
	entries := map[string]entryID{}
	origins := map[string]string{}
	for i := range items {
		if !items[i].valid {
			continue
		}
		s.core.missing(&items[i].batch,
			func(id entryID) { entries[TotalsKey(id.policy, id.period, id.key)] = id },
			func(o string) { origins[marksKey(o)] = o })
	}
	return s.loadKeys(ctx, entries, origins)
}

// loadKeys reads the given totals entries (by KV key) and origins'
// watermarks into the core.
func (s *session) loadKeys(ctx context.Context, entries map[string]entryID, origins map[string]string) error {
	if len(entries)+len(origins) == 0 {
		return nil
	}
	keys := make([]string, 0, len(entries)+len(origins))
	for k := range entries {
		keys = append(keys, k)
	}
	for k := range origins {
		keys = append(keys, k)
	}
	recs, err := s.getMany(ctx, keys)
	if err != nil {
		return err
	}
	for i, k := range keys {
		rec := recs[i]
		if id, ok := entries[k]; ok {
			var t Totals
			if rec.Live {
				if t, err = ParseTotals(rec.Value); err != nil {
					s.r.m.corrupt.Inc()
					s.r.log.Error("corrupt ledger entry: counting it again from zero", "key", k, "err", err)
					t = Totals{}
				}
			}
			s.core.hold(id, rec.Rev, t)
			continue
		}
		o := origins[k]
		var m *marks
		if rec.Live {
			if m, err = parseMarks(rec.Value); err != nil {
				s.r.m.corrupt.Inc()
				s.r.log.Error("corrupt ledger watermark: starting it again", "key", k, "err", err)
				m = nil
			}
		}
		s.core.holdOrigin(o, rec.Rev, m)
	}
	return nil
}

// getMany reads keys (any number) with direct gets of up to
// kvstate.MaxManyKeys keys each, all in flight at once, from replicas
// holding the bucket at least up to the cursor's last write. A replica
// behind is asked again a few times.
func (s *session) getMany(ctx context.Context, keys []string) ([]kvstate.KeyRecord, error) {
	out := make([]kvstate.KeyRecord, len(keys))
	for attempt := 0; ; attempt++ {
		var (
			wg    sync.WaitGroup
			mu    sync.Mutex
			first error
		)
		for lo := 0; lo < len(keys); lo += kvstate.MaxManyKeys {
			hi := min(lo+kvstate.MaxManyKeys, len(keys))
			wg.Add(1)
			s.r.store.GetManyAsyncFloor(keys[lo:hi], cursorKey, s.curRev, s.r.cfg.OpTimeout, func(recs []kvstate.KeyRecord, err error) {
				defer wg.Done()
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					if first == nil {
						first = err
					}
					return
				}
				copy(out[lo:hi], recs)
			})
		}
		wg.Wait()
		if first == nil {
			return out, nil
		}
		if !errors.Is(first, kvstate.ErrStale) || attempt >= 5 || ctx.Err() != nil {
			return nil, fmt.Errorf("read ledger entries: %w", first)
		}
		time.Sleep(20 * time.Millisecond << attempt)
	}
}

// flush writes every changed totals entry, then every changed watermark,
// then the cursor; all compare-and-swap.
func (s *session) flush(ctx context.Context) error {
	c := s.core
	ents := c.dirtyE
	if s.r.crashAfter >= 0 && s.r.crashAfter < len(ents) {
		ents = ents[:s.r.crashAfter]
	}
	vals := make([][]byte, len(ents))
	keys := make([]string, len(ents))
	revs := make([]*uint64, len(ents))
	for i, e := range ents {
		e.settle()
		v, err := e.t.MarshalJSON()
		if err != nil {
			return err
		}
		vals[i], keys[i], revs[i] = v, e.kvKey, &e.rev
	}
	if err := s.updateAll(keys, vals, revs); err != nil {
		return err
	}
	if len(ents) < len(c.dirtyE) {
		return errCrash
	}
	keys, vals, revs = keys[:0], vals[:0], revs[:0]
	for _, o := range c.dirtyO {
		v, err := o.m.encode()
		if err != nil {
			return err
		}
		keys, vals, revs = append(keys, o.kvKey), append(vals, v), append(revs, &o.rev)
	}
	if err := s.updateAll(keys, vals, revs); err != nil {
		return err
	}
	rev, err := s.writeCursor(ctx, s.applied, s.curRev)
	if err != nil {
		return err
	}
	s.curRev = rev
	c.written()
	return nil
}

// updateAll writes vals to keys, each with compare-and-swap on *revs[i],
// all in flight at once, and sets *revs[i] to the new revisions. The
// first failure is returned (a conflict wraps kvstate.ErrConflict).
func (s *session) updateAll(keys []string, vals [][]byte, revs []*uint64) error {
	if len(keys) == 0 {
		return nil
	}
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
	)
	wg.Add(len(keys))
	for i := range keys {
		s.r.store.UpdateAsync(keys[i], vals[i], *revs[i], s.r.cfg.OpTimeout, func(rev uint64, err error) {
			defer wg.Done()
			if err != nil {
				mu.Lock()
				if first == nil {
					first = err
				}
				mu.Unlock()
				return
			}
			*revs[i] = rev
		})
	}
	wg.Wait()
	if first != nil {
		return fmt.Errorf("write ledger: %w", first)
	}
	return nil
}

// writeCursor writes the cursor (seq) with compare-and-swap on rev and
// returns its new revision.
func (s *session) writeCursor(ctx context.Context, seq, rev uint64) (uint64, error) {
	v, _ := json.Marshal(cursor{Seq: seq, TUs: time.Now().UnixMicro(), Node: s.r.cfg.Node})
	done := make(chan struct{})
	var (
		newRev uint64
		err    error
	)
	s.r.store.UpdateAsync(cursorKey, v, rev, s.r.cfg.OpTimeout, func(r uint64, e error) {
		newRev, err = r, e
		close(done)
	})
	select {
	case <-done:
	case <-ctx.Done():
		return 0, ctx.Err()
	}
	if err != nil {
		return 0, fmt.Errorf("write cursor: %w", err)
	}
	return newRev, nil
}

// track moves the keys the last group touched to the reconciliation list.
func (s *session) track() {
	r := s.r
	if r.cfg.QuotaLimits == nil || r.cfg.QuotaState == nil {
		s.core.takeTouched()
		return
	}
	now := time.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	for pk, us := range s.core.takeTouched() {
		tk := r.tracked[pk]
		if tk == nil {
			if len(r.tracked) >= maxTracked {
				continue
			}
			// The key's strings may share a usage message (takeTouched's
			// keys are those of the last record applied), which a
			// tracked key, kept for as long as an hour, must not keep.
			tk = &trackedKey{}
			r.tracked[policyKey{strings.Clone(pk.policy), strings.Clone(pk.key)}] = tk
		}
		tk.lastUs = max(tk.lastUs, us)
		tk.appliedAt = now
	}
}

// maxTracked bounds the keys awaiting comparison.
const maxTracked = 100_000

// idle runs the periodic work of a caught-up session.
func (s *session) idle(ctx context.Context) error {
	now := time.Now()
	if now.Sub(s.lastReconcile) >= s.r.cfg.ReconcileInterval {
		s.lastReconcile = now
		if err := s.reconcile(ctx); err != nil {
			return err
		}
	}
	if s.retention > 0 && now.Sub(s.lastPrune) >= s.r.cfg.PruneInterval {
		s.lastPrune = now
		s.prune(ctx)
	}
	return nil
}
