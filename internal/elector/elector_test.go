package elector

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Two electors on two connections: one runs the job; when its connection
// is closed, the other runs it, and the two never run it at once. Who
// leads is observed as an operator and a job see it: the node the election
// entry names, and whose job runs.
func TestElectorFailover(t *testing.T) {
	url := startServer(t)
	_, entries := connect(t, url)
	const lease = 1500 * time.Millisecond
	var (
		active  atomic.Int32
		overlap atomic.Bool
		mu      sync.Mutex
		runs    []string
		running = map[string]bool{}
	)
	job := func(node string) func(ctx context.Context) error {
		return func(ctx context.Context) error {
			if active.Add(1) > 1 {
				overlap.Store(true)
			}
			mu.Lock()
			runs = append(runs, node)
			running[node] = true
			mu.Unlock()
			<-ctx.Done()
			mu.Lock()
			running[node] = false
			mu.Unlock()
			active.Add(-1)
			return nil
		}
	}
	runsJob := func(node string) bool {
		mu.Lock()
		defer mu.Unlock()
		return running[node]
	}
	leads := func(node string) func() bool {
		return func() bool {
			holder, _ := entryHolder(t, entries, "leader.ledger")
			return holder == node && runsJob(node)
		}
	}
	type member struct {
		done chan error
		stop context.CancelFunc
	}
	conns := map[string]func(){}
	start := func(node string) *member {
		nc, kv := connect(t, url)
		conns[node] = nc.Close
		e := New(kv, "leader.ledger", node, lease, nil)
		ctx, cancel := context.WithCancel(context.Background())
		m := &member{done: make(chan error, 1), stop: cancel}
		go func() { m.done <- e.Run(ctx, job(node)) }()
		t.Cleanup(func() { cancel(); <-m.done })
		return m
	}
	start("a")
	waitFor(t, 20*time.Second, "a leads", leads("a"))
	_, since := entryHolder(t, entries, "leader.ledger")
	b := start("b")
	// b stays a follower while a renews: two renewals of a's entry land
	// and b's job never starts.
	waitFor(t, 20*time.Second, "a renews twice", func() bool {
		holder, rev := entryHolder(t, entries, "leader.ledger")
		if holder != "a" {
			t.Fatalf("the entry names %q while a renews, want a", holder)
		}
		return rev >= since+2
	})
	if runsJob("b") || !runsJob("a") {
		t.Fatalf("a runs its job %v, b runs its job %v", runsJob("a"), runsJob("b"))
	}
	conns["a"]()
	waitFor(t, 30*time.Second, "b leads after a's connection closed", leads("b"))
	waitFor(t, 10*time.Second, "a stops leading", func() bool { return !runsJob("a") })
	waitFor(t, 10*time.Second, "b runs the job", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(runs) >= 2 && runs[len(runs)-1] == "b"
	})
	if overlap.Load() {
		t.Fatal("two jobs ran at once")
	}
	// A graceful stop releases the entry: a third elector takes over at once
	// (well before a lease passes unchanged).
	start("c")
	time.Sleep(lease / 2)
	b.stop()
	if err := <-b.done; err != nil {
		t.Fatal(err)
	}
	b.done <- nil
	waitFor(t, 20*time.Second, "c leads after b released", leads("c"))
	if overlap.Load() {
		t.Fatal("two jobs ran at once")
	}
}

// entryHolder returns the node the election entry key names and the
// entry's revision ("" when there is none, or it was deleted).
func entryHolder(t *testing.T, kv jetstream.KeyValue, key string) (string, uint64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	en, err := kv.Get(ctx, key)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return "", 0
	}
	if err != nil {
		t.Fatalf("reading %s: %v", key, err)
	}
	var v leaseValue
	if err := json.Unmarshal(en.Value(), &v); err != nil {
		t.Fatalf("%s holds %q: %v", key, en.Value(), err)
	}
	return v.Node, en.Revision()
}

// A job that fails while leading is restarted.
func TestElectorRestartsJob(t *testing.T) {
	_, kv := connect(t, startServer(t))
	e := New(kv, "leader.x", "n", time.Second, nil)
	var calls atomic.Int32
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- e.Run(ctx, func(ctx context.Context) error {
			calls.Add(1)
			return context.DeadlineExceeded
		})
	}()
	waitFor(t, 20*time.Second, "the job restarted", func() bool { return calls.Load() >= 3 })
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if err := e.Run(context.Background(), nil); err != ErrClosed {
		t.Fatalf("second Run: %v", err)
	}
}

// An invalid lease or key is a configuration error, and the job never runs.
func TestElectorConfig(t *testing.T) {
	_, kv := connect(t, startServer(t))
	job := func(context.Context) error { t.Error("the job ran"); return nil }
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, c := range []struct {
		key   string
		lease time.Duration
	}{{"leader.x", 29 * time.Millisecond}, {"leader..x", time.Second}, {"leader x", time.Second}, {"", time.Second}} {
		if err := New(kv, c.key, "n", c.lease, nil).Run(ctx, job); !errors.Is(err, ErrConfig) {
			t.Errorf("key %q, lease %v: Run = %v, want ErrConfig", c.key, c.lease, err)
		}
	}
}
