package mesh

import (
	"context"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/nats-io/nats.go/jetstream"
)

// State retention (CONTRACT §3; docs/protocol.md, "State retention"): a
// limit key's record is never dropped while it can still change a
// decision. Every write of a record to the state bucket, and every journal
// message, carries its own time to live: the state TTL, or until the
// records in it come to rest (keyrec.Retention) when that is later. The
// bucket's and the journal's own age limit is the retention horizon, far
// longer, and only removes what carries no TTL of its own (records of
// formats 1 and 2, written before rest times were; a node's floor key).

// RetentionHorizon is the least age limit of the state bucket and the
// journal stream (or NodeConfig.StateTTL if longer): a node creates them
// with it, and widens an existing one with a shorter limit to it. A record
// that must be kept longer than this (one that comes to rest more than a
// year after its write) is written without expiry.
const RetentionHorizon = 366 * 24 * time.Hour

// horizon returns the age limit of the state bucket and the journal.
func (b *base) horizon() time.Duration { return max(RetentionHorizon, b.cfg.StateTTL) }

// stateRetention widens the state bucket (created already) for per-message
// TTLs and to the retention horizon, and returns the retention its writes
// use: off (with a warning) on a server that does not support per-message
// TTLs, whose records are then kept for the bucket's age limit.
func (b *base) stateRetention(ctx context.Context, s jsSetup) (keyrec.Retention, error) {
	var cfg jetstream.StreamConfig
	stream := "KV_" + b.stateBucket()
	if err := s.retry(ctx, "bucket "+b.stateBucket(), func(ctx context.Context) (err error) {
		cfg, err = kvstate.EnsureTTLStream(ctx, s.js, stream, b.horizon())
		return err
	}); err != nil {
		return keyrec.Retention{}, err
	}
	if !cfg.AllowMsgTTL {
		b.log.Warn("the state bucket does not allow per-message TTLs (nats-server before 2.11): limiter state is kept for the bucket's age limit",
			"bucket", b.stateBucket(), "max_age", cfg.MaxAge.String())
		return keyrec.Retention{}, nil
	}
	return keyrec.Retention{Floor: b.cfg.StateTTL, Horizon: cfg.MaxAge}, nil
}
