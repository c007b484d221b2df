package shadow

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/limitmesh/limitmesh/policies"
	"github.com/limitmesh/limitmesh/usage"
)

// BacktestConfig configures [Backtest].
type BacktestConfig struct {
	Prefix string // installation prefix; default "rl"
	// Since replays the messages stored in the last Since (by their
	// stream time); 0 replays everything the stream holds.
	Since   time.Duration
	Options Options          // bounds of the replay (see [Options])
	Clock   func() time.Time // nil: time.Now
	// FetchSize is the number of messages fetched at a time; default 1000.
	FetchSize int
}

// BacktestResult is what [Backtest] found.
type BacktestResult struct {
	// Summary is the policy's summary over the records replayed, as the
	// live evaluator would count them; SinceUs is the t_us of the first
	// record replayed (0 when none was).
	Summary  Summary
	Messages uint64        // usage messages read
	Records  uint64        // records replayed, matched by the policy or not
	Invalid  uint64        // messages skipped because they are not valid usage batches
	FirstSeq uint64        // stream sequence of the first message read (0: none)
	LastSeq  uint64        // stream sequence of the last message read
	Elapsed  time.Duration // wall time of the replay
}

// RecordsPerSec is the replay's rate: records replayed per second of wall
// time.
func (r BacktestResult) RecordsPerSec() float64 {
	if r.Elapsed <= 0 {
		return 0
	}
	return float64(r.Records) / r.Elapsed.Seconds()
}

// Backtest replays the history the usage stream of cfg.Prefix holds (from
// now - cfg.Since, up to its last message when the backtest starts)
// through policy p, offline: with an ephemeral ordered consumer of its
// own, a fresh [Replay] holding p alone, and no write anywhere. p need not
// be in the policy bucket nor be a candidate: it is evaluated as if it
// were, exactly as the live evaluator evaluates a candidate, so over the
// same records it counts the same.
func Backtest(ctx context.Context, js jetstream.JetStream, p *policies.Policy, cfg BacktestConfig) (BacktestResult, error) {
	if cfg.Prefix == "" {
		cfg.Prefix = "rl"
	}
	if cfg.Clock == nil {
		cfg.Clock = time.Now
	}
	if cfg.FetchSize <= 0 {
		cfg.FetchSize = 1000
	}
	var res BacktestResult
	name := usage.StreamName(cfg.Prefix)
	stream, err := js.Stream(ctx, name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return res, fmt.Errorf("stream %s does not exist: start a node first (limitmesh serve)", name)
	} else if err != nil {
		return res, fmt.Errorf("stream %s: %w", name, err)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		return res, fmt.Errorf("stream %s: %w", name, err)
	}
	r := NewReplay(cfg.Options)
	r.SetCandidates([]*policies.Policy{p})
	began := time.Now()
	var firstUs int64 // t_us of the first record replayed
	finish := func() BacktestResult {
		res.Summary, _ = r.Summary(p.Name)
		res.Summary.SinceUs = firstUs
		res.Elapsed = time.Since(began)
		return res
	}
	last := info.State.LastSeq
	if info.State.Msgs == 0 {
		return finish(), nil
	}
	occ := jetstream.OrderedConsumerConfig{DeliverPolicy: jetstream.DeliverAllPolicy}
	if cfg.Since > 0 {
		start := cfg.Clock().Add(-cfg.Since)
		occ = jetstream.OrderedConsumerConfig{DeliverPolicy: jetstream.DeliverByStartTimePolicy, OptStartTime: &start}
	}
	cons, err := stream.OrderedConsumer(ctx, occ)
	if err != nil {
		return res, fmt.Errorf("consumer on %s: %w", name, err)
	}
	if ci, err := cons.Info(ctx); err == nil && ci.NumPending == 0 {
		return finish(), nil // nothing stored since the start
	}
	for {
		fctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		batch, err := cons.Fetch(cfg.FetchSize, jetstream.FetchContext(fctx))
		if err != nil {
			cancel()
			return finish(), fmt.Errorf("fetch from %s: %w", name, err)
		}
		n := 0
		done := false
		for m := range batch.Messages() {
			n++
			meta, err := m.Metadata()
			if err != nil {
				continue
			}
			seq := meta.Sequence.Stream
			if seq > last {
				done = true
				break
			}
			if res.FirstSeq == 0 {
				res.FirstSeq = seq
			}
			res.LastSeq = seq
			res.Messages++
			b, err := usage.DecodeBatch(m.Data())
			if err != nil {
				res.Invalid++
			} else {
				for i := range b.Records {
					rec := &b.Records[i]
					if res.Records == 0 {
						firstUs = rec.TimeUs
					}
					res.Records++
					r.Apply(rec)
				}
			}
			if seq >= last || meta.NumPending == 0 {
				done = true
				break // the fetch in flight is abandoned with the consumer
			}
		}
		cancel()
		if err := batch.Error(); err != nil && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, nats.ErrTimeout) {
			return finish(), fmt.Errorf("fetch from %s: %w", name, err)
		}
		if ctx.Err() != nil {
			return finish(), ctx.Err()
		}
		if done {
			return finish(), nil
		}
		if n == 0 {
			// Nothing within the fetch's wait: finished only if the
			// consumer has nothing left (a slow server may just be late).
			if ci, err := cons.Info(ctx); err == nil && ci.NumPending == 0 {
				return finish(), nil
			}
		}
	}
}
