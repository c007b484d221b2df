package integration

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/nats-io/nats.go"
)

// TestStopDrains: Stop during a burst of requests answers every request
// the node accepted; the others see no responders. None is left to time
// out, and Stop returns without error. (Which requests reach the node
// before its subscription closes is up to the scheduler.)
func TestStopDrains(t *testing.T) {
	e := server(t, t.TempDir())
	nc := connect(t, e)
	n := startOwnNode(t, nc)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	client := connect(t, e)
	rev := putPolicy(t, client, "rl_policies", "slow", slowPolicy)
	waitRevision(t, client, map[string]string{"tenant": "probe"}, rev)

	const total = 200
	var wg sync.WaitGroup
	var mu sync.Mutex
	answered, noResponders, timedOut := 0, 0, 0
	started := make(chan struct{}, total)
	for i := 0; i < total; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			started <- struct{}{}
			_, err := client.Request("rl.v1.decide", []byte(req(map[string]string{"tenant": "drain"}, "")), testTimeout)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				answered++
			case errors.Is(err, nats.ErrNoResponders):
				noResponders++
			default:
				timedOut++
			}
		}()
	}
	for i := 0; i < total/2; i++ {
		<-started
	}
	if err := n.Stop(ctx); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	wg.Wait()
	if timedOut != 0 || answered+noResponders != total {
		t.Fatalf("answered %d, no responders %d, timed out %d", answered, noResponders, timedOut)
	}
	t.Logf("answered %d, no responders %d", answered, noResponders)
}
