package client

import (
	"context"
	"fmt"
	"math"
	"strconv"
	"time"
)

// The client's lease loop: prefetching grants, reporting spends, returning
// what expires, and closing.

// kick asks the client's loop to prefetch l's next grant.
func (c *Client) kick(l *Lease) {
	if !l.fetching.CompareAndSwap(false, true) {
		return
	}
	select {
	case c.kicks <- l:
	default:
		l.fetching.Store(false)
	}
}

// startLoop starts the client's lease loop once; c.lmu held.
func (c *Client) startLoop() {
	if c.loopStop != nil {
		return
	}
	c.loopStop = make(chan struct{})
	c.loopDone = make(chan struct{})
	c.coarse.Store(c.mono())
	go c.loop(c.loopStop, c.loopDone)
}

// loop prefetches on kicks and sweeps the leases every tick until stop.
func (c *Client) loop(stop, done chan struct{}) {
	defer close(done)
	tk := time.NewTicker(DefaultLeaseTick)
	defer tk.Stop()
	var clock <-chan time.Time
	if c.coarseOn {
		ct := time.NewTicker(clockTick)
		defer ct.Stop()
		clock = ct.C
	}
	for {
		select {
		case <-stop:
			return
		case <-clock:
			c.coarse.Store(c.mono())
		case l := <-c.kicks:
			l.mu.Lock()
			busy := l.done != nil || l.slots[1].Load() != nil || l.closed
			l.mu.Unlock()
			if busy {
				l.fetching.Store(false)
				continue
			}
			c.bg.Go(func() { l.acquire(context.Background(), l.prefetchMin()) })
		case <-tk.C:
			c.sweep()
		}
	}
}

// sweep returns expired and unused grants, rotates to the next grant when
// the current one is short, reports spend, prefetches before the current
// grant ends, and forgets leases long unused.
func (c *Client) sweep() {
	c.lmu.RLock()
	ls := make([]*Lease, 0, len(c.leases))
	for _, l := range c.leases {
		ls = append(ls, l)
	}
	c.lmu.RUnlock()
	now := c.mono()
	var forget []*Lease
	for _, l := range ls {
		l.mu.Lock()
		var ttl int64
		for i := range l.slots {
			g := l.slots[i].Load()
			if g == nil {
				continue
			}
			ttl = g.ttl
			if left := g.left.Load(); left != g.lastLeft {
				g.lastLeft, g.lastChange = left, now
				l.lastUse = now
			}
			// Ended, or used up (it holds less than the last cost):
			// give it back (it only counts against the key's
			// max_outstanding until returned).
			if now >= g.deadline || g.left.Load() < max(l.lastCost, 1) {
				l.slots[i].Store(nil)
				c.retire(g)
			}
		}
		// Rotate: the current grant is gone or was found short.
		if cur := l.slots[0].Load(); (cur == nil || l.rotate.Load()) && l.slots[1].Load() != nil {
			l.rotate.Store(false)
			l.slots[0].Store(l.slots[1].Load())
			l.slots[1].Store(nil)
			if cur != nil {
				c.retire(cur)
			}
		}
		idle := ttl > 0 && now-l.lastUse >= ttl/4 && now-l.lastSlow >= ttl/4
		for i := range l.slots {
			g := l.slots[i].Load()
			switch {
			case g == nil:
			case idle:
				// Unused for a quarter ttl: give the units back, so a
				// busier holder can have them (rebalancing).
				l.slots[i].Store(nil)
				c.retire(g)
			case now-g.lastReport >= g.ttl/4:
				if spent := g.units - max(g.left.Load(), 0); spent != g.reported {
					g.reported, g.lastReport = spent, now
					c.bg.Go(func() { c.sendLease(g, "report", spent) })
				}
			}
		}
		// Prefetch before the current grant ends (a quarter ttl ahead)
		// while it is in use; the spend path kicks when it runs low.
		if cur := l.slots[0].Load(); cur != nil && l.slots[1].Load() == nil && l.done == nil && !l.closed &&
			cur.deadline-now < cur.ttl/4 && now-l.lastUse < cur.ttl/4 && l.fetching.CompareAndSwap(false, true) {
			least := max(l.lastCost, 1)
			c.bg.Go(func() { l.acquire(context.Background(), least) })
		}
		if l.slots[0].Load() == nil && l.slots[1].Load() == nil && l.done == nil &&
			now-l.lastUse > int64(leaseForget) && now-l.lastSlow > int64(leaseForget) {
			forget = append(forget, l)
		}
		l.mu.Unlock()
	}
	if len(forget) > 0 {
		c.lmu.Lock()
		for _, l := range forget {
			if c.leases[l.key] == l {
				delete(c.leases, l.key)
			}
		}
		c.lmu.Unlock()
	}
}

// retire stops g being spent and returns what it did not spend to the node
// that made it, in the background.
func (c *Client) retire(g *grant) {
	left := g.left.Swap(closedLeft)
	if left <= closedLeft/2 {
		return // retired already
	}
	spent := g.units - max(left, 0)
	c.bg.Go(func() { c.sendLease(g, "return", spent) })
}

// sendLease sends a report or return of g with cumulative spend spent.
// A refusal (the node or owner no longer knows the grant) changes nothing
// here: the grant is spent to its deadline at most.
func (c *Client) sendLease(g *grant, op string, spent int64) {
	body := []byte(`{"op":"` + op + `","grant":`)
	body = strconv.AppendUint(body, g.id, 10)
	body = append(body, `,"epoch":`...)
	body = strconv.AppendUint(body, g.epoch, 10)
	body = append(body, `,"spent":`...)
	body = strconv.AppendInt(body, spent, 10)
	body = append(body, '}')
	if _, err := c.nc.Request(g.reportTo, body, c.opts.timeout); err != nil && op == "return" {
		c.lostReturns.Add(1)
	}
}

// Close stops the client's leasing: every grant held is returned (what was
// not spent goes back to its key) and Close waits for the returns,
// bounded by the client's Timeout. Decisions after Close are made
// remotely. It is safe to call more than once; without Leasing it does
// nothing.
func (c *Client) Close() error {
	c.lmu.Lock()
	stop, done := c.loopStop, c.loopDone
	c.loopStop = nil
	ls := make([]*Lease, 0, len(c.leases))
	for _, l := range c.leases {
		ls = append(ls, l)
	}
	c.lmu.Unlock()
	if stop == nil {
		return nil
	}
	close(stop)
	<-done
	for _, l := range ls {
		l.mu.Lock()
		l.closed = true
		l.remoteUntil = math.MaxInt64
		for i := range l.slots {
			if g := l.slots[i].Swap(nil); g != nil {
				c.retire(g)
			}
		}
		l.mu.Unlock()
	}
	waited := make(chan struct{})
	go func() { c.bg.Wait(); close(waited) }()
	select {
	case <-waited:
	case <-time.After(2 * c.opts.timeout):
		return fmt.Errorf("limitmesh client: %w: returns of grants not answered", ErrTimeout)
	}
	if n := c.lostReturns.Load(); n > 0 {
		return fmt.Errorf("limitmesh client: %w: %d returns of grants not answered (their units come back when the grants expire)", ErrUnavailable, n)
	}
	return nil
}
