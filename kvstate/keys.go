package kvstate

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Keys returns, sorted, the keys of the KV bucket that match filter (a key
// pattern such as "t.>"; "" for every key), read from the server's count
// of its stream's subjects.
//
// A KV listing (kv.ListKeys) is a watcher that stops after as many
// messages as were pending when it started: a key rewritten meanwhile is
// delivered twice and uses up the count of one that is then never
// delivered, so a listing of a bucket being written misses keys (one
// listing in three, measured with four of five keys rewritten in a loop;
// TestKeysWhileRewritten fails with it at once). The subject count misses
// none, but it counts a deleted key until its marker is gone: callers read
// each key and skip those not found. Very large buckets are read in pages (the server's
// limit per answer), and a key created between pages may be left out.
func Keys(ctx context.Context, js jetstream.JetStream, bucket, filter string) ([]string, error) {
	if filter == "" {
		filter = ">"
	}
	prefix := "$KV." + bucket + "."
	st, err := js.Stream(ctx, "KV_"+bucket)
	if err != nil {
		return nil, fmt.Errorf("kvstate: keys of %s: %w", bucket, err)
	}
	info, err := st.Info(ctx, jetstream.WithSubjectFilter(prefix+filter))
	if err != nil {
		return nil, fmt.Errorf("kvstate: keys of %s: %w", bucket, err)
	}
	keys := make([]string, 0, len(info.State.Subjects))
	for subj := range info.State.Subjects {
		if k, ok := strings.CutPrefix(subj, prefix); ok {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	return keys, nil
}

// Keys returns the bucket's keys that match filter: see [Keys].
func (s *JetStreamStore) Keys(ctx context.Context, filter string) ([]string, error) {
	return Keys(ctx, s.js, s.bucket, filter)
}

// relistEvery is how often a watch from [WatchAll] whose initial values
// still lack listed keys lists the bucket again, to stop waiting for keys
// gone meanwhile.
const relistEvery = 250 * time.Millisecond

// WatchAll watches every key of the KV bucket (deletes included, as
// kv.WatchAll does) with an end-of-initial-values marker (a nil entry)
// that comes only once every key the bucket held when the watch began has
// been delivered.
//
// kv.WatchAll's own marker comes after as many entries as were pending
// when it began: a key rewritten meanwhile is delivered twice and the
// marker can come before another key's entry (TestWatchAllWhileRewritten
// fails with it at once).
// This watch lists the keys first ([Keys]) and holds the marker back until
// each has had an entry; a listed key whose entries all went before the
// watch delivered one (a purged subject, an expired marker) stops being
// waited for once a new listing lacks it.
func WatchAll(ctx context.Context, js jetstream.JetStream, bucket string) (jetstream.KeyWatcher, error) {
	relist := func(ctx context.Context) ([]string, error) { return Keys(ctx, js, bucket, "") }
	keys, err := relist(ctx)
	if err != nil {
		return nil, err
	}
	kv, err := js.KeyValue(ctx, bucket)
	if err != nil {
		return nil, fmt.Errorf("kvstate: watch %s: %w", bucket, err)
	}
	w, err := kv.WatchAll(ctx)
	if err != nil {
		return nil, fmt.Errorf("kvstate: watch %s: %w", bucket, err)
	}
	return watchListed(ctx, w, keys, relist), nil
}

// listedWatch is the watch WatchAll returns: w's entries, with the marker
// held back until every key of need has had one.
type listedWatch struct {
	w       jetstream.KeyWatcher
	out     chan jetstream.KeyValueEntry
	stopped chan struct{}
	stop    sync.Once
}

func watchListed(ctx context.Context, w jetstream.KeyWatcher, keys []string, relist func(context.Context) ([]string, error)) *listedWatch {
	lw := &listedWatch{w: w, out: make(chan jetstream.KeyValueEntry, 64), stopped: make(chan struct{})}
	need := make(map[string]bool, len(keys))
	for _, k := range keys {
		need[k] = true
	}
	go lw.run(ctx, need, relist)
	return lw
}

func (lw *listedWatch) run(ctx context.Context, need map[string]bool, relist func(context.Context) ([]string, error)) {
	defer close(lw.out)
	send := func(e jetstream.KeyValueEntry) bool {
		select {
		case lw.out <- e:
			return true
		case <-lw.stopped:
			return false
		case <-ctx.Done():
			return false
		}
	}
	marker, initial := false, true
	var (
		ticker *time.Ticker
		tick   <-chan time.Time // ticker's while the marker waits for listed keys
	)
	defer func() {
		if ticker != nil {
			ticker.Stop()
		}
	}()
	for {
		if initial && marker && len(need) == 0 {
			initial, tick = false, nil
			if ticker != nil {
				ticker.Stop()
			}
			if !send(nil) {
				return
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-lw.stopped:
			return
		case <-tick:
			rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			keys, err := relist(rctx)
			cancel()
			if err != nil {
				continue // listed again at the next tick
			}
			still := make(map[string]bool, len(keys))
			for _, k := range keys {
				still[k] = true
			}
			for k := range need {
				if !still[k] {
					delete(need, k)
				}
			}
		case e, ok := <-lw.w.Updates():
			if !ok {
				return
			}
			if e == nil {
				if !marker && len(need) > 0 {
					ticker = time.NewTicker(relistEvery)
					tick = ticker.C
				}
				marker = true
				continue
			}
			delete(need, e.Key())
			if !send(e) {
				return
			}
		}
	}
}

// Updates returns the entries, then nil once the initial values are all
// delivered, then the changes; it is closed when the watch ends.
func (lw *listedWatch) Updates() <-chan jetstream.KeyValueEntry { return lw.out }

// Stop ends the watch.
func (lw *listedWatch) Stop() error {
	lw.stop.Do(func() { close(lw.stopped) })
	return lw.w.Stop()
}
