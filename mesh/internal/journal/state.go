package journal

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/ownership"
	"github.com/limitmesh/limitmesh/mesh/internal/rt"
	"github.com/nats-io/nats.go/jetstream"
)

// ReadStateRecord returns the latest durable record of a limit key in the
// installation with subject prefix prefix, by the rule the key's next
// owner adopts with (invariants J2, J10): the journals its partition's
// entry names (a claim's unfinished sources, then the node it names), each
// read from its node's mark to its end with tenure markers applied, the
// record of the highest version winning; else the state bucket's. An error wraps
// kvstate.ErrNotFound when there is none. A diagnostic (the command and
// tests use it), never on the decision path.
func ReadStateRecord(ctx context.Context, js jetstream.JetStream, prefix, key string) ([]byte, error) {
	kv, err := js.KeyValue(ctx, prefix+"_state")
	if err != nil {
		return nil, err
	}
	best, err := readJournalled(ctx, js, kv, prefix, key)
	if err != nil {
		return nil, err
	}
	if best != nil {
		return best, nil
	}
	e, err := kv.Get(ctx, key)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return nil, fmt.Errorf("%w: %s", kvstate.ErrNotFound, key)
	}
	if err != nil {
		return nil, err
	}
	return e.Value(), nil
}

func readJournalled(ctx context.Context, js jetstream.JetStream, kv jetstream.KeyValue, prefix, key string) ([]byte, error) {
	stream, err := js.Stream(ctx, StreamName(prefix))
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	skv, err := js.KeyValue(ctx, prefix+"_shards")
	if err != nil {
		return nil, nil
	}
	parts, err := ownership.ReadConfig(ctx, skv)
	if err != nil || parts == 0 {
		return nil, err
	}
	p := ownership.PartitionOf(key, parts)
	pe, err := skv.Get(ctx, "part."+strconv.Itoa(p))
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	sources := ownership.Sources(ownership.Entry{Key: pe.Key(), Value: pe.Value(), Rev: pe.Revision(),
		Deleted: pe.Operation() != jetstream.KeyValuePut})
	timeout := 10 * time.Second
	if d, ok := ctx.Deadline(); ok {
		timeout = time.Until(d)
	}
	st := NewJetStreamStream(ctx, stream, nil, min(timeout, 5*time.Second), nil)
	// A journal that reads only: no node id (never a source's), marks
	// from the bucket.
	j := New(Config{Prefix: prefix, Parts: parts, Stream: st, Bucket: markBucket{ctx, kv}, Runtime: rt.Real, Timeout: timeout})
	var best []byte
	for _, src := range sources {
		upto, err := st.last(ctx, j.subjOf(src))
		if err != nil {
			return nil, err
		}
		if upto == 0 {
			continue
		}
		type res struct {
			val []byte
			err error
		}
		ch := make(chan res, 1)
		j.rd.read(src, upto, timeout, func(states map[string]state, _ uint64, err error) {
			ch <- res{states[key].val, err}
		})
		r := <-ch
		if r.err != nil {
			return nil, r.err
		}
		if r.val != nil && newer(r.val, best) {
			best = r.val
		}
	}
	return best, nil
}

// markBucket reads journal marks from the state bucket for a read-only
// journal; it writes nothing.
type markBucket struct {
	ctx context.Context
	kv  jetstream.KeyValue
}

var errReadOnly = errors.New("mesh: read-only journal")

func (b markBucket) GetAsync(key string, timeout time.Duration, done func([]byte, uint64, error)) {
	go func() {
		ctx, cancel := context.WithTimeout(b.ctx, timeout)
		defer cancel()
		e, err := b.kv.Get(ctx, key)
		switch {
		case errors.Is(err, jetstream.ErrKeyNotFound):
			done(nil, 0, kvstate.ErrNotFound)
		case err != nil:
			done(nil, 0, err)
		default:
			done(e.Value(), e.Revision(), nil)
		}
	}()
}

func (markBucket) UpdateAsync(_ string, _ []byte, _ uint64, _, _ time.Duration, done func(uint64, error)) {
	done(0, errReadOnly)
}

func (markBucket) GetAsyncFloor(_, _ string, _ uint64, _ time.Duration, done func([]byte, uint64, error)) {
	done(nil, 0, errReadOnly)
}

func (markBucket) GetManyAsyncFloor(_ []string, _ string, _ uint64, _ time.Duration, done func([]kvstate.KeyRecord, error)) {
	done(nil, errReadOnly)
}

func (markBucket) PutAsync(_ string, _ []byte, _, _ time.Duration, done func(uint64, error)) {
	done(0, errReadOnly)
}
