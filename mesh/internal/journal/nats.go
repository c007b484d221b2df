package journal

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
)

// The JetStream side of the journal: the journal stream and the state
// bucket, and opening a node's journal at start.

const expectedSubjSeqHdr = "Nats-Expected-Last-Subject-Sequence"

// StreamName returns the journal stream's name for prefix ("RL_JOURNAL").
func StreamName(prefix string) string { return strings.ToUpper(prefix) + "_JOURNAL" }

// JetStreamStream is Stream over the journal stream. Appends and publishes
// go through the state store's asynchronous publishes (one reply
// subscription for all); reads and purges run on goroutines of their own,
// bounded by their timeout and by the context given to NewJetStreamStream.
type JetStreamStream struct {
	ctx     context.Context
	stream  jetstream.Stream
	name    string
	store   *kvstate.JetStreamStore
	log     *slog.Logger
	timeout time.Duration // bounds each leader read of a range
	// consumerRead streams a long range for readRange; nil:
	// readRangeConsumer (a test substitutes one on a lagging replica).
	consumerRead func(ctx context.Context, subj string, seq, upto uint64, f func(seq uint64, data []byte) error) (next uint64, done bool, err error)
}

// NewJetStreamStream returns the journal stream as a Stream; timeout
// bounds each read request of a range.
func NewJetStreamStream(ctx context.Context, stream jetstream.Stream, store *kvstate.JetStreamStore, timeout time.Duration, log *slog.Logger) *JetStreamStream {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &JetStreamStream{ctx: ctx, stream: stream, name: stream.CachedInfo().Config.Name, store: store, log: log, timeout: timeout}
}

func (s *JetStreamStream) call(timeout time.Duration, f func(ctx context.Context)) {
	go func() {
		ctx, cancel := context.WithTimeout(s.ctx, timeout)
		defer cancel()
		f(ctx)
	}()
}

// Append implements Stream.
func (s *JetStreamStream) Append(subj string, data []byte, last uint64, ttl, timeout time.Duration, done func(uint64, error)) {
	m := &nats.Msg{Subject: subj, Data: data, Header: nats.Header{expectedSubjSeqHdr: []string{strconv.FormatUint(last, 10)}}}
	kvstate.SetTTL(m, ttl)
	s.store.PublishAsync(m, s.name, timeout, done)
}

// Publish implements Stream.
func (s *JetStreamStream) Publish(subj string, data []byte, ttl, timeout time.Duration, done func(uint64, error)) {
	m := &nats.Msg{Subject: subj, Data: data}
	kvstate.SetTTL(m, ttl)
	s.store.PublishAsync(m, s.name, timeout, done)
}

// Last implements Stream.
func (s *JetStreamStream) Last(subj string, timeout time.Duration, done func(uint64, error)) {
	s.call(timeout, func(ctx context.Context) { done(s.last(ctx, subj)) })
}

func (s *JetStreamStream) last(ctx context.Context, subj string) (uint64, error) {
	m, err := s.stream.GetLastMsgForSubject(ctx, subj)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	return m.Sequence, nil
}

// Read implements Stream.
func (s *JetStreamStream) Read(subj string, from, upto uint64, timeout time.Duration, f func(uint64, []byte) error, done func(error)) {
	s.call(timeout, func(ctx context.Context) { done(s.readRange(ctx, subj, from, upto, f)) })
}

// Purge implements Stream.
func (s *JetStreamStream) Purge(subj string, upto uint64, timeout time.Duration, done func(error)) {
	s.call(timeout, func(ctx context.Context) {
		done(s.stream.Purge(ctx, jetstream.WithPurgeSubject(subj), jetstream.WithPurgeSequence(upto)))
	})
}

// JetStreamBucket is Bucket over the state store.
type JetStreamBucket struct {
	*kvstate.JetStreamStore
	bucket string
}

// NewJetStreamBucket returns the state bucket (named bucket, served by
// store) as a Bucket.
func NewJetStreamBucket(store *kvstate.JetStreamStore, bucket string) *JetStreamBucket {
	return &JetStreamBucket{JetStreamStore: store, bucket: bucket}
}

// UpdateAsync implements Bucket.
func (b *JetStreamBucket) UpdateAsync(key string, val []byte, rev uint64, ttl, timeout time.Duration, done func(uint64, error)) {
	b.UpdateAsyncTTL(key, val, rev, ttl, timeout, done)
}

// PutAsync implements Bucket.
func (b *JetStreamBucket) PutAsync(key string, val []byte, ttl, timeout time.Duration, done func(uint64, error)) {
	m := &nats.Msg{Subject: "$KV." + b.bucket + "." + key, Data: val}
	kvstate.SetTTL(m, ttl)
	b.PublishAsync(m, "KV_"+b.bucket, timeout, done)
}

// OpenConfig is what Open needs beyond Config.
type OpenConfig struct {
	Config
	JS       jetstream.JetStream
	Store    *kvstate.JetStreamStore // the state bucket's store
	Bucket   string                  // the state bucket's name
	Replicas int
	// MaxAge is the journal stream's age limit: it is created with it,
	// and an existing stream with a shorter one is widened to it (and to
	// per-message TTLs) when Config.Retention is on (the retention
	// horizon; 0: none).
	MaxAge time.Duration
	Retry  func(ctx context.Context, what string, op func(context.Context) error) error
}

// Open creates the journal stream if needed, reads where this node's
// subject ends and its mark, and returns the node's journal over JetStream
// (ctx bounds the start; bg the journal's own reads). With Retention on,
// the stream allows per-message TTLs and its age limit is at least
// MaxAge: an existing stream is widened to that (never narrowed or
// otherwise changed); on a server without per-message TTLs the journal
// writes none (Retention off).
func Open(ctx, bg context.Context, oc OpenConfig) (*Journal, error) {
	name := StreamName(oc.Prefix)
	if oc.Log == nil {
		oc.Log = slog.New(slog.DiscardHandler)
	}
	var stream jetstream.Stream
	err := oc.Retry(ctx, "stream "+name, func(ctx context.Context) (err error) {
		stream, err = oc.JS.Stream(ctx, name)
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			stream, err = oc.JS.CreateStream(ctx, jetstream.StreamConfig{
				Name:        name,
				Description: "limitmesh state journal",
				Subjects:    []string{Subjects(oc.Prefix) + "*"},
				Storage:     jetstream.FileStorage,
				Replicas:    oc.Replicas,
				MaxAge:      oc.MaxAge,
				Discard:     jetstream.DiscardOld,
				AllowMsgTTL: oc.Retention.On(),
			})
			if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
				stream, err = oc.JS.Stream(ctx, name)
			}
		}
		if err != nil || !oc.Retention.On() {
			return err
		}
		scfg, err := kvstate.EnsureTTLStream(ctx, oc.JS, name, oc.MaxAge)
		if err != nil {
			return err
		}
		if !scfg.AllowMsgTTL {
			oc.Log.Warn("the journal stream does not allow per-message TTLs (nats-server before 2.11): its messages are kept for its age limit",
				"stream", name, "max_age", scfg.MaxAge)
			oc.Retention = keyrec.Retention{}
			return nil
		}
		oc.Retention.Horizon = minAge(oc.Retention.Horizon, scfg.MaxAge)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("mesh: journal stream: %w", err)
	}
	kv, err := oc.JS.KeyValue(ctx, oc.Bucket)
	if err != nil {
		return nil, fmt.Errorf("mesh: state bucket: %w", err)
	}
	cfg := oc.Config
	st := NewJetStreamStream(bg, stream, oc.Store, cfg.Timeout, cfg.Log)
	cfg.Stream = st
	cfg.Bucket = NewJetStreamBucket(oc.Store, oc.Bucket)
	// Floor reads are direct gets: only on a bucket that allows them (a
	// bucket made elsewhere may not; its reads stay leader reads).
	if err := oc.Retry(ctx, "state bucket status", func(ctx context.Context) error {
		status, err := kv.Status(ctx)
		if err != nil {
			return err
		}
		bs, ok := status.(*jetstream.KeyValueBucketStatus)
		cfg.Floors = ok && bs.StreamInfo().Config.AllowDirect
		return nil
	}); err != nil {
		return nil, fmt.Errorf("mesh: state bucket: %w", err)
	}
	// Where this node's subject ends (a node restarted with the same id
	// continues it; what it holds is adopted with the partitions).
	subj := Subjects(cfg.Prefix) + cfg.Self
	if err := oc.Retry(ctx, "journal end", func(ctx context.Context) (err error) {
		cfg.Last, err = st.last(ctx, subj)
		return err
	}); err != nil {
		return nil, fmt.Errorf("mesh: journal: %w", err)
	}
	if mark, err := readMark(ctx, kv, cfg.Self); err == nil {
		cfg.Mark = mark
	}
	return New(cfg), nil
}

// minAge returns the shorter of two age limits (0: none).
func minAge(a, b time.Duration) time.Duration {
	switch {
	case a == 0:
		return b
	case b == 0:
		return a
	}
	return min(a, b)
}

// readMark returns node id's mark from the state bucket kv (0 when it has
// none).
func readMark(ctx context.Context, kv jetstream.KeyValue, id string) (uint64, error) {
	e, err := kv.Get(ctx, markPrefix+id)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	m, err := strconv.ParseUint(string(e.Value()), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%w: journal mark of %s: %q", ErrCorrupt, id, e.Value())
	}
	return m, nil
}

// keyChecksHelp describes limitmesh_journal_key_checks_total.
const keyChecksHelp = "Reads of the state bucket checking that keys new to this node have no record there: " +
	`read="batch" (one floor read of up to 512 keys), read="key" (one leader read of one key).`

// Collectors returns the journal's metrics.
func (j *Journal) Collectors() []prometheus.Collector {
	return []prometheus.Collector{
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "limitmesh_journal_appends_total",
			Help: "Messages this node appended to its state journal (each carries the records of every key changed meanwhile).",
		}, func() float64 { return float64(j.appends.Load()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "limitmesh_journal_records_total",
			Help: "Key records this node committed through its state journal.",
		}, func() float64 { return float64(j.committedRecords.Load()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name:        "limitmesh_journal_key_checks_total",
			Help:        keyChecksHelp,
			ConstLabels: prometheus.Labels{"read": "batch"},
		}, func() float64 { return float64(j.checkReads.Load()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name:        "limitmesh_journal_key_checks_total",
			Help:        keyChecksHelp,
			ConstLabels: prometheus.Labels{"read": "key"},
		}, func() float64 { return float64(j.checkOne.Load()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "limitmesh_checkpoint_writes_total",
			Help: "Journalled key records this node checkpointed to the state bucket.",
		}, func() float64 { return float64(j.checkpoints.Load()) }),
	}
}

// readRangeDirect is how many messages readRange fetches one request at a
// time before it opens a consumer for the rest.
const readRangeDirect = 64

// readRange calls f for each message of subject subj with a sequence in
// [from, upto], in order; upto is a message of subj (a fence, or the
// subject's last message), so a complete read ends on it. A few messages
// are fetched one request each (leader reads); a longer range (a dead
// node's journal since its mark, under load up to tens of thousands of
// messages) through a consumer, which streams them, and leader reads
// again for whatever the consumer did not deliver:
//
//   - the server places the consumer on any replica of the stream, and a
//     lagging follower's consumer reports nothing pending before upto
//     (seen after a network partition healed: reading on from it would
//     miss a hot key's latest records, an overshoot);
//   - a consumer that cannot be made or fetched from (no stream leader, a
//     replica cut off) ends its part of the read early rather than retry;
//     the read as a whole is bounded by ctx. (nats.go's ordered consumer
//     retries its creation without end and without ctx: one adoption's
//     read held the read lock for minutes and no other could start.)
func (s *JetStreamStream) readRange(ctx context.Context, subj string, from, upto uint64, f func(seq uint64, data []byte) error) error {
	seq, done, err := s.readRangeLeader(ctx, subj, from, upto, readRangeDirect, f)
	if done || err != nil {
		return err
	}
	consume := s.consumerRead
	if consume == nil {
		consume = s.readRangeConsumer
	}
	seq, done, err = consume(ctx, subj, seq, upto, f)
	switch {
	case done:
		return nil
	case ctx.Err() != nil:
		return ctx.Err()
	case err != nil && !errors.Is(err, errConsumerRead):
		return err // f failed
	case err != nil:
		s.log.Debug("journal read: consumer failed, reading on from the leader", "subject", subj, "error", err.Error())
	}
	_, _, err = s.readRangeLeader(ctx, subj, seq, upto, -1, f)
	return err
}

// errConsumerRead wraps the failures of readRangeConsumer's consumer
// (rather than of its f).
var errConsumerRead = errors.New("mesh: journal consumer")

// readRangeLeader reads subj's messages in [from, upto] one leader read
// each, at most limit of them (limit < 0: no limit). It returns the next
// sequence to read, and done once it read upto; a read that finds no
// message of subj from there to upto fails with ErrReadIncomplete (a
// stream leader cut off from the others answers until it learns it was
// replaced, with what it had then).
func (s *JetStreamStream) readRangeLeader(ctx context.Context, subj string, from, upto uint64, limit int, f func(seq uint64, data []byte) error) (next uint64, done bool, err error) {
	seq := from
	for n := 0; limit < 0 || n < limit; n++ {
		if seq > upto {
			return seq, true, nil
		}
		// Each read is bounded on its own: one stalled by a stream
		// leader election fails fast, and the adoption is retried.
		rctx, cancel := context.WithTimeout(ctx, s.timeout)
		m, err := s.stream.GetMsg(rctx, seq, jetstream.WithGetMsgSubject(subj))
		cancel()
		if errors.Is(err, jetstream.ErrMsgNotFound) || err == nil && m.Sequence > upto {
			return seq, false, fmt.Errorf("%w: %s has no message from %d to %d", ErrReadIncomplete, subj, seq, upto)
		}
		if err != nil {
			return seq, false, err
		}
		if err := f(m.Sequence, m.Data); err != nil {
			return seq, false, err
		}
		seq = m.Sequence + 1
	}
	return seq, seq > upto, nil
}

// readRangeConsumer streams subj's messages from seq through an ephemeral
// consumer (in memory, one replica, no acknowledgements, deleted when
// done). done is true once it delivered upto; otherwise next is the first
// sequence it did not deliver: its replica had nothing more yet, or the
// consumer failed (err wraps errConsumerRead). Every call is bounded by
// ctx.
func (s *JetStreamStream) readRangeConsumer(ctx context.Context, subj string, seq, upto uint64, f func(seq uint64, data []byte) error) (next uint64, done bool, err error) {
	cctx, cancel := context.WithTimeout(ctx, s.timeout)
	cons, err := s.stream.CreateConsumer(cctx, jetstream.ConsumerConfig{
		FilterSubject:     subj,
		DeliverPolicy:     jetstream.DeliverByStartSequencePolicy,
		OptStartSeq:       seq,
		AckPolicy:         jetstream.AckNonePolicy,
		MemoryStorage:     true,
		Replicas:          1,
		InactiveThreshold: 30 * time.Second,
	})
	cancel()
	if err != nil {
		return seq, false, fmt.Errorf("%w: %w", errConsumerRead, err)
	}
	defer func() {
		name := cons.CachedInfo().Name
		go func() {
			dctx, cancel := context.WithTimeout(context.Background(), s.timeout)
			_ = s.stream.DeleteConsumer(dctx, name)
			cancel()
		}()
	}()
	for {
		got, done, err := s.fetchRange(ctx, cons, &seq, upto, f)
		if done || err != nil {
			return seq, done, err
		}
		if got == 0 {
			return seq, false, nil // this replica has no more (yet)
		}
		if err := ctx.Err(); err != nil {
			return seq, false, err
		}
	}
}

// fetchRange is one fetch of readRangeConsumer (at most a second): it
// calls f for the messages it gets, up to upto, advancing *seq past each,
// and reports how many it got and whether upto was reached.
func (s *JetStreamStream) fetchRange(ctx context.Context, cons jetstream.Consumer, seq *uint64, upto uint64, f func(seq uint64, data []byte) error) (got int, done bool, err error) {
	fctx, cancel := context.WithTimeout(ctx, min(time.Second, s.timeout))
	defer cancel()
	batch, err := cons.Fetch(1024, jetstream.FetchContext(fctx))
	if err != nil {
		return 0, false, fmt.Errorf("%w: %w", errConsumerRead, err)
	}
	for m := range batch.Messages() {
		got++
		meta, err := m.Metadata()
		if err != nil {
			return got, false, fmt.Errorf("%w: %w", errConsumerRead, err)
		}
		s := meta.Sequence.Stream
		if s > upto {
			return got, false, fmt.Errorf("%w: the consumer passed %d at %d", ErrReadIncomplete, upto, s)
		}
		if err := f(s, m.Data()); err != nil {
			return got, false, err
		}
		*seq = s + 1
		if s == upto {
			return got, true, nil
		}
	}
	if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) && !errors.Is(err, context.DeadlineExceeded) {
		return got, false, fmt.Errorf("%w: %w", errConsumerRead, err)
	}
	return got, false, nil
}
