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

// Defaults of [BacktestConfig].
const (
	DefaultBacktestPatience = time.Minute
	DefaultBacktestWait     = 5 * time.Second
	// BacktestRequestTimeout bounds each request of a backtest to the
	// server; one that times out is made again (see
	// BacktestConfig.Patience).
	BacktestRequestTimeout = 5 * time.Second
)

// BacktestConfig configures [Backtest].
type BacktestConfig struct {
	Prefix string // installation prefix; default "rl"
	// Since replays the messages stored in the last Since (by their
	// stream time); 0 replays everything the stream holds.
	Since   time.Duration
	Options Options          // bounds of the replay (see [Options])
	Clock   func() time.Time // nil: time.Now
	// FetchSize is the most messages the consumer asks the server for at a
	// time; default 1000.
	FetchSize int
	// Wait is how long the backtest waits for the next message before it
	// asks the stream whether anything is left to read; default
	// DefaultBacktestWait. After three such waits in a row with something
	// left, it reads on with a new consumer.
	Wait time.Duration
	// Patience is how long the backtest goes on while the stream does not
	// answer (each request bounded by BacktestRequestTimeout or Patience,
	// whichever is shorter) before it
	// gives up; default DefaultBacktestPatience. While the stream answers,
	// the backtest never gives up: it ends when it has read everything up
	// to the stream's last message at its start, or when ctx ends.
	Patience time.Duration
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
//
// The end is the stream's last sequence when the backtest starts: the
// backtest returns once it has read the message there, or once the stream
// holds nothing after the last message read up to there (messages removed
// by the stream's limits meanwhile). A slow server delays it, never ends
// it: a request that times out is made again, and a consumer that fails
// is created again after the last message read, for as long as the stream
// answers within cfg.Patience. Errors: the stream does not exist, it did
// not answer for cfg.Patience, or ctx ended (the result then holds what
// was replayed so far).
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
	if cfg.Wait <= 0 {
		cfg.Wait = DefaultBacktestWait
	}
	if cfg.Patience <= 0 {
		cfg.Patience = DefaultBacktestPatience
	}
	b := &backtest{js: js, cfg: cfg, name: usage.StreamName(cfg.Prefix), r: NewReplay(cfg.Options), began: time.Now()}
	b.r.SetCandidates([]*policies.Policy{p})
	finish := func(err error) (BacktestResult, error) {
		b.res.Summary, _ = b.r.Summary(p.Name)
		b.res.Summary.SinceUs = b.firstUs
		b.res.Elapsed = time.Since(b.began)
		return b.res, err
	}
	var info *jetstream.StreamInfo
	err := b.retry(ctx, func(ctx context.Context) error {
		s, err := js.Stream(ctx, b.name)
		if err != nil {
			return err
		}
		b.stream = s
		info, err = s.Info(ctx)
		return err
	})
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return finish(fmt.Errorf("stream %s does not exist: start a node first (limitmesh serve)", b.name))
	} else if err != nil {
		return finish(err)
	}
	if info.State.Msgs == 0 {
		return finish(nil)
	}
	b.last = info.State.LastSeq
	return finish(b.run(ctx))
}

// backtest is one run of [Backtest].
type backtest struct {
	js      jetstream.JetStream
	cfg     BacktestConfig
	name    string // the stream's
	stream  jetstream.Stream
	last    uint64 // the stream's last sequence at the start: the end
	r       *Replay
	res     BacktestResult
	firstUs int64 // t_us of the first record replayed
	began   time.Time
	failed  error // why the last consumer was given up
}

// errNoAnswer reports that the stream did not answer for cfg.Patience.
var errNoAnswer = errors.New("no answer")

// retry runs op (each attempt bounded by BacktestRequestTimeout) until it succeeds, fails
// with an error that is no timeout, or the stream has not answered for
// cfg.Patience.
func (b *backtest) retry(ctx context.Context, op func(ctx context.Context) error) error {
	deadline := time.Now().Add(b.cfg.Patience)
	for {
		octx, cancel := context.WithTimeout(ctx, min(BacktestRequestTimeout, b.cfg.Patience))
		err := op(octx)
		cancel()
		switch {
		case err == nil:
			return nil
		case ctx.Err() != nil:
			return ctx.Err()
		case !noAnswer(err):
			return fmt.Errorf("stream %s: %w", b.name, err)
		case time.Now().After(deadline):
			return fmt.Errorf("stream %s: %w for %v: %v", b.name, errNoAnswer, b.cfg.Patience, err)
		}
		if !sleepCtx(ctx, 100*time.Millisecond) {
			return ctx.Err()
		}
	}
}

// noAnswer reports whether err means that a request got no answer in time
// (as opposed to an answer that is an error).
func noAnswer(err error) bool {
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, nats.ErrTimeout) ||
		errors.Is(err, nats.ErrNoResponders) || errors.Is(err, jetstream.ErrNoStreamResponse) ||
		errors.Is(err, nats.ErrConnectionClosed) || errors.Is(err, nats.ErrConnectionReconnecting) ||
		errors.Is(err, nats.ErrDisconnected)
}

// run reads the stream from the start (by time, or everything) to b.last,
// with one ordered consumer as long as it works, and another one from the
// message after the last read when it fails. Consumers that fail before
// delivering anything are replaced with a growing pause, and for at most
// cfg.Patience in a row.
func (b *backtest) run(ctx context.Context) error {
	var failing time.Time // since when consumers fail without progress
	pause := 50 * time.Millisecond
	for {
		occ := jetstream.OrderedConsumerConfig{DeliverPolicy: jetstream.DeliverAllPolicy, MaxResetAttempts: 5}
		switch {
		case b.res.LastSeq > 0:
			occ.DeliverPolicy, occ.OptStartSeq = jetstream.DeliverByStartSequencePolicy, b.res.LastSeq+1
		case b.cfg.Since > 0:
			start := b.cfg.Clock().Add(-b.cfg.Since)
			occ.DeliverPolicy, occ.OptStartTime = jetstream.DeliverByStartTimePolicy, &start
		}
		var cons jetstream.Consumer
		var pending uint64
		err := b.retry(ctx, func(ctx context.Context) error {
			c, err := b.stream.OrderedConsumer(ctx, occ)
			if err != nil {
				return err
			}
			ci := c.CachedInfo() // as created
			if ci == nil {
				if ci, err = c.Info(ctx); err != nil {
					return err
				}
			}
			cons, pending = c, ci.NumPending
			return nil
		})
		if err != nil {
			return fmt.Errorf("consumer on %s: %w", b.name, err)
		}
		if pending == 0 {
			return nil // nothing stored since the start, or after the last message read
		}
		from := b.res.LastSeq
		done, stalled, err := b.read(ctx, cons)
		switch {
		case done || err != nil:
			return err
		case b.res.LastSeq != from || stalled: // waited long enough already
			failing, pause = time.Time{}, 50*time.Millisecond
			continue
		case failing.IsZero():
			failing = time.Now()
		case time.Since(failing) > b.cfg.Patience:
			return fmt.Errorf("consumer on %s: delivered nothing for %v: %v", b.name, b.cfg.Patience, b.failed)
		}
		if !sleepCtx(ctx, pause) {
			return ctx.Err()
		}
		pause = min(2*pause, 2*time.Second)
	}
}

// read replays what cons delivers until the end (done), or until the
// consumer fails or stalls (it delivered nothing for three waits while
// something is left): then, not done and no error, the caller creates
// another.
func (b *backtest) read(ctx context.Context, cons jetstream.Consumer) (done, stalled bool, err error) {
	it, err := cons.Messages(jetstream.PullMaxMessages(b.cfg.FetchSize))
	if err != nil {
		b.failed = err
		return false, false, nil
	}
	stopped := make(chan struct{})
	defer close(stopped)
	go func() { // a reset in progress within Next ends with the iterator
		select {
		case <-ctx.Done():
			it.Stop()
		case <-stopped:
			it.Stop()
		}
	}()
	stalls := 0
	for {
		m, err := it.Next(jetstream.NextMaxWait(b.cfg.Wait))
		switch {
		case ctx.Err() != nil:
			return true, false, ctx.Err()
		case errors.Is(err, nats.ErrTimeout) || errors.Is(err, context.DeadlineExceeded):
			// Nothing for a while: finished if nothing is left up to the
			// end; else wait on, and after a few waits take a new
			// consumer (this one may be stuck on a server that lost it).
			left, err := b.left(ctx)
			if err != nil {
				return true, false, err
			}
			if !left {
				return true, false, nil
			}
			if stalls++; stalls >= 3 {
				return false, true, nil
			}
			continue
		case err != nil:
			b.failed = err
			return false, false, nil // the consumer failed: another one resumes
		}
		stalls = 0
		if b.apply(m) {
			return true, false, nil
		}
	}
}

// apply replays one message and reports whether it is the end.
func (b *backtest) apply(m jetstream.Msg) bool {
	meta, err := m.Metadata()
	if err != nil {
		return false
	}
	seq := meta.Sequence.Stream
	if seq <= b.res.LastSeq {
		return false // read before (a consumer created again)
	}
	if seq > b.last {
		return true
	}
	if b.res.FirstSeq == 0 {
		b.res.FirstSeq = seq
	}
	b.res.LastSeq = seq
	b.res.Messages++
	batch, err := usage.DecodeBatch(m.Data())
	if err != nil {
		b.res.Invalid++
	} else {
		for i := range batch.Records {
			rec := &batch.Records[i]
			if b.res.Records == 0 {
				b.firstUs = rec.TimeUs
			}
			b.res.Records++
			b.r.Apply(rec)
		}
	}
	return seq >= b.last || meta.NumPending == 0
}

// left reports whether the stream still holds a message after the last
// one read, up to the end (before anything is read: whether the stream
// holds anything up to the end that the start did not exclude, which the
// caller's consumer said when it was created, so true).
func (b *backtest) left(ctx context.Context) (bool, error) {
	if b.res.LastSeq == 0 {
		return true, nil
	}
	var next uint64
	err := b.retry(ctx, func(ctx context.Context) error {
		m, err := b.stream.GetMsg(ctx, b.res.LastSeq+1, jetstream.WithGetMsgSubject(usage.Subjects(b.cfg.Prefix)))
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			next = 0
			return nil
		}
		if err != nil {
			return err
		}
		next = m.Sequence
		return nil
	})
	if err != nil {
		return false, err
	}
	return next != 0 && next <= b.last, nil
}
