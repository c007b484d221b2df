package shadow

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"regexp"
	"runtime"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/limitmesh/limitmesh/internal/elector"
	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/policies"
	"github.com/limitmesh/limitmesh/usage"
)

// Defaults of [Config].
const (
	DefaultLease              = 3 * time.Second
	DefaultFlushInterval      = time.Second
	DefaultCheckpointInterval = time.Second
	// MaxCheckpointSpacing bounds how long checkpoints that are costly
	// to write are spaced (see Config.CheckpointInterval).
	MaxCheckpointSpacing = 10 * time.Second
	// checkpointCostFactor spaces checkpoints at least this many times
	// as long as the previous one took: checkpointing takes at most
	// about 2% of the evaluator's time.
	checkpointCostFactor = 50
)

// Config configures an [Evaluator].
type Config struct {
	Prefix   string // installation prefix; default "rl"
	NodeID   string // names this node in the lease entry; default random
	Replicas int    // replicas of the buckets the evaluator creates; default 1
	// Registerer gets the evaluator's metrics (limitmesh_shadow_*); nil
	// registers none.
	Registerer prometheus.Registerer
	Logger     *slog.Logger // nil: discard
	// Lease is the elector's lease: a dead evaluator's work moves to
	// another node within about 1.33 lease. Default DefaultLease.
	Lease time.Duration
	// FlushInterval is how often the summaries are written; default (and
	// at most) 1 s.
	FlushInterval time.Duration
	// CheckpointInterval is how often the state is checkpointed (and the
	// stream acknowledged) while checkpoints are cheap; a checkpoint
	// (which holds every key of every candidate) that took d to encode
	// and write delays the next one to at least 50 d after it, up to
	// MaxCheckpointSpacing (or CheckpointInterval when that is longer).
	// A takeover replays about that much of the stream again. Default
	// 1 s.
	CheckpointInterval time.Duration
	// Options bound the evaluation's memory (see [Options]).
	Options Options
	// Workers is the number of goroutines the candidates are evaluated
	// on (each holds some of them; every one reads every record);
	// default runtime.GOMAXPROCS(0).
	Workers int
	// Clock is the wall clock of updated_us and the lag metric; nil:
	// time.Now.
	Clock func() time.Time
}

var prefixRE = regexp.MustCompile(`^[a-z0-9][a-z0-9_-]{0,31}$`)

// Evaluator is the live shadow evaluator of CONTRACT.md §7. Every node
// runs one; an elector (internal/elector, on key leader.shadow of
// <prefix>_shadow) makes one of them active at a time. The active one:
//
//   - follows the candidates: the valid policies with "shadow": true in
//     <prefix>_policies, each at its entry's revision;
//   - restores the last checkpoint and, while there are candidates,
//     consumes <PREFIX>_USAGE with the durable pull consumer
//     usage.ShadowConsumer (acknowledge-all), reset to the sequence after
//     the checkpoint, so every message is applied once: those at or below
//     the checkpoint's sequence are skipped (candidates with nothing to
//     resume start at their put time, see [session.resume]);
//   - applies each valid usage batch's records to its [Replay], in stream
//     order (messages that fail usage.DecodeBatch are skipped and
//     counted);
//   - writes every candidate's [Summary] to <prefix>_shadow every
//     FlushInterval, and deletes the summaries of names that are no
//     longer candidates;
//   - checkpoints the Replay with the last applied sequence every
//     CheckpointInterval (less often when checkpoints are costly), then
//     acknowledges the stream up to it.
//
// A takeover therefore resumes from the last checkpoint: the messages after
// it are applied again by the new evaluator, from the same state, and none
// is lost or counted twice in the summaries once it has caught up.
type Evaluator struct {
	js  jetstream.JetStream
	cfg Config
	log *slog.Logger
	m   *metrics
	// counted is what the metrics include of each candidate's counts,
	// across the terms of this process (one term runs at a time).
	counted map[string]counted
}

// NewEvaluator returns an evaluator of the installation cfg.Prefix on js.
// Errors match [ErrConfig] (a bad prefix or node id, negative intervals)
// or come from registering the metrics.
func NewEvaluator(js jetstream.JetStream, cfg Config) (*Evaluator, error) {
	if cfg.Prefix == "" {
		cfg.Prefix = "rl"
	}
	if !prefixRE.MatchString(cfg.Prefix) {
		return nil, fmt.Errorf("%w: prefix %q", ErrConfig, cfg.Prefix)
	}
	if cfg.NodeID == "" {
		cfg.NodeID = usage.NewBoot()
	}
	if !usage.ValidKVKey(cfg.NodeID) {
		return nil, fmt.Errorf("%w: node id %q", ErrConfig, cfg.NodeID)
	}
	if cfg.Replicas <= 0 {
		cfg.Replicas = 1
	}
	if cfg.Lease < 0 || cfg.FlushInterval < 0 || cfg.CheckpointInterval < 0 {
		return nil, fmt.Errorf("%w: negative duration", ErrConfig)
	}
	if cfg.Lease == 0 {
		cfg.Lease = DefaultLease
	}
	if cfg.FlushInterval == 0 || cfg.FlushInterval > DefaultFlushInterval {
		cfg.FlushInterval = DefaultFlushInterval
	}
	if cfg.CheckpointInterval == 0 {
		cfg.CheckpointInterval = DefaultCheckpointInterval
	}
	if cfg.Clock == nil {
		cfg.Clock = time.Now
	}
	if cfg.Workers <= 0 {
		cfg.Workers = runtime.GOMAXPROCS(0)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	return &Evaluator{js: js, cfg: cfg, log: log.With("component", "shadow"), m: m, counted: map[string]counted{}}, nil
}

// Run takes part in the election until ctx ends, evaluating while this
// node leads. It creates the summary bucket and the state object store when
// missing and waits for the usage stream and the policy bucket to exist.
// It returns nil when ctx ends, or an error when the buckets cannot be set
// up before that.
func (e *Evaluator) Run(ctx context.Context) error {
	var (
		kv  jetstream.KeyValue
		obs jetstream.ObjectStore
		err error
	)
	var leader *kvstate.JetStreamStore
	for {
		kv, obs, err = ensureBuckets(ctx, e.js, e.cfg.Prefix, e.cfg.Replicas)
		if err == nil {
			leader, err = kvstate.NewJetStreamStore(ctx, e.js, Bucket(e.cfg.Prefix))
		}
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			return nil
		}
		e.log.Warn("shadow: buckets not ready; retrying", "err", err)
		if !sleepCtx(ctx, time.Second) {
			return nil
		}
	}
	el := elector.New(kv, LeaderKey, e.cfg.NodeID, e.cfg.Lease, e.log)
	return el.Run(ctx, func(ctx context.Context) error {
		e.m.leader.Set(1)
		defer e.m.leader.Set(0)
		defer e.m.candidates.Set(0)
		return e.lead(ctx, &store{kv: kv, obs: obs, leader: leader})
	})
}

// session is the state of one term as the active evaluator.
type session struct {
	e       *Evaluator
	st      *store
	p       *pool
	cons    jetstream.Consumer
	applied uint64 // last stream sequence applied
	ckptSeq uint64 // sequence of the last checkpoint written
	dirty   bool   // the candidate set changed since the last checkpoint
	// A checkpoint is encoded in the loop and written by a goroutine of
	// its own (one at a time), so the loop goes on applying meanwhile;
	// the write's outcome comes back on written.
	writing bool
	written chan written
	// notBefore is when the next checkpoint may start, after the cost of
	// the last one.
	notBefore time.Time
	buf       []byte // the last checkpoint's buffer, reused
	lastMsg   jetstream.Msg
	lagFrom   time.Time // stream time of the last message applied while more waited
	// The stream's messages while there are candidates (startReading);
	// nil channels while there are none.
	in       <-chan jetstream.Msg
	readErr  <-chan error
	stopRead func()
}

// written is the outcome of one checkpoint write.
type written struct {
	seq     uint64
	msg     jetstream.Msg // the last message it covers, to acknowledge
	buf     []byte
	started time.Time     // when its encoding began
	encoded time.Duration // the encoding's time (the evaluation waits meanwhile)
	took    time.Duration // the write's time
	err     error
}

// lead is the job of the active evaluator.
func (e *Evaluator) lead(ctx context.Context, st *store) error {
	cands := make(chan candidateList, 1)
	wctx, stopWatch := context.WithCancel(ctx)
	watchErr, watchDone := make(chan error, 1), make(chan struct{})
	go func() {
		defer close(watchDone)
		watchErr <- watchCandidates(wctx, e.js, e.cfg.Prefix+"_policies", cands, e.log)
	}()
	defer func() {
		stopWatch()
		<-watchDone
	}()

	s := &session{e: e, st: st, p: newPool(e.cfg.Workers, e.cfg.Options), written: make(chan written, 1)}
	defer s.p.stop()
	var first candidateList
	select {
	case <-ctx.Done():
		return ctx.Err()
	case err := <-watchErr:
		return err
	case first = <-cands:
	}
	s.p.setCandidates(first.list)
	e.m.candidates.Set(float64(len(first.list)))

	fresh, err := s.restore(ctx)
	if err != nil {
		return err
	}
	defer s.stopReading()
	if !s.p.empty() {
		// Candidates with nothing to resume start at their put time, as
		// they would have with an evaluator running then (see resume).
		if fresh {
			err = s.resume(ctx, first.since)
		} else {
			err = s.startReading(ctx)
		}
		if err != nil {
			return err
		}
	}

	flush := time.NewTicker(e.cfg.FlushInterval)
	defer flush.Stop()
	ckpt := time.NewTicker(e.cfg.CheckpointInterval)
	defer ckpt.Stop()
	if err := s.flush(ctx); err != nil {
		return err
	}
	for {
		select {
		case <-ctx.Done():
			s.final()
			return ctx.Err()
		case err := <-watchErr:
			return err
		case err := <-s.readErr:
			if ctx.Err() != nil {
				s.final()
				return ctx.Err()
			}
			return fmt.Errorf("consume %s: %w", usage.StreamName(e.cfg.Prefix), err)
		case m, ok := <-s.in:
			if !ok {
				s.in = nil // the reader ended: its error is on readErr
				continue
			}
			// A change of the candidates that is already waiting takes
			// effect before the message (select picks at random among
			// ready cases).
			select {
			case list := <-cands:
				if err := s.candidatesChanged(ctx, list); err != nil {
					return err
				}
			default:
			}
			if s.in == nil {
				continue // no candidate left: the reader stopped and m is dropped
			}
			s.apply(m)
		case list := <-cands:
			if err := s.candidatesChanged(ctx, list); err != nil {
				return err
			}
		case <-flush.C:
			if err := s.flush(ctx); err != nil {
				return err
			}
		case now := <-ckpt.C:
			if !now.Before(s.notBefore) {
				s.startCheckpoint(ctx)
			}
		case w := <-s.written:
			if err := s.checkpointed(w); err != nil {
				return err
			}
		}
	}
}

// candidatesChanged makes list the candidates, reading the stream again
// when there were none (resume) and no longer when there are none.
func (s *session) candidatesChanged(ctx context.Context, list candidateList) error {
	wasIdle := s.p.empty()
	s.p.setCandidates(list.list)
	s.dirty = true
	s.e.m.candidates.Set(float64(len(list.list)))
	switch {
	case wasIdle && !s.p.empty():
		return s.resume(ctx, list.since)
	case !wasIdle && s.p.empty():
		s.stopReading()
	}
	return nil
}

// restore loads the last checkpoint into the Replay. It reports whether
// the candidates start from nothing: there is no checkpoint to resume, or
// it is one of an evaluator without candidates.
func (s *session) restore(ctx context.Context) (fresh bool, err error) {
	b, err := s.st.load(ctx)
	switch {
	case errors.Is(err, ErrCorrupt) || errors.Is(err, jetstream.ErrObjectNotFound):
		s.e.log.Error("shadow: checkpoint unreadable; counts start again", "err", err)
		return true, nil
	case err != nil:
		return false, err
	case b == nil:
		s.e.log.Info("shadow: no checkpoint; candidates are evaluated from their put time")
		return true, nil
	}
	info, err := s.p.restore(b)
	if err != nil {
		s.e.log.Error("shadow: checkpoint unreadable; counts start again", "err", err)
		return true, nil
	}
	s.applied, s.ckptSeq = info.Seq, info.Seq
	// The metrics count this process's evaluations, once each.
	for _, sum := range s.p.summaries() {
		s.e.counted[sum.Policy] = baseline(s.e.counted[sum.Policy], &sum)
	}
	s.e.log.Info("shadow: restored checkpoint", "seq", info.Seq, "candidates", info.Candidates, "restored", info.Restored)
	return info.Candidates == 0, nil
}

// candidatesOf returns the policies of r's candidates.
func candidatesOf(r *Replay) []*policies.Policy {
	out := make([]*policies.Policy, len(r.cands))
	for i, c := range r.cands {
		out[i] = c.p
	}
	return out
}

// flush writes every candidate's summary and deletes those of names no
// longer candidates; it also updates the metrics. It fails only when
// another evaluator took over (errFenced).
func (s *session) flush(ctx context.Context) error {
	now := s.e.cfg.Clock()
	if s.lagFrom.IsZero() {
		s.e.m.lag.Set(0)
	} else {
		s.e.m.lag.Set(max(0, now.Sub(s.lagFrom).Seconds()))
	}
	wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	current := map[string]bool{}
	for _, sum := range s.p.summaries() {
		current[sum.Policy] = true
		s.e.counted[sum.Policy] = s.e.m.add(s.e.counted[sum.Policy], &sum)
		sum.UpdatedUs = now.UnixMicro()
		v, _ := json.Marshal(sum)
		if err := s.wrote(s.st.putSummary(wctx, sum.Policy, v)); err != nil {
			return err
		}
	}
	for name := range s.st.revs {
		if !current[name] {
			if err := s.wrote(s.st.deleteSummary(wctx, name)); err != nil {
				return err
			}
			delete(s.e.counted, name)
		}
	}
	return nil
}

// wrote passes on errFenced (the term must end) and logs any other write
// error: the next flush writes again.
func (s *session) wrote(err error) error {
	if err == nil || errors.Is(err, errFenced) {
		return err
	}
	s.e.log.Warn("shadow: summary write failed; writing again at the next flush", "err", err)
	return nil
}

// startCheckpoint encodes the state, when anything changed since the last
// checkpoint and no write is in flight, and writes it in the background.
// The store's pointer fields are the writer's alone meanwhile (flush uses
// only the summaries' revisions).
func (s *session) startCheckpoint(ctx context.Context) {
	if s.writing || s.applied == s.ckptSeq && !s.dirty {
		return
	}
	var sums []Summary
	started := time.Now()
	s.buf, sums = s.p.appendCheckpoint(s.buf[:0], s.applied)
	encoded := time.Since(started)
	// The metrics include whatever a checkpoint holds, so that a restore
	// of it in this process does not count its records again.
	for _, sum := range sums {
		s.e.counted[sum.Policy] = s.e.m.add(s.e.counted[sum.Policy], &sum)
	}
	w := written{seq: s.applied, msg: s.lastMsg, buf: s.buf, started: started, encoded: encoded}
	s.writing, s.dirty, s.buf, s.lastMsg = true, false, nil, nil
	go func() {
		began := time.Now()
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		w.err = s.st.checkpoint(wctx, w.buf, w.seq, s.e.cfg.NodeID)
		w.took = time.Since(began)
		s.written <- w
	}()
}

// checkpointed takes the outcome of a checkpoint write: on success the
// stream is acknowledged up to it (acknowledge-all); a failed write is
// tried again at the next tick; a fenced one ends the term.
func (s *session) checkpointed(w written) error {
	s.writing, s.buf = false, w.buf
	switch {
	case errors.Is(w.err, errFenced):
		s.e.m.checkpoints.WithLabelValues("fenced").Inc()
		return w.err
	case w.err != nil:
		s.e.m.checkpoints.WithLabelValues("error").Inc()
		s.e.log.Warn("shadow: checkpoint failed; trying again", "err", w.err)
		s.dirty = true
		if s.lastMsg == nil {
			s.lastMsg = w.msg
		}
		return nil
	}
	s.e.m.checkpoints.WithLabelValues("ok").Inc()
	s.e.m.ckptBytes.Set(float64(len(w.buf)))
	s.ckptSeq = w.seq
	spacing := min(checkpointCostFactor*(w.encoded+w.took), max(MaxCheckpointSpacing, s.e.cfg.CheckpointInterval))
	s.notBefore = w.started.Add(spacing)
	if w.msg != nil {
		w.msg.Ack() // acknowledge-all: everything up to it
	}
	if spacing > s.e.cfg.CheckpointInterval {
		s.e.log.Debug("shadow: costly checkpoint; the next one waits", "bytes", len(w.buf),
			"encoded", w.encoded, "written", w.took, "next_after", spacing)
	}
	return nil
}

// final writes a last checkpoint and summaries when the term ends (with a
// fresh deadline: the term's context is over). A successor that took over
// meanwhile fences these writes.
func (s *session) final() {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	if s.writing {
		select {
		case w := <-s.written:
			if s.checkpointed(w) != nil {
				return
			}
		case <-ctx.Done():
			return
		}
	}
	s.startCheckpoint(ctx)
	if s.writing {
		select {
		case w := <-s.written:
			if s.checkpointed(w) != nil {
				return
			}
		case <-ctx.Done():
			return
		}
	}
	s.flush(ctx)
}
