package mesh

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// jsSetup creates or binds the JetStream assets a node uses (buckets,
// streams) at start.
//
// A JetStream cluster that is still forming (no meta leader yet, or a
// stream leader being elected) may leave a request unanswered or answer
// "temporarily unavailable": such attempts are retried, each bounded by
// bucketAttempt, until the start's context ends.
type jsSetup struct {
	js  jetstream.JetStream
	log *slog.Logger
}

// ensureBucket binds to the bucket if it exists (as it is: never updated
// or narrowed) and creates it otherwise.
func (s jsSetup) ensureBucket(ctx context.Context, cfg jetstream.KeyValueConfig) (jetstream.KeyValue, error) {
	var kv jetstream.KeyValue
	err := s.retry(ctx, "bucket "+cfg.Bucket, func(ctx context.Context) (err error) {
		kv, err = s.ensureBucketOnce(ctx, cfg)
		return err
	})
	return kv, err
}

// retry runs op, each attempt bounded by bucketAttempt, until it succeeds,
// fails in a way retryableJS does not retry, or ctx ends.
func (s jsSetup) retry(ctx context.Context, what string, op func(context.Context) error) error {
	for {
		actx, cancel := context.WithTimeout(ctx, bucketAttempt)
		err := op(actx)
		cancel()
		if err == nil || ctx.Err() != nil || !retryableJS(err) {
			return err
		}
		s.log.Debug("JetStream not ready, retrying", "what", what, "err", err)
		select {
		case <-ctx.Done():
			return err
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// bucketAttempt bounds one attempt of jsSetup.retry.
const bucketAttempt = 2 * time.Second

// retryableJS reports whether a JetStream request failed in a way a forming
// or electing cluster causes: no reply in time, no responders, or the
// "JetStream system temporarily unavailable" API error.
func retryableJS(err error) bool {
	var apiErr *jetstream.APIError
	switch {
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, nats.ErrTimeout),
		errors.Is(err, nats.ErrNoResponders), errors.Is(err, jetstream.ErrNoStreamResponse):
		return true
	case errors.As(err, &apiErr):
		return apiErr.Code == 503
	}
	return false
}

func (s jsSetup) ensureBucketOnce(ctx context.Context, cfg jetstream.KeyValueConfig) (jetstream.KeyValue, error) {
	kv, err := s.js.KeyValue(ctx, cfg.Bucket)
	if err == nil {
		return kv, nil
	}
	if !errors.Is(err, jetstream.ErrBucketNotFound) {
		return nil, fmt.Errorf("mesh: binding bucket %s: %w", cfg.Bucket, err)
	}
	kv, err = s.js.CreateKeyValue(ctx, cfg)
	if errors.Is(err, jetstream.ErrBucketExists) {
		// Another node created it between our look-up and create.
		kv, err = s.js.KeyValue(ctx, cfg.Bucket)
	}
	if err != nil {
		return nil, fmt.Errorf("mesh: creating bucket %s: %w", cfg.Bucket, err)
	}
	s.log.Info("bucket created", "bucket", cfg.Bucket, "replicas", cfg.Replicas)
	return kv, nil
}
