package usage

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// LedgerLag is how far the ledger is behind the usage stream, as
// [MeasureLag] reads it from the stream and the ledger's consumer.
type LedgerLag struct {
	// Pending is the number of stream messages (batches) the ledger has not
	// acknowledged: not yet delivered to the reconciler, or delivered and
	// not yet written.
	Pending uint64
	// Oldest is the age, at the instant given to MeasureLag, of the oldest
	// record of the first such message (its t_us; the message's stream
	// time if it is not a valid batch); 0 when Pending is 0.
	Oldest time.Duration
}

// MeasureLag reports how far the ledger of the installation with subject
// prefix prefix is behind its usage stream at now: the messages after the
// acknowledgement floor of the durable consumer limitmesh-ledger (every
// message of the stream while the consumer does not exist yet), and the age
// of the oldest record of the first of them. The reconciler acknowledges a
// message only once its records are written to the ledger, so Oldest is the
// age of the oldest record not yet in the ledger (records with a time
// earlier than an earlier one's in the stream aside). Records still in the
// nodes' publishers, at most --usage-interval old, are not in the stream
// and not counted.
//
// It errors (wrapping jetstream.ErrStreamNotFound) when the stream does not
// exist, and with the error of a failed request.
func MeasureLag(ctx context.Context, js jetstream.JetStream, prefix string, now time.Time) (LedgerLag, error) {
	if prefix == "" {
		prefix = "rl"
	}
	s, err := js.Stream(ctx, StreamName(prefix))
	if err != nil {
		return LedgerLag{}, fmt.Errorf("usage: stream %s: %w", StreamName(prefix), err)
	}
	var floor, pending uint64
	ci, err := s.Consumer(ctx, LedgerConsumer)
	switch {
	case errors.Is(err, jetstream.ErrConsumerNotFound):
		info, err := s.Info(ctx)
		if err != nil {
			return LedgerLag{}, fmt.Errorf("usage: stream %s: %w", StreamName(prefix), err)
		}
		floor, pending = info.State.FirstSeq-min(info.State.FirstSeq, 1), info.State.Msgs
	case err != nil:
		return LedgerLag{}, fmt.Errorf("usage: consumer %s: %w", LedgerConsumer, err)
	default:
		info, err := ci.Info(ctx)
		if err != nil {
			return LedgerLag{}, fmt.Errorf("usage: consumer %s: %w", LedgerConsumer, err)
		}
		floor, pending = info.AckFloor.Stream, info.NumPending+uint64(info.NumAckPending)
	}
	if pending == 0 {
		return LedgerLag{}, nil
	}
	m, err := s.GetMsg(ctx, floor+1, jetstream.WithGetMsgSubject(Subjects(prefix)))
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		// Acknowledged meanwhile, or removed by the stream's limits.
		return LedgerLag{Pending: pending}, nil
	}
	if err != nil {
		return LedgerLag{}, fmt.Errorf("usage: stream %s message %d: %w", StreamName(prefix), floor+1, err)
	}
	oldest := m.Time
	if b, err := DecodeBatch(m.Data); err == nil {
		for i := range b.Records {
			if t := time.UnixMicro(b.Records[i].TimeUs); t.Before(oldest) {
				oldest = t
			}
		}
	}
	return LedgerLag{Pending: pending, Oldest: max(0, now.Sub(oldest))}, nil
}
