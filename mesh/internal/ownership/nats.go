package ownership

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// The production side of the runner: the shards bucket over JetStream KV
// and the loop that feeds the runner its watch and its ticks.

// ConfigKey is the shards bucket entry that records the partition count
// every node must use.
const ConfigKey = "config"

// ErrPartitionMismatch is returned, wrapped, by CheckConfig when the
// shards bucket records another partition count.
var ErrPartitionMismatch = errors.New("mesh: partition count differs from the mesh's")

type configValue struct {
	Partitions int `json:"partitions"`
}

// CheckConfig records the partition count in the shards bucket kv, or
// checks it against the recorded one.
func CheckConfig(ctx context.Context, kv jetstream.KeyValue, parts int) error {
	b, _ := json.Marshal(configValue{Partitions: parts})
	if _, err := kv.Create(ctx, ConfigKey, b); err == nil {
		return nil
	} else if !errors.Is(err, jetstream.ErrKeyExists) {
		return fmt.Errorf("mesh: recording the partition count: %w", err)
	}
	e, err := kv.Get(ctx, ConfigKey)
	if err != nil {
		return fmt.Errorf("mesh: reading the partition count: %w", err)
	}
	var v configValue
	if err := json.Unmarshal(e.Value(), &v); err != nil {
		return fmt.Errorf("%w: shards bucket %s: %v", ErrCorrupt, ConfigKey, err)
	}
	if v.Partitions != parts {
		return fmt.Errorf("%w: this node has %d partitions, the mesh %d (key %q of bucket %s); every node must use the same count",
			ErrPartitionMismatch, parts, v.Partitions, ConfigKey, kv.Bucket())
	}
	return nil
}

// ReadConfig returns the partition count recorded in kv (0 when none).
func ReadConfig(ctx context.Context, kv jetstream.KeyValue) (int, error) {
	e, err := kv.Get(ctx, ConfigKey)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	var v configValue
	if err := json.Unmarshal(e.Value(), &v); err != nil {
		return 0, fmt.Errorf("%w: shards bucket %s: %v", ErrCorrupt, ConfigKey, err)
	}
	return v.Partitions, nil
}

// JetStreamKV is KV over a JetStream KV bucket: each call runs on a
// goroutine of its own, bounded by its timeout and by the context given to
// NewJetStreamKV (cancelled when the node stops).
type JetStreamKV struct {
	ctx context.Context
	kv  jetstream.KeyValue
}

// NewJetStreamKV returns the shards bucket kv as a KV.
func NewJetStreamKV(ctx context.Context, kv jetstream.KeyValue) *JetStreamKV {
	return &JetStreamKV{ctx: ctx, kv: kv}
}

func (k *JetStreamKV) call(timeout time.Duration, f func(ctx context.Context)) {
	go func() {
		ctx, cancel := context.WithTimeout(k.ctx, timeout)
		defer cancel()
		f(ctx)
	}()
}

func mapErr(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, jetstream.ErrKeyRevisionMismatch), errors.Is(err, jetstream.ErrKeyExists):
		return fmt.Errorf("%w: %w", ErrConflict, err)
	case errors.Is(err, jetstream.ErrKeyNotFound), errors.Is(err, jetstream.ErrKeyDeleted):
		return fmt.Errorf("%w: %w", ErrNotFound, err)
	}
	return err
}

// Update implements KV.
func (k *JetStreamKV) Update(key string, val []byte, rev uint64, timeout time.Duration, done func(uint64, error)) {
	k.call(timeout, func(ctx context.Context) {
		r, err := k.kv.Update(ctx, key, val, rev)
		done(r, mapErr(err))
	})
}

// Delete implements KV.
func (k *JetStreamKV) Delete(key string, rev uint64, timeout time.Duration, done func(error)) {
	k.call(timeout, func(ctx context.Context) {
		var opts []jetstream.KVDeleteOpt
		if rev != 0 {
			opts = append(opts, jetstream.LastRevision(rev))
		}
		done(mapErr(k.kv.Delete(ctx, key, opts...)))
	})
}

// Put implements KV.
func (k *JetStreamKV) Put(key string, val []byte, timeout time.Duration, done func(uint64, error)) {
	k.call(timeout, func(ctx context.Context) {
		r, err := k.kv.Put(ctx, key, val)
		done(r, mapErr(err))
	})
}

// Get implements KV.
func (k *JetStreamKV) Get(key string, timeout time.Duration, done func(Entry, error)) {
	k.call(timeout, func(ctx context.Context) {
		e, err := k.kv.Get(ctx, key)
		if err != nil {
			done(Entry{}, mapErr(err))
			return
		}
		done(toEntry(e), nil)
	})
}

func toEntry(e jetstream.KeyValueEntry) Entry {
	return Entry{Key: e.Key(), Value: e.Value(), Rev: e.Revision(), Deleted: e.Operation() != jetstream.KeyValuePut}
}

// Drive feeds r a watch of the shards bucket kv and a tick every lease/15
// until ctx ends, then stops r. A watch that closes or stops delivering
// (Runner.WatchStale: after a network partition heals, nats.go's ordered
// consumer may take many seconds to resume) is replaced by a new one,
// which delivers every entry's latest revision again.
func Drive(ctx context.Context, r *Runner, kv jetstream.KeyValue) {
	defer r.Stop()
	tk := time.NewTicker(max(r.cfg.Lease/15, 5*time.Millisecond))
	defer tk.Stop()
	var w jetstream.KeyWatcher
	defer func() {
		if w != nil {
			_ = w.Stop()
		}
	}()
	var updates <-chan jetstream.KeyValueEntry
	watch := func() {
		if w != nil {
			_ = w.Stop()
			w, updates = nil, nil
		}
		nw, err := kv.WatchAll(ctx)
		if err != nil {
			if ctx.Err() == nil {
				r.log.Warn("watching the shards bucket", "error", err.Error())
			}
			return
		}
		w, updates = nw, nw.Updates()
	}
	watch()
	for {
		select {
		case <-ctx.Done():
			return
		case e, ok := <-updates:
			switch {
			case !ok:
				r.log.Warn("shards watch closed; watching anew")
				watch()
			case e == nil:
				r.Ready()
			default:
				r.Observe(toEntry(e))
			}
		case <-tk.C:
			r.Tick()
			if w == nil || r.WatchStale() {
				if w != nil {
					r.log.Warn("shards watch stopped delivering; watching anew")
				}
				watch()
			}
		}
	}
}
