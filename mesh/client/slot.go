package client

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// Slot is a concurrency slot held by [Client.Acquire]: an open reservation
// that a goroutine of its own renews every third of its ttl until
// [Slot.Release]. It is safe for concurrent use.
//
// A slot can be lost without Release: when a renew finds its reservation
// expired (a 404: no renew got through for a whole ttl) or already ended
// by another caller's settle or release. Lost is then closed and Err says
// why; the service has already given the slot's units back.
type Slot struct {
	c      *Client
	res    Reservation
	ttl    time.Duration // asked for on renew (0: the service's default)
	cancel context.CancelFunc
	done   chan struct{} // closed when the renewer has returned
	lost   chan struct{}

	mu  sync.Mutex
	err error // why the slot was lost

	rel      sync.Mutex // serializes Release
	released bool
}

// Acquire reserves cost whole units (the [Cost] option gives a decimal)
// for descriptor d, typically in a policy with a concurrency limit
// (CONTRACT.md §10), and keeps the reservation open by renewing it with ttl
// (0: the service's default, [DefaultTTL]) until [Slot.Release].
// [RequestID] makes the acquisition idempotent; [DryRun] is not accepted.
//
// When the service denies, the Slot is nil and the Result explains
// (Policy, RetryAfter or Never); the error is nil. When admitted, the
// Result is the slot's decision. Errors are those of [Client.Reserve]:
// unavailability is returned, never masked by a failure behaviour. A slot
// admitted without a reservation (no policy matched the descriptor) holds
// nothing and renews nothing.
func (c *Client) Acquire(ctx context.Context, d map[string]string, cost int64, ttl time.Duration, opts ...DecideOption) (*Slot, *Result, error) {
	var o decideOptions
	for _, opt := range opts {
		opt(&o)
	}
	if o.dryRun {
		return nil, nil, fmt.Errorf("%w: a dry run acquires no slot", ErrInvalidRequest)
	}
	res, err := c.Reserve(ctx, d, cost, ttl, opts...)
	if err != nil {
		return nil, nil, err
	}
	if !res.Allowed {
		return nil, &res.Result, nil
	}
	s := &Slot{c: c, res: *res, ttl: ttl, done: make(chan struct{}), lost: make(chan struct{})}
	if res.ID == "" {
		close(s.done)
		s.cancel = func() {}
		return s, &s.res.Result, nil
	}
	bctx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	go s.renew(bctx, res.ExpiresIn)
	return s, &s.res.Result, nil
}

// ID returns the slot's reservation id ("" when it holds nothing).
func (s *Slot) ID() string { return s.res.ID }

// Lost returns a channel closed when the slot was lost (see [Slot]); it is
// never closed by Release.
func (s *Slot) Lost() <-chan struct{} { return s.lost }

// Err returns why the slot was lost: an error matching [ErrNotFound] when
// its reservation expired, or one naming the outcome that ended it. It is
// nil for a slot that was not lost (held, or released before).
func (s *Slot) Err() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

// renewInterval is a third of a reservation's ttl: the first renew comes
// after it, and two more chances remain before the reservation expires.
func renewInterval(expiresIn, ttl time.Duration) time.Duration {
	switch {
	case expiresIn > 0:
	case ttl > 0:
		expiresIn = ttl
	default:
		expiresIn = DefaultTTL
	}
	return max(expiresIn/3, time.Millisecond)
}

// renew renews the reservation every third of its ttl until ctx is
// cancelled (Release) or the reservation is gone. A renew that gets no
// answer is tried again at the next tick, before the reservation expires.
func (s *Slot) renew(ctx context.Context, expiresIn time.Duration) {
	defer close(s.done)
	t := time.NewTimer(renewInterval(expiresIn, s.ttl))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		rctx, cancel := context.WithTimeout(ctx, s.c.opts.timeout)
		st, err := s.c.Renew(rctx, s.res.ID, s.ttl)
		cancel()
		var lost error
		switch {
		case ctx.Err() != nil:
			return
		case errors.Is(err, ErrNotFound):
			lost = fmt.Errorf("limitmesh slot %s: %w", s.res.ID, err)
		case err != nil:
		case st.Outcome != OutcomeRenewed:
			lost = fmt.Errorf("limitmesh slot %s: reservation already %s", s.res.ID, st.Outcome)
		default:
			expiresIn = st.ExpiresIn
		}
		if lost != nil {
			s.mu.Lock()
			s.err = lost
			s.mu.Unlock()
			close(s.lost)
			return
		}
		t.Reset(renewInterval(expiresIn, s.ttl))
	}
}

// Release stops renewing and releases the slot's reservation, giving its
// units back. It is idempotent: once a release succeeded (or found the
// reservation already expired or ended), later calls return nil without a
// request. When the release gets no answer it returns the error and may be
// called again; the slot then ends at its expiry at the latest.
func (s *Slot) Release(ctx context.Context) error {
	s.rel.Lock()
	defer s.rel.Unlock()
	if s.released {
		return nil
	}
	s.cancel()
	<-s.done
	if s.res.ID != "" {
		if _, err := s.c.Release(ctx, s.res.ID); err != nil && !errors.Is(err, ErrNotFound) {
			return err
		}
	}
	s.released = true
	return nil
}
