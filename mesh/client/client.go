package client

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
)

// DefaultPrefix is the default subject prefix: requests go to "rl.v1.decide".
const DefaultPrefix = "rl"

// DefaultTimeout is the request timeout applied when the context has no deadline.
const DefaultTimeout = 250 * time.Millisecond

// options is the configuration New builds from Options.
type options struct {
	prefix        string
	timeout       time.Duration
	onUnavailable func(policy string, descriptor map[string]string) Failure
	now           func() time.Time
	maxKeys       int
	hints         int
	holder        string // leasing: this gateway's holder name ("" = off)
	customClock   bool   // Clock was given
}

// An Option configures a Client in [New].
type Option func(*options) error

var prefixRE = regexp.MustCompile(`^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$`)

// Prefix sets the subject prefix (default [DefaultPrefix]): requests go to
// "<prefix>.v1.decide". It must be NATS subject tokens without wildcards.
func Prefix(p string) Option {
	return func(o *options) error {
		if !prefixRE.MatchString(p) {
			return fmt.Errorf("limitmesh client: invalid prefix %q", p)
		}
		o.prefix = p
		return nil
	}
}

// Timeout sets the request timeout used when Decide's context has no
// deadline (default [DefaultTimeout]). It must be positive.
func Timeout(d time.Duration) Option {
	return func(o *options) error {
		if d <= 0 {
			return fmt.Errorf("limitmesh client: timeout %v must be positive", d)
		}
		o.timeout = d
		return nil
	}
}

// OnUnavailable sets the failure behaviour (§26) for requests that get no
// decision: a timeout, no responders, a 503 answer or a closed connection.
// fn is called with the descriptor and the name of the policy that last
// decided it ("" if this client has not seen one), so the behaviour can be
// chosen per policy or per descriptor; it returns [FailClosed],
// [FailOpenBucket] or [ReturnError]. fn must be safe for concurrent use and
// fast. Errors not caused by unavailability (invalid request, internal,
// malformed reply, cancelled context) are never masked.
//
// Without OnUnavailable, Decide returns the unavailability error.
func OnUnavailable(fn func(policy string, descriptor map[string]string) Failure) Option {
	return func(o *options) error {
		o.onUnavailable = fn
		return nil
	}
}

// Clock sets the clock of the emergency buckets and of the grants held
// with [Leasing] (default time.Now); tests inject a fake one. A custom
// clock is read on every spend of a grant; the default one is read by the
// spend path through a coarse copy advanced every millisecond.
func Clock(now func() time.Time) Option {
	return func(o *options) error {
		if now == nil {
			return errors.New("limitmesh client: nil clock")
		}
		o.now = now
		o.customClock = true
		return nil
	}
}

// MaxEmergencyBuckets bounds the number of descriptor keys the client
// remembers for its failure behaviour (emergency buckets and last
// policies), evicting the least recently used (default
// [DefaultMaxEmergencyBuckets]).
func MaxEmergencyBuckets(n int) Option {
	return func(o *options) error {
		if n < 1 {
			return fmt.Errorf("limitmesh client: max emergency buckets %d must be positive", n)
		}
		o.maxKeys = n
		return nil
	}
}

// Client asks the limitmesh decide service for decisions over NATS. It is
// safe for concurrent use. Create it with [New].
type Client struct {
	nc      *nats.Conn
	subject string
	opts    options
	keys    *keyCache  // nil without OnUnavailable
	hints   *hintCache // nil with PartitionHints(0)
	bufs    sync.Pool  // *[]byte request buffers

	// The reservation endpoints (reserve.go): "<prefix>.v1.reserve" etc.
	reserveSubject, settleSubject, releaseSubject, renewSubject string

	// Leasing (lease.go).
	base        time.Time // origin of the client's clock
	lmu         sync.RWMutex
	leases      map[string]*Lease // by descriptor key
	kicks       chan *Lease       // prefetch requests of the spend path
	loopStop    chan struct{}     // nil: the loop is not running
	loopDone    chan struct{}
	bg          sync.WaitGroup // acquires, reports and returns in flight
	lostReturns atomic.Int64
	coarseOn    bool         // the spend path reads coarse (the default clock)
	coarse      atomic.Int64 // the client's clock, advanced by the loop every clockTick
}

// New returns a Client that sends requests on nc. The connection stays
// owned by the caller (the Client never closes it).
func New(nc *nats.Conn, opts ...Option) (*Client, error) {
	if nc == nil {
		return nil, errors.New("limitmesh client: nil connection")
	}
	o := options{prefix: DefaultPrefix, timeout: DefaultTimeout, now: time.Now, maxKeys: DefaultMaxEmergencyBuckets,
		hints: DefaultPartitionHints}
	for _, opt := range opts {
		if err := opt(&o); err != nil {
			return nil, err
		}
	}
	c := &Client{nc: nc, subject: o.prefix + ".v1.decide", opts: o, base: o.now(),
		leases: make(map[string]*Lease), kicks: make(chan *Lease, 1024), coarseOn: !o.customClock,
		reserveSubject: o.prefix + ".v1.reserve", settleSubject: o.prefix + ".v1.settle",
		releaseSubject: o.prefix + ".v1.release", renewSubject: o.prefix + ".v1.renew"}
	if o.onUnavailable != nil {
		c.keys = newKeyCache(o.maxKeys)
	}
	if o.hints > 0 {
		c.hints = newHintCache(o.hints)
	}
	c.bufs.New = func() any { b := make([]byte, 0, 512); return &b }
	return c, nil
}

// Subject returns the subject requests are sent to, e.g. "rl.v1.decide".
func (c *Client) Subject() string { return c.subject }

// Decide asks whether a request with descriptor d and cost whole units
// (1..[MaxCost]; the [Cost] option gives a decimal cost instead) is admitted.
//
// Outcomes:
//   - decided by the service: a *Result and a nil error; a denial is
//     Result.Allowed == false (RetryAfter, Never tell when to retry);
//   - invalid request (400, 413, or rejected locally): an error matching
//     [ErrInvalidRequest] (a *[ServiceError] when the service answered);
//   - internal (500): [ErrInternal]; undecodable reply: [ErrBadReply];
//   - no decision (timeout: [ErrTimeout]; no responders: [ErrNoResponders];
//     503 or closed connection: [ErrUnavailable]): the failure behaviour of
//     [OnUnavailable] decides (a Result with Source != SourceService and a
//     nil error), or without one the error is returned;
//   - ctx cancelled: the context's error.
//
// The request timeout is ctx's deadline, or the client's [Timeout] when ctx
// has none.
//
// With [Leasing], a descriptor is decided by its [Lease] ([Lease.Decide]):
// a leased policy's decisions are spent from grants the client holds
// (Source [SourceLease]); other policies' are decided remotely as above.
func (c *Client) Decide(ctx context.Context, d map[string]string, cost int64, opts ...DecideOption) (*Result, error) {
	if c.opts.holder != "" && len(d) > 0 {
		return c.lease(descriptorKey(d), d).Decide(ctx, cost, opts...)
	}
	return c.decide(ctx, d, cost, opts...)
}

// decide is Decide without leasing: one request to the decide service.
func (c *Client) decide(ctx context.Context, d map[string]string, cost int64, opts ...DecideOption) (*Result, error) {
	var o decideOptions
	for _, opt := range opts {
		opt(&o)
	}
	micro, err := checkRequest(d, cost, &o)
	if err != nil {
		return nil, err
	}

	bp := c.bufs.Get().(*[]byte)
	body := appendRequest((*bp)[:0], d, cost, &o)
	rctx := ctx
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		rctx, cancel = context.WithTimeout(ctx, c.opts.timeout)
		defer cancel()
	}
	// With a remembered partition, go straight to its owner; if no node
	// owns it (a move, a dead owner) fall back to the decide subject, which
	// any node answers, and forget the hint.
	var hkey string
	subject := c.subject
	if c.hints != nil {
		hkey = descriptorKey(d)
		if s := c.hints.subject(hkey); s != "" {
			subject = s
		}
	}
	msg, err := c.nc.RequestWithContext(rctx, subject, body)
	if subject != c.subject && errors.Is(err, nats.ErrNoResponders) {
		c.hints.forget(hkey)
		msg, err = c.nc.RequestWithContext(rctx, c.subject, body)
	}
	// The body was copied into the connection's buffer by the publish.
	*bp = body
	c.bufs.Put(bp)

	if err != nil {
		err = c.mapError(ctx, err)
		if IsUnavailable(err) {
			return c.fail(d, micro, err)
		}
		return nil, err
	}
	r, hint, err := decodeReplyHint(msg.Header, msg.Data)
	if err != nil {
		if IsUnavailable(err) { // 503
			return c.fail(d, micro, fmt.Errorf("limitmesh client: %w", err))
		}
		return nil, fmt.Errorf("limitmesh client: %w", err)
	}
	if c.hints != nil {
		if hint != "" {
			c.hints.remember(hkey, c.opts.prefix, hint)
		}
	}
	if c.keys != nil && r.Policy != "" && !o.dryRun {
		c.keys.remember(descriptorKey(d), r.Policy)
	}
	return r, nil
}

// checkRequest checks a decide or reserve request before it is sent and
// returns its cost in micro-units: the decimal of the Cost option, else
// cost whole units. Errors wrap ErrInvalidRequest.
func checkRequest(d map[string]string, cost int64, o *decideOptions) (int64, error) {
	if len(d) == 0 {
		return 0, fmt.Errorf("%w: empty descriptor", ErrInvalidRequest)
	}
	if o.cost != "" {
		return ParseCost(o.cost)
	}
	if cost < 1 || cost > MaxCost {
		return 0, fmt.Errorf("%w: cost %d not in [1, %d]", ErrInvalidRequest, cost, MaxCost)
	}
	return cost * 1_000_000, nil
}

// mapError maps a request error of nats.go to the client's errors. ctx is
// the caller's context (not the one with the client's timeout).
func (c *Client) mapError(ctx context.Context, err error) error {
	switch {
	case errors.Is(err, nats.ErrNoResponders):
		return fmt.Errorf("limitmesh client: %w: %w", ErrNoResponders, err)
	case errors.Is(err, context.Canceled) && ctx.Err() != nil:
		return fmt.Errorf("limitmesh client: %w", err)
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, nats.ErrTimeout):
		return fmt.Errorf("limitmesh client: %w: %w", ErrTimeout, err)
	case errors.Is(err, nats.ErrConnectionClosed), errors.Is(err, nats.ErrDisconnected),
		errors.Is(err, nats.ErrConnectionDraining):
		return fmt.Errorf("limitmesh client: %w: %w", ErrUnavailable, err)
	}
	return fmt.Errorf("limitmesh client: %w", err)
}

// fail applies the failure behaviour to an unavailability error cause.
func (c *Client) fail(d map[string]string, cost int64, cause error) (*Result, error) {
	if c.keys == nil {
		return nil, cause
	}
	key := descriptorKey(d)
	policy := c.keys.policy(key)
	f := c.opts.onUnavailable(policy, d)
	switch f.kind {
	case failClosed:
		return &Result{Allowed: false, Policy: policy, Remaining: "0", RetryAfter: FailClosedRetryAfter,
			Source: SourceFailClosed, Err: cause}, nil
	case failOpenBucket:
		r := c.keys.take(key, f, c.opts.now().UnixNano(), cost)
		r.Err = cause
		return &r, nil
	}
	return nil, cause
}
