package client

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/limitmesh/limitmesh/internal/wire"
	"github.com/nats-io/nats.go"
)

// Leased mode (CONTRACT §8). With [Leasing], the client is a holder: for a
// descriptor whose policy is leased it asks the deployment's nodes of its
// own region for grants (units it may spend until they expire) on
// "<prefix>.v1.lease", spends them locally, reports its cumulative spend
// per grant to the node that made it, returns what it did not spend, and
// asks for the next grant before the current one runs out. A decision
// spent from a grant needs no round trip: [Lease.Spend] is a few atomic
// operations.
//
// Safety. A grant is spent only until the client's own clock, counted from
// the instant it sent its request, passes the grant's ttl less the skew
// margin (a tenth of the ttl, the margin the nodes document), and never
// beyond its units. When no grant can be had, a decision is made remotely
// as in strict mode (the key's owner decides), and when no node can be
// reached the failure behaviour of [OnUnavailable] applies. Requests with
// a [RequestID] or [DryRun] are always decided remotely (dedupe and dry
// runs are the owner's).

// DefaultLeaseTick is how often a leasing client looks at its grants:
// reports, returns of expired or unused grants, prefetches.
const DefaultLeaseTick = 10 * time.Millisecond

// Timing of the holder's retries (client clock).
const (
	// leaseRemoteBackoff: after a "remote" answer (the node's grants are
	// full or it cannot reach the owner), decide remotely this long
	// before asking again.
	leaseRemoteBackoff = 50 * time.Millisecond
	// leaseRecheck: a descriptor whose policy is not leased (or no node
	// answers on the lease subject) is decided remotely this long before
	// its lease is asked for again.
	leaseRecheck = time.Second
	// leaseMaxDeny bounds a local denial window after "exhausted".
	leaseMaxDeny = time.Second
	// leaseForget: a descriptor's lease state is forgotten after this long
	// unused with nothing held.
	leaseForget = time.Minute
)

// closedLeft marks a retired grant: every spend on it fails, and its undo
// adds back to it without ever reaching 0.
const closedLeft = math.MinInt64 / 2

// Leasing makes the client a holder of leased policies' grants (see the
// package documentation, "Leased mode"): [Client.Decide] spends them
// locally, and [Client.Lease] returns a descriptor's handle whose
// [Lease.Spend] is the allocation-free fast path. holder names this
// client to the nodes (1..128 bytes, unique among running gateways); ""
// picks a random name. Call [Client.Close] to return unspent units.
func Leasing(holder string) Option {
	return func(o *options) error {
		if len(holder) > 128 {
			return fmt.Errorf("limitmesh client: holder %q is over 128 bytes", holder)
		}
		if holder == "" {
			var b [8]byte
			_, _ = rand.Read(b[:])
			holder = "gw-" + hex.EncodeToString(b[:])
		}
		o.holder = holder
		return nil
	}
}

// grant is a grant the client holds.
type grant struct {
	id, epoch uint64
	units     int64        // micro-units
	left      atomic.Int64 // micro-units not spent; closedLeft once retired
	low       int64        // prefetch the next grant below this
	deadline  int64        // client clock (ns since Client.base): spending stops
	ttl       int64        // ns, as granted
	reportTo  string

	// Owned by the client's loop.
	reported   int64 // spend last reported
	lastReport int64
	lastLeft   int64
	lastChange int64
}

// Lease is the client's holder state for one descriptor of a leased
// policy. It is safe for concurrent use. Get it with [Client.Lease].
type Lease struct {
	c    *Client
	key  string
	desc map[string]string

	slots    [2]atomic.Pointer[grant] // the current grant and the next
	rotate   atomic.Bool              // a spend found the current grant short
	fetching atomic.Bool              // a prefetch is queued or running

	mu          sync.Mutex
	done        chan struct{} // an acquire is in flight
	policy      string
	revision    uint64
	deniedUntil int64 // local denials until (client clock)
	remoteUntil int64 // decide remotely until
	// exhausted: the nodes' last answer was "exhausted" (the key's
	// limits lacked the units); while the next ask is in flight,
	// decisions are denied here rather than wait for it.
	exhausted bool
	lastCost  int64 // micro-units of the last Decide: a grant holding less is used up
	lastSlow  int64 // the last Decide that found no grant
	lastUse   int64 // the last spend seen by the loop or the slow path
	closed    bool
}

// Lease returns the holder state of descriptor d (one per descriptor;
// created when missing). It needs [Leasing]; d is copied.
func (c *Client) Lease(d map[string]string) (*Lease, error) {
	if c.opts.holder == "" {
		return nil, errors.New("limitmesh client: leasing is off (the Leasing option)")
	}
	if len(d) == 0 {
		return nil, fmt.Errorf("%w: empty descriptor", ErrInvalidRequest)
	}
	return c.lease(descriptorKey(d), d), nil
}

// lease returns key's Lease, made for d when missing.
func (c *Client) lease(key string, d map[string]string) *Lease {
	c.lmu.RLock()
	l := c.leases[key]
	c.lmu.RUnlock()
	if l != nil {
		return l
	}
	c.lmu.Lock()
	defer c.lmu.Unlock()
	if l = c.leases[key]; l == nil {
		cp := make(map[string]string, len(d))
		for k, v := range d {
			cp[k] = v
		}
		l = &Lease{c: c, key: key, desc: cp}
		c.leases[key] = l
		c.startLoop()
	}
	return l
}

// mono is the client's clock: ns since the client was made.
func (c *Client) mono() int64 { return int64(c.opts.now().Sub(c.base)) }

// clockTick is how often the coarse clock of the spend path advances.
const clockTick = time.Millisecond

// fastNow is the spend path's reading of the client's clock. A clock read
// costs a few hundred ns on some virtual machines, more than a spend, so
// with the default clock the spend path reads an instant the client's
// loop advances every millisecond (coarse): a spend then stops at most a
// tick, plus any stall of that goroutine, after its grant's deadline,
// within the skew margin the owner adds after a grant's expiry (a tenth of
// the ttl: 200 ms for the default 2 s). A client with its own Clock reads
// it on every spend.
func (c *Client) fastNow() int64 {
	if c.coarseOn {
		return c.coarse.Load() + int64(clockTick)
	}
	return c.mono()
}

// Spend spends cost whole units (1..[MaxCost]) from the grants held, if
// one holds them and has not reached its deadline. It is the fast path:
// no allocation and no lock. false means no grant held the cost now: use
// [Lease.Decide], which asks for a grant or decides remotely.
func (l *Lease) Spend(cost int64) bool {
	if cost < 1 || cost > MaxCost {
		return false
	}
	_, ok := l.spend(cost*1_000_000, l.c.fastNow())
	return ok
}

// SpendMicro is Spend of a cost in micro-units (1e-6 of a unit).
func (l *Lease) SpendMicro(micro int64) bool {
	if micro < 1 || micro > MaxCost*1_000_000 {
		return false
	}
	_, ok := l.spend(micro, l.c.fastNow())
	return ok
}

// spend spends micro from the current grant, else the next; it returns
// what the grant spent holds after it.
func (l *Lease) spend(micro, now int64) (int64, bool) {
	for i := range l.slots {
		g := l.slots[i].Load()
		if g == nil || now >= g.deadline {
			continue
		}
		v := g.left.Add(-micro)
		if v < 0 {
			g.left.Add(micro)
			continue
		}
		if i == 1 && !l.rotate.Load() {
			l.rotate.Store(true)
		}
		if v < g.low && !l.fetching.Load() {
			l.c.kick(l)
		}
		return v, true
	}
	return 0, false
}

// Decide decides a request of cost whole units (or the [Cost] option's
// decimal) of l's descriptor: from a grant held (Source [SourceLease]),
// or after asking the nodes for one, or denied locally while the nodes say
// the key's limits lack the units (SourceLease, with RetryAfter), or
// remotely (strict) when no grant can be had. Requests with [RequestID] or
// [DryRun] are decided remotely.
func (l *Lease) Decide(ctx context.Context, cost int64, opts ...DecideOption) (*Result, error) {
	var o decideOptions
	for _, opt := range opts {
		opt(&o)
	}
	micro := cost * 1_000_000
	if o.cost != "" {
		m, err := ParseCost(o.cost)
		if err != nil {
			return nil, err
		}
		micro = m
	} else if cost < 1 || cost > MaxCost {
		return nil, fmt.Errorf("%w: cost %d not in [1, %d]", ErrInvalidRequest, cost, MaxCost)
	}
	if o.requestID == "" && !o.dryRun {
		for attempt := 0; attempt < 2; attempt++ {
			now := l.c.mono()
			if left, ok := l.spend(micro, now); ok {
				return l.local(true, left, 0), nil
			}
			l.mu.Lock()
			l.lastSlow, l.lastUse, l.lastCost = now, now, micro
			denied, remote, retry := now < l.deniedUntil, now < l.remoteUntil, l.deniedUntil-now
			if !denied && l.exhausted && l.done != nil {
				denied, retry = true, int64(time.Millisecond)
			}
			l.mu.Unlock()
			if denied {
				return l.local(false, 0, retry), nil
			}
			if remote || attempt > 0 {
				break
			}
			l.acquire(ctx, micro)
		}
	}
	return l.c.decide(ctx, l.desc, cost, opts...)
}

// local is the Result of a decision made from the grants.
func (l *Lease) local(allowed bool, left, retry int64) *Result {
	l.mu.Lock()
	r := &Result{Allowed: allowed, Policy: l.policy, Revision: l.revision, Remaining: microDecimal(max(left, 0)), Source: SourceLease}
	l.mu.Unlock()
	if !allowed {
		r.RetryAfter = ceilMs(retry)
	}
	return r
}

// Policy returns the name and revision of the leased policy the nodes
// named in their last answer for l's descriptor ("" before one).
func (l *Lease) Policy() (string, uint64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.policy, l.revision
}

// Held returns the micro-units l's grants hold now (for tests and
// monitoring).
func (l *Lease) Held() int64 {
	now := l.c.mono()
	var sum int64
	for i := range l.slots {
		if g := l.slots[i].Load(); g != nil && now < g.deadline {
			sum += max(g.left.Load(), 0)
		}
	}
	return sum
}

// leaseReply is the nodes' answer on the lease subjects (docs/protocol.md).
type leaseReply struct {
	Result     string `json:"result"`
	Policy     string `json:"policy"`
	Revision   uint64 `json:"revision"`
	Grant      uint64 `json:"grant"`
	Epoch      uint64 `json:"epoch"`
	Units      int64  `json:"units"`
	TTL        int64  `json:"ttl_ns"`
	RetryAfter int64  `json:"retry_after_ns"`
	ReportTo   string `json:"report_to"`
}

// acquire asks the nodes for a grant of at least least micro-units, or
// waits for the acquire in flight; bounded by ctx (or the client's
// Timeout).
func (l *Lease) acquire(ctx context.Context, least int64) {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return
	}
	if d := l.done; d != nil {
		l.mu.Unlock()
		select {
		case <-d:
		case <-ctx.Done():
		}
		return
	}
	done := make(chan struct{})
	l.done = done
	l.mu.Unlock()
	defer func() {
		l.mu.Lock()
		l.done = nil
		l.mu.Unlock()
		close(done)
		l.fetching.Store(false)
	}()
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, l.c.opts.timeout)
		defer cancel()
	}
	body := append([]byte(`{"op":"acquire","holder":`), wire.AppendString(nil, l.c.opts.holder)...)
	body = append(body, `,"min":`...)
	body = strconv.AppendInt(body, least, 10)
	body = append(body, `,"descriptor":{`...)
	first := true
	for k, v := range l.desc {
		if !first {
			body = append(body, ',')
		}
		first = false
		body = wire.AppendString(body, k)
		body = append(body, ':')
		body = wire.AppendString(body, v)
	}
	body = append(body, "}}"...)
	sent := l.c.mono()
	msg, err := l.c.nc.RequestWithContext(ctx, l.c.opts.prefix+".v1.lease", body)
	now := l.c.mono()
	var r leaseReply
	if err == nil {
		err = json.Unmarshal(msg.Data, &r)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if r.Policy != "" {
		l.policy, l.revision = r.Policy, r.Revision
	}
	switch {
	case l.closed && err == nil && r.Result == "granted" && r.ReportTo != "":
		g := &grant{id: r.Grant, epoch: r.Epoch, units: r.Units, reportTo: r.ReportTo}
		g.left.Store(r.Units)
		l.c.retire(g) // closed meanwhile: give it back
	case err != nil:
		// No node answers the lease subject (or the reply is garbage):
		// decide remotely for a while.
		backoff := leaseRecheck
		if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, nats.ErrTimeout) {
			backoff = leaseRemoteBackoff
		}
		l.remoteUntil = now + int64(backoff)
	case r.Result == "granted" && r.Units > 0 && r.TTL > 0 && r.ReportTo != "":
		g := &grant{id: r.Grant, epoch: r.Epoch, units: r.Units, low: r.Units / 2, ttl: r.TTL,
			deadline: sent + r.TTL - r.TTL/10, reportTo: r.ReportTo, lastLeft: r.Units, lastChange: now}
		g.left.Store(r.Units)
		l.deniedUntil, l.remoteUntil, l.exhausted = 0, 0, false
		l.install(g)
	case r.Result == "exhausted" && r.RetryAfter > 0:
		l.deniedUntil = now + min(r.RetryAfter, int64(leaseMaxDeny))
		l.exhausted = true
	case r.Result == "not_leased":
		l.remoteUntil = now + int64(leaseRecheck)
	default: // remote, exhausted for ever (never), bad_request
		l.remoteUntil = now + int64(leaseRemoteBackoff)
		l.exhausted = false
	}
}

// prefetchMin is the least a prefetched grant must hold: the last cost
// decided (a unit before any).
func (l *Lease) prefetchMin() int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.lastCost > 0 {
		return l.lastCost
	}
	return 1_000_000
}

// install puts g in a free slot, or returns it at once when both hold
// live grants; l.mu held.
func (l *Lease) install(g *grant) {
	now := l.c.mono()
	for i := range l.slots {
		if cur := l.slots[i].Load(); cur == nil || now >= cur.deadline || cur.left.Load() < max(l.lastCost, 1) {
			if cur != nil {
				l.c.retire(cur)
			}
			l.slots[i].Store(g)
			return
		}
	}
	l.c.retire(g)
}
