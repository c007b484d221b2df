package leasing

import (
	"sync"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/lease"
	"github.com/limitmesh/limitmesh/policies"
)

const (
	u  = kvstate.Unit
	ms = int64(time.Millisecond)
)

// acme is a leased policy: grants of 10 units, 40 outstanding at most, a
// ttl of 2 s (so a skew margin of 200 ms).
var acme = &policies.Policy{Name: "acme", Revision: 3, Mode: policies.ModeLeased,
	Lease: policies.Lease{Size: 10 * u, MaxOutstanding: 40 * u, TTL: 2 * time.Second}}

func newPool() *lease.Pool {
	seq := uint64(500)
	return lease.NewPool(lease.ParamsOf(acme.Lease), func() uint64 { seq++; return seq })
}

// clock is an rt.Runtime whose time moves only when a test sets it.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func newClock() *clock { return &clock{t: time.Unix(1_700_000_000, 0)} }

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *clock) advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

func (c *clock) AfterFunc(d time.Duration, f func()) func() bool { return time.AfterFunc(d, f).Stop }

func (c *clock) Go(f func()) { go f() }
