package kvstate

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Per-message time to live (JetStream's Nats-TTL header, server 2.11+):
// a message written with a TTL is removed that long after it was stored,
// by the server's clock. A stream's age limit (MaxAge) still removes a
// message with a longer TTL at its own age, unless the TTL is "never";
// so a stream whose messages carry their own TTLs gets an age limit at
// least as long as any TTL it is given ([EnsureTTLStream]), and a message
// that must outlive even that is written with [NoExpiry].

// TTLStore is an [AsyncStore] whose writes can carry a time to live
// ([JetStreamStore]).
type TTLStore interface {
	AsyncStore
	// UpdateAsyncTTL is UpdateAsync with the written value's time to
	// live (see [SetTTL]).
	UpdateAsyncTTL(key string, value []byte, rev uint64, ttl, timeout time.Duration, done func(uint64, error))
}

// NoExpiry, as a write's time to live, keeps the message until it is
// replaced or removed, whatever the stream's age limit (the header value
// "never").
const NoExpiry time.Duration = -1

// MaxTTL is the longest time to live SetTTL writes as a number of seconds;
// a longer one is written as [NoExpiry] (the server's arithmetic on TTLs
// is in int64 nanoseconds).
const MaxTTL = 100 * 365 * 24 * time.Hour

// SetTTL sets m's Nats-TTL header for ttl: a positive ttl in whole seconds
// rounded up (at least 1 s, the server's least TTL), [NoExpiry] (or any
// negative ttl, or one above MaxTTL) as "never"; ttl 0 sets nothing (the
// stream's limits apply).
func SetTTL(m *nats.Msg, ttl time.Duration) {
	if v := TTLValue(ttl); v != "" {
		if m.Header == nil {
			m.Header = nats.Header{}
		}
		m.Header.Set(jetstream.MsgTTLHeader, v)
	}
}

// TTLValue returns the Nats-TTL header value SetTTL writes for ttl ("" for
// none).
func TTLValue(ttl time.Duration) string {
	switch {
	case ttl == 0:
		return ""
	case ttl < 0 || ttl > MaxTTL:
		return "never"
	}
	secs := (ttl + time.Second - 1) / time.Second
	return strconv.FormatInt(int64(secs), 10)
}

// EnsureTTLStream widens the existing JetStream stream named name (a KV
// bucket's is "KV_" + bucket) so that its messages may carry their own
// time to live: it turns per-message TTLs on and raises an age limit
// (MaxAge) below maxAge to maxAge (maxAge 0: no age limit). It never narrows the stream: a longer
// age limit, or none (0), is kept, and a stream that needs no change is
// not updated. It returns the stream's configuration after the change; a
// server that does not support per-message TTLs (before 2.11) leaves
// AllowMsgTTL false there, and the caller must then write no TTLs.
//
// Turning per-message TTLs on cannot be undone (the server refuses), so
// tools that rewrite a KV bucket's configuration from scratch (`nats kv
// edit`) fail on such a bucket rather than silently turn them off.
func EnsureTTLStream(ctx context.Context, js jetstream.JetStream, name string, maxAge time.Duration) (jetstream.StreamConfig, error) {
	st, err := js.Stream(ctx, name)
	if err != nil {
		return jetstream.StreamConfig{}, fmt.Errorf("kvstate: stream %s: %w", name, err)
	}
	cfg := st.CachedInfo().Config
	if !widenForTTL(&cfg, maxAge) {
		return cfg, nil
	}
	updated, err := js.UpdateStream(ctx, cfg)
	if err != nil {
		return jetstream.StreamConfig{}, fmt.Errorf("kvstate: allowing message TTLs on stream %s: %w", name, err)
	}
	return updated.CachedInfo().Config, nil
}

// widenForTTL turns per-message TTLs on in cfg and raises its age limit
// to at least maxAge (0 stays 0: no limit), and reports whether it
// changed anything.
func widenForTTL(cfg *jetstream.StreamConfig, maxAge time.Duration) bool {
	changed := false
	if !cfg.AllowMsgTTL {
		cfg.AllowMsgTTL = true
		changed = true
	}
	if cfg.MaxAge != 0 && (maxAge == 0 || cfg.MaxAge < maxAge) {
		cfg.MaxAge = maxAge
		changed = true
	}
	return changed
}
