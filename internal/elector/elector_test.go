package elector

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Two electors on two connections: one runs the job; when its connection
// is closed, the other runs it, and the two never run it at once.
func TestElectorFailover(t *testing.T) {
	url := startServer(t)
	const lease = 1500 * time.Millisecond
	var (
		active  atomic.Int32
		overlap atomic.Bool
		mu      sync.Mutex
		runs    []string
	)
	job := func(node string) func(ctx context.Context) error {
		return func(ctx context.Context) error {
			if active.Add(1) > 1 {
				overlap.Store(true)
			}
			mu.Lock()
			runs = append(runs, node)
			mu.Unlock()
			<-ctx.Done()
			active.Add(-1)
			return nil
		}
	}
	type member struct {
		e    *Elector
		done chan error
		stop context.CancelFunc
	}
	conns := map[string]func(){}
	start := func(node string) *member {
		nc, kv := connect(t, url)
		conns[node] = nc.Close
		e := New(kv, "leader.ledger", node, lease, nil)
		ctx, cancel := context.WithCancel(context.Background())
		m := &member{e: e, done: make(chan error, 1), stop: cancel}
		go func() { m.done <- e.Run(ctx, job(node)) }()
		t.Cleanup(func() { cancel(); <-m.done })
		return m
	}
	a := start("a")
	waitFor(t, 20*time.Second, "a leads", a.e.Leader)
	b := start("b")
	// b stays a follower while a renews.
	time.Sleep(2 * lease)
	if b.e.Leader() || !a.e.Leader() {
		t.Fatalf("a leads %v, b leads %v", a.e.Leader(), b.e.Leader())
	}
	conns["a"]()
	waitFor(t, 30*time.Second, "b leads after a's connection closed", b.e.Leader)
	waitFor(t, 10*time.Second, "a stops leading", func() bool { return !a.e.Leader() })
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
	c := start("c")
	time.Sleep(lease / 2)
	b.stop()
	if err := <-b.done; err != nil {
		t.Fatal(err)
	}
	b.done <- nil
	waitFor(t, 20*time.Second, "c leads after b released", c.e.Leader)
	if overlap.Load() {
		t.Fatal("two jobs ran at once")
	}
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
