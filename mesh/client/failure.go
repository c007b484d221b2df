package client

import (
	"container/list"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/limitmesh/limitmesh/internal/wire"
)

// DefaultMaxEmergencyBuckets is the default bound on the number of descriptor
// keys the client remembers (emergency buckets and last policies), see
// [MaxEmergencyBuckets].
const DefaultMaxEmergencyBuckets = 10_000

// FailClosedRetryAfter is the RetryAfter of a [FailClosed] denial: the
// client cannot know when the service will be back.
const FailClosedRetryAfter = time.Second

type failureKind uint8

const (
	failNone failureKind = iota
	failClosed
	failOpenBucket
)

// A Failure is what the client does when it gets no decision from the
// service (timeout, no responders, 503, closed connection): see
// [OnUnavailable]. The zero Failure returns the error to the caller.
type Failure struct {
	kind      failureKind
	perSecond int64 // emergency refill, whole units per second
	burst     int64 // emergency capacity, whole units
}

// ReturnError is the Failure that applies no failure behaviour: Decide
// returns the unavailability error. It is the zero Failure.
func ReturnError() Failure { return Failure{} }

// FailClosed denies: Decide returns a Result with Allowed false, Source
// [SourceFailClosed], RetryAfter [FailClosedRetryAfter], Err the cause, and
// a nil error.
func FailClosed() Failure { return Failure{kind: failClosed} }

// FailOpenBucket admits from a local emergency token bucket per descriptor
// key that holds at most burst units and refills perSecond units per second
// (both whole units, 1..MaxCost): bounded, never unlimited. A bucket starts
// full when the outage is first seen for its key and lives, with the
// descriptor key's other state, in a bounded LRU ([MaxEmergencyBuckets]).
// Results have Source [SourceEmergency] and Err the cause. Parameters out of
// range make the failure behave as [FailClosed].
//
// Each gateway process has its own buckets: n gateways admit up to n times
// the emergency envelope during an outage (§12).
func FailOpenBucket(perSecond, burst int64) Failure {
	if perSecond < 1 || perSecond > MaxCost || burst < 1 || burst > MaxCost {
		return FailClosed()
	}
	return Failure{kind: failOpenBucket, perSecond: perSecond, burst: burst}
}

// emergencyBucket is an exact token bucket in nano-units (1e-9 unit):
// credit(now) = min(burst*1e9, credit + (now-last)*perSecond).
type emergencyBucket struct {
	perSecond int64 // units/s = nano-units/ns
	capacity  int64 // nano-units (burst*1e9 <= 1e18)
	credit    int64 // nano-units at last
	last      int64 // ns
}

// take decides cost (micro-units) at now (ns): the admission, the remaining
// credit after it (micro-units, rounded down), the wait until cost could be
// admitted (ns, rounded up; never when cost exceeds the capacity) and the
// time until the bucket is full (ns, rounded up).
func (b *emergencyBucket) take(now, cost int64) (ok bool, remaining, retry int64, never bool, reset int64) {
	if now > b.last {
		// Elapsed time is capped at time-to-full, so the product cannot overflow.
		elapsed := now - b.last
		if full := (b.capacity - b.credit + b.perSecond - 1) / b.perSecond; elapsed > full {
			elapsed = full
		}
		b.credit = min(b.capacity, b.credit+elapsed*b.perSecond)
		b.last = now
	}
	need := cost * 1000 // micro -> nano; cost <= 1e15 micro
	if need <= b.credit {
		b.credit -= need
		ok = true
	} else if need > b.capacity {
		never = true
	} else {
		retry = (need - b.credit + b.perSecond - 1) / b.perSecond
	}
	remaining = b.credit / 1000
	reset = (b.capacity - b.credit + b.perSecond - 1) / b.perSecond
	return
}

// keyState is what the client remembers about one descriptor key.
type keyState struct {
	key    string
	policy string // the policy that last decided this key ("" unknown)
	bucket emergencyBucket
	hasBkt bool
}

// keyCache is a mutex-guarded LRU of keyState, bounded by max entries.
type keyCache struct {
	mu    sync.Mutex
	max   int
	ll    *list.List // of *keyState, most recent at the front
	items map[string]*list.Element
}

func newKeyCache(max int) *keyCache {
	return &keyCache{max: max, ll: list.New(), items: make(map[string]*list.Element)}
}

// get returns the state of key, creating it (and evicting the least
// recently used entry beyond max). The caller holds c.mu.
func (c *keyCache) get(key string) *keyState {
	if e, ok := c.items[key]; ok {
		c.ll.MoveToFront(e)
		return e.Value.(*keyState)
	}
	ks := &keyState{key: key}
	c.items[key] = c.ll.PushFront(ks)
	for c.ll.Len() > c.max {
		last := c.ll.Back()
		c.ll.Remove(last)
		delete(c.items, last.Value.(*keyState).key)
	}
	return ks
}

// remember records the policy that decided key.
func (c *keyCache) remember(key, policy string) {
	c.mu.Lock()
	ks := c.get(key)
	ks.policy = policy
	c.mu.Unlock()
}

// policy returns the policy that last decided key ("" if unknown), without
// creating an entry.
func (c *keyCache) policy(key string) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.items[key]; ok {
		return e.Value.(*keyState).policy
	}
	return ""
}

// len returns the number of remembered keys.
func (c *keyCache) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.ll.Len()
}

// take spends cost micro-units at now (ns) from key's emergency bucket with
// the parameters of f, creating the bucket full. A change of parameters
// keeps the credit, clamped to the new capacity.
func (c *keyCache) take(key string, f Failure, now, cost int64) (r Result) {
	c.mu.Lock()
	defer c.mu.Unlock()
	ks := c.get(key)
	b := &ks.bucket
	capacity := f.burst * 1_000_000_000
	if !ks.hasBkt {
		*b = emergencyBucket{perSecond: f.perSecond, capacity: capacity, credit: capacity, last: now}
		ks.hasBkt = true
	} else if b.perSecond != f.perSecond || b.capacity != capacity {
		b.perSecond, b.capacity = f.perSecond, capacity
		b.credit = min(b.credit, capacity)
	}
	ok, remaining, retry, never, reset := b.take(now, cost)
	r.Allowed = ok
	r.Policy = ks.policy
	r.Remaining = microDecimal(remaining)
	r.Never = never
	r.RetryAfter = ceilMs(retry)
	r.ResetAfter = ceilMs(reset)
	r.Source = SourceEmergency
	return r
}

// ceilMs rounds ns up to whole milliseconds, like the service's _ms fields.
func ceilMs(ns int64) time.Duration {
	return time.Duration((ns+int64(time.Millisecond)-1)/int64(time.Millisecond)) * time.Millisecond
}

// microDecimal formats micro-units as a Decimal.
func microDecimal(m int64) Decimal { return Decimal(wire.FormatUnits(m)) }

// descriptorKey is an injective encoding of a descriptor: its names sorted,
// each name and value length-prefixed.
func descriptorKey(d map[string]string) string {
	names := make([]string, 0, len(d))
	n := 0
	for k, v := range d {
		names = append(names, k)
		n += len(k) + len(v) + 8
	}
	sort.Strings(names)
	b := make([]byte, 0, n)
	for _, k := range names {
		v := d[k]
		b = strconv.AppendInt(b, int64(len(k)), 10)
		b = append(b, ':')
		b = append(b, k...)
		b = strconv.AppendInt(b, int64(len(v)), 10)
		b = append(b, ':')
		b = append(b, v...)
	}
	return string(b)
}
