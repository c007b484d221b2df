package usage

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

func ledgerKV(t *testing.T, js jetstream.JetStream) jetstream.KeyValue {
	t.Helper()
	kv, err := js.CreateOrUpdateKeyValue(testCtx(t), jetstream.KeyValueConfig{Bucket: "rl_ledger"})
	if err != nil {
		t.Fatal(err)
	}
	return kv
}

// Two electors on two connections: one runs the job; when its connection
// is closed, the other runs it, and the two never run it at once.
func TestElectorFailover(t *testing.T) {
	ts := startServer(t)
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
		nc, js := ts.connect(t)
		conns[node] = nc.Close
		e := NewElector(ledgerKV(t, js), "leader.ledger", node, lease, nil)
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
	ts := startServer(t)
	_, js := ts.connect(t)
	e := NewElector(ledgerKV(t, js), "leader.x", "n", time.Second, nil)
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
