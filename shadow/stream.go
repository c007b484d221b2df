package shadow

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/limitmesh/limitmesh/usage"
)

// Reading the usage stream: the session's consumer, its reader, and where
// candidates start.

// consume sets up the durable consumer at the sequence after the last one
// applied (the checkpoint's) and starts reading it.
func (s *session) consume(ctx context.Context) (jetstream.MessagesContext, error) {
	name := usage.StreamName(s.e.cfg.Prefix)
	stream, err := s.stream(ctx)
	if err != nil {
		return nil, err
	}
	if info := stream.CachedInfo(); info != nil && s.applied > info.State.LastSeq {
		s.e.log.Warn("shadow: the checkpoint is past the stream's end (stream recreated?); counts start again",
			"checkpoint", s.applied, "last", info.State.LastSeq)
		list := s.p.candidates()
		s.p.setCandidates(nil)
		s.p.setCandidates(list)
		s.applied, s.ckptSeq = 0, 0
	}
	cons, err := stream.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{
		Durable:       usage.ShadowConsumer,
		Description:   "limitmesh shadow evaluator (CONTRACT.md §7)",
		DeliverPolicy: jetstream.DeliverAllPolicy,
		AckPolicy:     jetstream.AckAllPolicy,
		AckWait:       max(30*time.Second, 4*s.e.cfg.CheckpointInterval),
		MaxAckPending: 100_000,
		MaxDeliver:    -1,
	})
	if err != nil {
		return nil, fmt.Errorf("consumer %s: %w", usage.ShadowConsumer, err)
	}
	// Deliver from the message after the checkpoint (or after the ack
	// floor when there is none): what a previous evaluator was delivered
	// but did not checkpoint is delivered again, in order.
	if s.applied > 0 {
		_, err = s.e.js.ResetConsumerToSequence(ctx, name, usage.ShadowConsumer, s.applied+1)
	} else {
		_, err = s.e.js.ResetConsumer(ctx, name, usage.ShadowConsumer)
	}
	if err != nil {
		return nil, fmt.Errorf("reset consumer %s: %w", usage.ShadowConsumer, err)
	}
	s.cons = cons
	return cons.Messages(jetstream.PullMaxMessages(1000))
}

// stream opens the usage stream, waiting for it to exist.
func (s *session) stream(ctx context.Context) (jetstream.Stream, error) {
	name := usage.StreamName(s.e.cfg.Prefix)
	for {
		stream, err := s.e.js.Stream(ctx, name)
		if err == nil {
			return stream, nil
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		if !errors.Is(err, jetstream.ErrStreamNotFound) {
			s.e.log.Debug("shadow: open usage stream", "stream", name, "err", err)
		}
		if !sleepCtx(ctx, 250*time.Millisecond) {
			return nil, ctx.Err()
		}
	}
}

// startReading sets up the consumer (see consume) and a goroutine that
// passes its messages to the loop on s.in; a read error ends it and comes
// on s.readErr.
func (s *session) startReading(ctx context.Context) error {
	it, err := s.consume(ctx)
	if err != nil {
		return err
	}
	msgs, readErr, done := make(chan jetstream.Msg, 256), make(chan error, 1), make(chan struct{})
	go func() {
		defer close(msgs)
		for {
			m, err := it.Next()
			if err != nil {
				readErr <- err
				return
			}
			select {
			case msgs <- m:
			case <-ctx.Done():
				return
			case <-done:
				return
			}
		}
	}()
	s.in, s.readErr = msgs, readErr
	s.stopRead = func() {
		close(done)
		it.Stop()
		for range msgs {
		}
	}
	return nil
}

// stopReading stops the reader, if any. The messages it read and the loop
// did not apply are dropped: s.applied is still the last one applied, and
// the next startReading delivers from the one after it.
func (s *session) stopReading() {
	if s.stopRead == nil {
		return
	}
	s.stopRead()
	s.in, s.readErr, s.stopRead = nil, nil, nil
	s.lagFrom = time.Time{}
}

// resume starts reading the stream for candidates that start from nothing:
// at a term's start without a checkpoint to resume, or when there are
// candidates again after none. (With no candidates the evaluator reads
// nothing, so that the stream costs a node next to nothing until someone
// puts a candidate.) They start at the first record stored at or after
// since, when the earliest of them was put (an evaluator running then
// would have been about there), or after the last one applied if that is
// later.
func (s *session) resume(ctx context.Context, since time.Time) error {
	if !since.IsZero() {
		stream, err := s.stream(ctx)
		if err != nil {
			return err
		}
		seq, err := firstSeqAt(ctx, s.e.js, stream, since)
		if err != nil {
			return fmt.Errorf("position of %v in %s: %w", since, usage.StreamName(s.e.cfg.Prefix), err)
		}
		if seq > s.applied+1 {
			s.e.log.Debug("shadow: candidates after none; evaluating from their put time", "since", since, "seq", seq, "skipped", seq-1-s.applied)
			s.applied, s.dirty = seq-1, true
		}
	}
	return s.startReading(ctx)
}

// firstSeqAt returns the sequence of stream's first message stored at or
// after t (a past instant), or the one the next message will have when
// there is none.
func firstSeqAt(ctx context.Context, js jetstream.JetStream, stream jetstream.Stream, t time.Time) (uint64, error) {
	// The last sequence is read before the message get: when the get
	// finds nothing stored since t, nothing was stored since this read
	// either (it came after t), so last+1 is the next message. Read after
	// the get, it could take in messages stored meanwhile, which would be
	// skipped.
	info, err := stream.Info(ctx)
	if err != nil {
		return 0, err
	}
	req, err := json.Marshal(struct {
		StartTime time.Time `json:"start_time"`
	}{t.UTC()})
	if err != nil {
		return 0, err
	}
	msg, err := js.Conn().RequestWithContext(ctx, apiPrefix(js)+"STREAM.MSG.GET."+stream.CachedInfo().Config.Name, req)
	if err != nil {
		return 0, err
	}
	var resp struct {
		Error *struct {
			ErrCode     int    `json:"err_code"`
			Description string `json:"description"`
		} `json:"error"`
		Message *struct {
			Seq uint64 `json:"seq"`
		} `json:"message"`
	}
	if err := json.Unmarshal(msg.Data, &resp); err != nil {
		return 0, fmt.Errorf("message get: %w", err)
	}
	switch {
	case resp.Error != nil && resp.Error.ErrCode == int(jetstream.JSErrCodeMessageNotFound):
		return info.State.LastSeq + 1, nil
	case resp.Error != nil:
		return 0, fmt.Errorf("message get: %s (%d)", resp.Error.Description, resp.Error.ErrCode)
	case resp.Message == nil:
		return 0, errors.New("message get: no message in the answer")
	}
	return resp.Message.Seq, nil
}

// apiPrefix returns the JetStream API subject prefix js uses.
func apiPrefix(js jetstream.JetStream) string {
	o := js.Options()
	switch {
	case o.Domain != "":
		return "$JS." + o.Domain + ".API."
	case o.APIPrefix != "":
		return strings.TrimSuffix(o.APIPrefix, ".") + "."
	}
	return jetstream.DefaultAPIPrefix
}

// apply applies one message of the stream.
func (s *session) apply(m jetstream.Msg) {
	meta, err := m.Metadata()
	if err != nil {
		return
	}
	seq := meta.Sequence.Stream
	if seq <= s.applied {
		return // applied before the checkpoint this term resumed from, or redelivered
	}
	s.applied, s.lastMsg = seq, m
	if meta.NumPending > 0 {
		s.lagFrom = meta.Timestamp
	} else {
		s.lagFrom = time.Time{}
	}
	b, err := usage.DecodeBatch(m.Data())
	if err != nil {
		s.e.m.invalid.Inc()
		s.e.log.Debug("shadow: invalid usage batch skipped", "seq", seq, "subject", m.Subject(), "err", err)
		return
	}
	s.p.apply(b.Records)
}
