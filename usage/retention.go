package usage

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
)

// Retention headroom (CONTRACT.md §6): the usage stream discards its oldest
// messages once it reaches its max age or max bytes, whether or not the
// ledger and the shadow evaluator have read them. A consumer whose first
// unread message is near the oldest the stream holds is about to lose
// records it has not counted; the reconciler checks both consumers
// periodically and warns before that happens.

// RetentionInput is what a retention check reads: the usage stream's state
// and limits, and one consumer's position in it.
type RetentionInput struct {
	Now time.Time

	// The stream: its first and last sequence, messages and bytes held,
	// and the times of its first and last message.
	FirstSeq, LastSeq   uint64
	Msgs, Bytes         uint64
	FirstTime, LastTime time.Time
	// Its limits; 0 (or negative) for none.
	MaxAge   time.Duration
	MaxBytes int64
	MaxMsgs  int64

	// Next is the stream sequence of the consumer's first unread message
	// (the one after its acknowledgement floor), NextTime the time the
	// stream stored it (zero when unknown: it is then estimated from the
	// stream's rate).
	Next     uint64
	NextTime time.Time
}

// Retention is how close a consumer is to losing unread records.
type Retention struct {
	// Window is how long the stream holds a message at its current rate
	// of messages and its limits (min of max age and capacity / rate);
	// +Inf when no limit bounds it (or the rate is unknown and there is no
	// max age).
	Window float64 // seconds
	// Headroom is how long until the consumer's first unread message is
	// discarded if it reads nothing more and the stream keeps its rate:
	// Window when it has nothing unread, 0 once unread messages were
	// discarded.
	Headroom float64 // seconds
	// Lost is the number of messages the stream discarded before the
	// consumer read them: its first unread message is older than the
	// stream's first.
	Lost uint64
}

// NearFraction is the share of the stream's window below which a
// consumer's headroom is reported: the consumer's first unread message is
// within the oldest tenth of what the stream holds at its limits.
const NearFraction = 0.1

// Near reports whether the consumer has lost messages or its headroom is
// below NearFraction of the window.
func (r Retention) Near() bool {
	return r.Lost > 0 || r.Headroom < NearFraction*r.Window
}

// CheckRetention computes a consumer's retention headroom from in,
// without I/O. The stream's rate is its messages per second between its
// first and last message; its capacity in messages is the least of max
// msgs and max bytes / the mean message size. The first unread message is
// discarded when the messages before it are gone and the stream is full
// (by count or bytes), or when it reaches max age, whichever comes first.
func CheckRetention(in RetentionInput) Retention {
	inf := math.Inf(1)
	rate := 0.0 // messages per second
	if span := in.LastTime.Sub(in.FirstTime).Seconds(); span > 0 && in.LastSeq > in.FirstSeq {
		rate = float64(in.LastSeq-in.FirstSeq) / span
	}
	capMsgs := inf
	if in.MaxMsgs > 0 {
		capMsgs = float64(in.MaxMsgs)
	}
	if in.MaxBytes > 0 && in.Msgs > 0 && in.Bytes > 0 {
		capMsgs = min(capMsgs, float64(in.MaxBytes)/(float64(in.Bytes)/float64(in.Msgs)))
	}
	maxAge := inf
	if in.MaxAge > 0 {
		maxAge = in.MaxAge.Seconds()
	}
	window := maxAge
	if rate > 0 {
		window = min(window, capMsgs/rate)
	}
	switch {
	case in.Msgs == 0 || in.Next > in.LastSeq:
		return Retention{Window: window, Headroom: window}
	case in.Next < in.FirstSeq:
		return Retention{Window: window, Lost: in.FirstSeq - in.Next}
	}
	// By size: the messages before it go first, then the room left.
	bySize := inf
	if rate > 0 {
		older := float64(in.Next - in.FirstSeq)
		room := max(0, capMsgs-float64(in.Msgs))
		bySize = (older + room) / rate
	}
	// By age.
	byAge := inf
	if in.MaxAge > 0 {
		at := in.NextTime
		if at.IsZero() {
			at = in.FirstTime
			if rate > 0 {
				at = at.Add(time.Duration(float64(in.Next-in.FirstSeq) / rate * float64(time.Second)))
			}
		}
		byAge = maxAge - in.Now.Sub(at).Seconds()
	}
	return Retention{Window: window, Headroom: max(0, min(bySize, byAge))}
}

// ErrConsumerIdle is returned by [MeasureRetention] for a consumer that
// nothing reads: it has no pull request waiting and no message delivered
// and unacknowledged.
var ErrConsumerIdle = errors.New("usage: consumer idle")

// MeasureRetention reads the usage stream of prefix and its durable
// consumer name at now, and returns the consumer's retention headroom
// ([CheckRetention]). A missing consumer has read nothing (its first
// unread message is the stream's first). With skipIdle, a consumer that
// nothing reads is not measured: the error wraps [ErrConsumerIdle] (the
// shadow evaluator reads nothing while there are no candidates, and its
// candidates start at their put time, not at its old position).
//
// It errors (wrapping jetstream.ErrStreamNotFound) when the stream does not
// exist, and with the error of a failed request.
func MeasureRetention(ctx context.Context, js jetstream.JetStream, prefix, name string, now time.Time, skipIdle bool) (Retention, error) {
	if prefix == "" {
		prefix = "rl"
	}
	s, err := js.Stream(ctx, StreamName(prefix))
	if err != nil {
		return Retention{}, fmt.Errorf("usage: stream %s: %w", StreamName(prefix), err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return Retention{}, fmt.Errorf("usage: stream %s: %w", StreamName(prefix), err)
	}
	st, cfg := info.State, info.Config
	in := RetentionInput{
		Now: now, FirstSeq: st.FirstSeq, LastSeq: st.LastSeq, Msgs: st.Msgs, Bytes: st.Bytes,
		FirstTime: st.FirstTime, LastTime: st.LastTime,
		MaxAge: cfg.MaxAge, MaxBytes: cfg.MaxBytes, MaxMsgs: cfg.MaxMsgs,
		Next: max(st.FirstSeq, 1),
	}
	c, err := s.Consumer(ctx, name)
	switch {
	case errors.Is(err, jetstream.ErrConsumerNotFound):
		if skipIdle {
			return Retention{}, fmt.Errorf("%w: %s does not exist", ErrConsumerIdle, name)
		}
	case err != nil:
		return Retention{}, fmt.Errorf("usage: consumer %s: %w", name, err)
	default:
		ci, err := c.Info(ctx)
		if err != nil {
			return Retention{}, fmt.Errorf("usage: consumer %s: %w", name, err)
		}
		if skipIdle && ci.NumWaiting == 0 && ci.NumAckPending == 0 {
			return Retention{}, fmt.Errorf("%w: %s", ErrConsumerIdle, name)
		}
		in.Next = ci.AckFloor.Stream + 1
	}
	if in.Msgs > 0 && in.Next >= in.FirstSeq && in.Next <= in.LastSeq && in.MaxAge > 0 {
		m, err := s.GetMsg(ctx, in.Next)
		switch {
		case err == nil:
			in.NextTime = m.Time
		case errors.Is(err, jetstream.ErrMsgNotFound):
			// Removed meanwhile: its time is estimated from the rate.
		default:
			return Retention{}, fmt.Errorf("usage: stream %s message %d: %w", StreamName(prefix), in.Next, err)
		}
	}
	return CheckRetention(in), nil
}

// DefaultRetentionInterval is how often the active reconciler checks the
// consumers' retention headroom.
const DefaultRetentionInterval = 15 * time.Second

// retentionWarnEvery is the least time between two warnings about one
// consumer while it stays near the stream's oldest records.
const retentionWarnEvery = time.Minute

// retentionMetrics are the metrics of the retention check, labelled by
// consumer (its durable name).
type retentionMetrics struct {
	headroom *prometheus.GaugeVec
	warnings *prometheus.CounterVec
}

func newRetentionMetrics() *retentionMetrics {
	return &retentionMetrics{
		headroom: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "limitmesh_usage_retention_headroom_seconds",
			Help: "Estimated time until the usage stream's limits discard the consumer's oldest unread message if it reads nothing more (the stream's window when caught up; 0 once unread messages were discarded; reported by the active reconciler).",
		}, []string{"consumer"}),
		warnings: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limitmesh_usage_retention_warnings_total",
			Help: "Retention checks that found the consumer's unread messages within the oldest tenth of what the usage stream holds, or already discarded.",
		}, []string{"consumer"}),
	}
}

func (m *retentionMetrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.headroom, m.warnings}
}

// retentionWatch checks the retention headroom of the ledger's and the
// shadow evaluator's consumers (the evaluator's only while it reads).
type retentionWatch struct {
	js     jetstream.JetStream
	prefix string
	m      *retentionMetrics
	log    *slog.Logger
	warned map[string]time.Time // consumer: when it was last warned about
}

// watchedConsumers are the consumers a retentionWatch checks, and whether
// each is skipped while idle.
var watchedConsumers = []struct {
	name     string
	skipIdle bool
}{{LedgerConsumer, false}, {ShadowConsumer, true}}

func newRetentionWatch(js jetstream.JetStream, prefix string, m *retentionMetrics, log *slog.Logger) *retentionWatch {
	return &retentionWatch{js: js, prefix: prefix, m: m, log: log, warned: map[string]time.Time{}}
}

// run checks every interval until ctx ends, then removes its gauges (a
// node that stops checking reports nothing).
func (w *retentionWatch) run(ctx context.Context, interval, opTimeout time.Duration) {
	defer w.m.headroom.Reset()
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		cctx, cancel := context.WithTimeout(ctx, opTimeout)
		w.check(cctx, time.Now())
		cancel()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// check measures each consumer once, sets its gauge and warns when it is
// near the stream's oldest messages.
func (w *retentionWatch) check(ctx context.Context, now time.Time) {
	for _, c := range watchedConsumers {
		r, err := MeasureRetention(ctx, w.js, w.prefix, c.name, now, c.skipIdle)
		if err != nil {
			w.m.headroom.DeleteLabelValues(c.name)
			if !errors.Is(err, ErrConsumerIdle) && !errors.Is(err, jetstream.ErrStreamNotFound) && ctx.Err() == nil {
				w.log.Debug("usage retention not measured", "consumer", c.name, "err", err)
			}
			continue
		}
		w.m.headroom.WithLabelValues(c.name).Set(r.Headroom)
		if !r.Near() {
			delete(w.warned, c.name)
			continue
		}
		w.m.warnings.WithLabelValues(c.name).Inc()
		if last, ok := w.warned[c.name]; ok && now.Sub(last) < retentionWarnEvery {
			continue
		}
		w.warned[c.name] = now
		stream := StreamName(w.prefix)
		if r.Lost > 0 {
			w.log.Warn("the usage stream discarded messages its consumer had not read: their records are not counted",
				"consumer", c.name, "stream", stream, "lost_messages", r.Lost)
			continue
		}
		w.log.Warn("a usage consumer's unread records are near the oldest the stream holds: raise --usage-max-bytes or --usage-retention, or find why it lags",
			"consumer", c.name, "stream", stream, "headroom", secondsDuration(r.Headroom).String(),
			"window", secondsDuration(r.Window).String())
	}
}

// secondsDuration converts seconds to a Duration, rounded to the second
// (saturating: +Inf is the largest Duration).
func secondsDuration(s float64) time.Duration {
	if s >= math.MaxInt64/float64(time.Second) {
		return time.Duration(math.MaxInt64)
	}
	return time.Duration(math.Round(s)) * time.Second
}
