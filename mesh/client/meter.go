package client

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"
)

// Meter meters a stream whose units are produced one after another (the
// tokens of a streamed response, the bytes of an upload) against a
// descriptor's limits (CONTRACT.md §10, the reference's §24): it reserves
// units a chunk at a time ahead of the stream and settles each chunk with
// what the stream used, so that the limits see the stream while it runs
// and the stream stops cleanly when they are exhausted. Create it with
// [NewMeter]; always [Meter.Close] it.
//
// Accounting is exact: the units settled over a meter's life equal the
// units its successful [Meter.Add] calls recorded, provided every settle is
// answered (Close reports any that was not; such a chunk's reservation
// counts at its reserved cost in rate, window and quota limits when it
// expires).
//
// A Meter is safe for concurrent use; its calls are serialized.
type Meter struct {
	c     *Client
	d     map[string]string
	chunk int64
	ttl   time.Duration
	tag   string // request id prefix: the meter's reserves are idempotent

	mu      sync.Mutex
	open    bool      // a chunk is open
	id      string    // its reservation ("" when it holds nothing: no policy matched)
	held    int64     // its size, in units
	used    int64     // its units the stream used
	renewAt time.Time // by the client's clock: when Add renews it
	total   int64     // units recorded by Add
	seq     uint64    // request ids issued

	// A reserve that got no answer may have been granted: the next Add (or
	// Close, to release it) asks again with the same request id and size.
	retrying  bool
	retryID   string
	retrySize int64

	pending []settle // settles not answered yet, retried by Add and Close
	err     error    // why the meter stopped (a denial, a lost chunk)
	closing bool
}

// settle is a settle a meter owes: cost units of reservation id
// (SettleReserved: the whole chunk; 0: a release).
type settle struct {
	id   string
	cost int64
}

// NewMeter returns a meter of descriptor d that reserves chunk whole units
// (1..[MaxCost]) at a time, each for ttl (0: the service's default,
// [DefaultTTL]; at most [MaxTTL]). A chunk is renewed by [Meter.Add] once
// half its ttl has passed (by the client's [Clock]); a stream that adds
// nothing for a whole ttl loses its open chunk.
func NewMeter(c *Client, d map[string]string, chunk int64, ttl time.Duration) (*Meter, error) {
	switch {
	case c == nil:
		return nil, errors.New("limitmesh meter: nil client")
	case len(d) == 0:
		return nil, fmt.Errorf("%w: empty descriptor", ErrInvalidRequest)
	case chunk < 1 || chunk > MaxCost:
		return nil, fmt.Errorf("%w: chunk %d not in [1, %d]", ErrInvalidRequest, chunk, MaxCost)
	}
	if err := checkTTL(ttl); err != nil {
		return nil, err
	}
	dd := make(map[string]string, len(d))
	for k, v := range d {
		dd[k] = v
	}
	return &Meter{c: c, d: dd, chunk: chunk, ttl: ttl, tag: "meter-" + rand.Text()}, nil
}

// Add records units (0..[MaxCost]) the stream produced. When the open
// chunk holds them they are counted against it (renewing it once half its
// ttl has passed). Otherwise Add reserves the next chunk, of the meter's
// chunk size or of what overflows the open chunk if that is larger, and on
// success fills the open chunk and settles it in full; the rest of the
// units start the new chunk.
//
// Add records all the units or none:
//   - the next chunk is denied: a *[ChunkDeniedError] (errors.Is
//     [ErrChunkDenied]) with the service's Result; the open chunk is
//     settled with what the stream used before this call, and the meter
//     has stopped: later calls return the same error;
//   - the open chunk was lost (it expired, or another caller ended its
//     reservation): an error (matching [ErrNotFound] when it expired), and
//     the meter has stopped; an expired chunk counts at its reserved cost;
//   - no answer (unavailability, ctx done): the error; nothing changed, and
//     a later Add asks for the same chunk again idempotently;
//   - after Close: [ErrMeterClosed].
func (m *Meter) Add(ctx context.Context, units int64) error {
	if units < 0 || units > MaxCost {
		return fmt.Errorf("%w: units %d not in [0, %d]", ErrInvalidRequest, units, MaxCost)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	switch {
	case m.closing:
		return ErrMeterClosed
	case m.err != nil:
		return m.err
	case units == 0:
		return nil
	}
	if m.open && m.used+units <= m.held {
		if err := m.keepAlive(ctx); err != nil {
			return err
		}
		m.used += units
		m.total += units
		return nil
	}
	over := units
	if m.open {
		over -= m.held - m.used
	}
	if err := m.next(ctx, over); err != nil {
		return err
	}
	m.total += units
	return nil
}

// Start reserves the meter's first chunk now, if no chunk is open, so that
// a stream is denied before it produces anything. It is optional: Add
// reserves a chunk when it needs one. Errors as for Add.
func (m *Meter) Start(ctx context.Context) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	switch {
	case m.closing:
		return ErrMeterClosed
	case m.err != nil:
		return m.err
	case m.open:
		return nil
	}
	return m.next(ctx, 0)
}

// next reserves the next chunk, of the meter's chunk size or over units if
// that is larger; when granted, it settles the open chunk in full and the
// new one starts with over units used.
func (m *Meter) next(ctx context.Context, over int64) error {
	size := max(m.chunk, over)
	var rid string
	if m.retrying && over <= m.retrySize {
		rid, size = m.retryID, m.retrySize
	} else {
		m.seq++
		rid = m.tag + "." + strconv.FormatUint(m.seq, 10)
	}
	res, err := m.c.Reserve(ctx, m.d, size, m.ttl, RequestID(rid))
	if err != nil {
		if IsUnavailable(err) || ctx.Err() != nil {
			m.retrying, m.retryID, m.retrySize = true, rid, size
		}
		return err
	}
	m.retrying = false
	if !res.Allowed {
		m.err = &ChunkDeniedError{Result: res.Result, Units: size}
		m.owe(m.used)
		_ = m.flush(ctx) // what fails is retried by Close
		return m.err
	}
	m.owe(SettleReserved)
	_ = m.flush(ctx)
	m.open, m.id, m.held, m.used = true, res.ID, size, over
	m.renewAt = m.c.opts.now().Add(m.halfTTL(res.ExpiresIn))
	return nil
}

// Used returns the units the meter recorded (the sum of the successful
// Adds).
func (m *Meter) Used() int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.total
}

// Close settles what the open chunk used (releasing it when the stream
// used none of it) and every settle that was not answered before, and
// releases a chunk whose reserve got no answer, if it was granted. Errors
// (joined): settles still unanswered, which a later Close tries again, and
// chunks that expired before being settled (matching [ErrNotFound]: they
// counted at their reserved cost). A Close with nothing left to do returns
// nil.
func (m *Meter) Close(ctx context.Context) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.closing = true
	var errs []error
	if m.retrying {
		res, err := m.c.Reserve(ctx, m.d, m.retrySize, m.ttl, RequestID(m.retryID))
		switch {
		case err != nil:
			errs = append(errs, err)
		default:
			m.retrying = false
			if res.ID != "" {
				m.pending = append(m.pending, settle{id: res.ID})
			}
		}
	}
	if m.open {
		m.owe(m.used)
	}
	if err := m.flush(ctx); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// owe ends the open chunk, owing its settle at cost.
func (m *Meter) owe(cost int64) {
	if m.open && m.id != "" {
		m.pending = append(m.pending, settle{id: m.id, cost: cost})
	}
	m.open, m.id = false, ""
}

// flush sends the settles (and releases) owed. Those not answered stay owed; a chunk
// found expired is forgotten, with an error unless it was owed in full
// (an expired reservation counts at its reserved cost).
func (m *Meter) flush(ctx context.Context) error {
	var errs []error
	keep := m.pending[:0]
	for _, s := range m.pending {
		var err error
		if s.cost == 0 {
			_, err = m.c.Release(ctx, s.id)
		} else {
			_, err = m.c.Settle(ctx, s.id, s.cost)
		}
		switch {
		case err == nil:
		case errors.Is(err, ErrNotFound):
			if s.cost != SettleReserved {
				errs = append(errs, fmt.Errorf("limitmesh meter: chunk %s expired before it was settled with %d units (it counted at its reserved cost): %w",
					s.id, s.cost, err))
			}
		default:
			keep = append(keep, s)
			errs = append(errs, err)
		}
	}
	clear(m.pending[len(keep):])
	m.pending = keep
	return errors.Join(errs...)
}

// keepAlive renews the open chunk once half its ttl has passed. A renew
// that gets no answer is tried again by the next Add (the chunk has half
// its ttl left); a chunk found gone stops the meter.
func (m *Meter) keepAlive(ctx context.Context) error {
	if m.id == "" {
		return nil
	}
	now := m.c.opts.now()
	if now.Before(m.renewAt) {
		return nil
	}
	st, err := m.c.Renew(ctx, m.id, m.ttl)
	switch {
	case errors.Is(err, ErrNotFound):
		m.err = fmt.Errorf("limitmesh meter: chunk %s expired (it counted at its reserved cost %d): %w", m.id, m.held, err)
	case err != nil:
		return nil
	case st.Outcome != OutcomeRenewed:
		m.err = fmt.Errorf("limitmesh meter: chunk %s already %s by another caller", m.id, st.Outcome)
	default:
		m.renewAt = now.Add(m.halfTTL(st.ExpiresIn))
		return nil
	}
	m.open, m.id = false, ""
	return m.err
}

// halfTTL is half a chunk's ttl: expiresIn from the service, else the
// meter's ttl or the default.
func (m *Meter) halfTTL(expiresIn time.Duration) time.Duration {
	switch {
	case expiresIn > 0:
	case m.ttl > 0:
		expiresIn = m.ttl
	default:
		expiresIn = DefaultTTL
	}
	return expiresIn / 2
}

// ChunkDeniedError is the error of [Meter.Add] when the service denied the
// meter's next chunk. It matches [ErrChunkDenied] with errors.Is.
type ChunkDeniedError struct {
	// Result is the denial: Policy, RetryAfter (or Never), Remaining.
	Result Result
	// Units is the size of the chunk that was asked for.
	Units int64
}

// Error implements error.
func (e *ChunkDeniedError) Error() string {
	s := "limitmesh meter: chunk of " + strconv.FormatInt(e.Units, 10) + " units denied"
	if e.Result.Policy != "" {
		s += " by policy " + strconv.Quote(e.Result.Policy)
	}
	switch {
	case e.Result.Never:
		s += " (never admissible)"
	case e.Result.RetryAfter > 0:
		s += " (retry after " + e.Result.RetryAfter.String() + ")"
	}
	return s
}

// Unwrap returns [ErrChunkDenied].
func (e *ChunkDeniedError) Unwrap() error { return ErrChunkDenied }
