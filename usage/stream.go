package usage

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// StreamConfig is what [EnsureStream] creates the usage stream with.
type StreamConfig struct {
	Prefix     string        // subject prefix; default "rl"
	Replicas   int           // default 1
	Retention  time.Duration // max age of a record (--usage-retention); default 24h
	MaxBytes   int64         // --usage-max-bytes; default 1 GiB
	Duplicates time.Duration // Nats-Msg-Id dedupe window; default 2m (at most Retention)
}

// Defaults of StreamConfig.
const (
	DefaultRetention  = 24 * time.Hour
	DefaultMaxBytes   = 1 << 30
	DefaultDuplicates = 2 * time.Minute
)

func (c StreamConfig) withDefaults() StreamConfig {
	if c.Prefix == "" {
		c.Prefix = "rl"
	}
	if c.Replicas <= 0 {
		c.Replicas = 1
	}
	if c.Retention <= 0 {
		c.Retention = DefaultRetention
	}
	if c.MaxBytes <= 0 {
		c.MaxBytes = DefaultMaxBytes
	}
	if c.Duplicates <= 0 {
		c.Duplicates = DefaultDuplicates
	}
	c.Duplicates = min(c.Duplicates, c.Retention)
	return c
}

// EnsureStream returns the usage stream <PREFIX>_USAGE, creating it when it
// is missing: subjects <prefix>.usage.>, file storage, limits retention
// with the oldest records discarded first, cfg's max age, max bytes,
// replicas and duplicates window. An existing stream is bound as it is,
// never changed (an operator may have widened it; a node never narrows
// it).
func EnsureStream(ctx context.Context, js jetstream.JetStream, cfg StreamConfig) (jetstream.Stream, error) {
	cfg = cfg.withDefaults()
	name := StreamName(cfg.Prefix)
	s, err := js.Stream(ctx, name)
	if err == nil {
		return s, nil
	}
	if !errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, fmt.Errorf("usage: stream %s: %w", name, err)
	}
	s, err = js.CreateStream(ctx, jetstream.StreamConfig{
		Name:        name,
		Description: "limitmesh usage records (CONTRACT.md §6)",
		Subjects:    []string{Subjects(cfg.Prefix)},
		Storage:     jetstream.FileStorage,
		Retention:   jetstream.LimitsPolicy,
		Discard:     jetstream.DiscardOld,
		MaxAge:      cfg.Retention,
		MaxBytes:    cfg.MaxBytes,
		Replicas:    cfg.Replicas,
		Duplicates:  cfg.Duplicates,
	})
	if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
		// Another node created it meanwhile.
		s, err = js.Stream(ctx, name)
	}
	if err != nil {
		return nil, fmt.Errorf("usage: create stream %s: %w", name, err)
	}
	return s, nil
}
