package client

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/limitmesh/limitmesh/internal/wire"
)

// Reservations (CONTRACT.md §10): when a request's true cost is known only
// afterwards, or a limit counts work in flight, the caller reserves, works,
// then settles. The calls here are one request each to the endpoints
// "<prefix>.v1.reserve", ".settle", ".release" and ".renew". Unlike Decide
// they have no failure behaviour: when no answer comes they return the
// unavailability error ([ErrTimeout], [ErrNoResponders], [ErrUnavailable]),
// because a reservation nobody granted holds nothing to settle.

const (
	// DefaultTTL is the service's reservation ttl when none is given (a ttl
	// of 0 in [Client.Reserve], [Client.Renew], [Client.Acquire]).
	DefaultTTL = 30 * time.Second
	// MaxTTL is the longest ttl the contract accepts.
	MaxTTL = time.Hour
	// MaxReservationIDLen is the longest reservation id, in bytes.
	MaxReservationIDLen = 128
	// SettleReserved as Settle's cost settles the whole reserved cost (the
	// request carries no cost).
	SettleReserved int64 = -1
)

// Reservation is the answer to [Client.Reserve]: the decision (the same
// fields as Decide's [Result], Source always [SourceService]) and, when
// admitted, the reservation holding the cost until it is settled,
// released or expires.
type Reservation struct {
	Result
	// ID is the reservation's opaque id (at most 128 bytes), to settle,
	// release or renew it. It is "" when denied, for a dry run, and when the
	// service admitted without holding anything (no policy matched).
	ID string
	// ExpiresIn is the time until the reservation expires unless renewed
	// (whole milliseconds from the service; 0 without ID).
	ExpiresIn time.Duration
}

// Outcome is what a settle, release or renew did to a reservation.
type Outcome string

// The outcomes of the contract. Settling, releasing or renewing a
// reservation that already ended returns its ending outcome again
// (settled or released), whichever call it is.
const (
	OutcomeSettled  Outcome = "settled"
	OutcomeReleased Outcome = "released"
	OutcomeRenewed  Outcome = "renewed"
)

// Settlement is the answer to [Client.Settle], [Client.Release] and
// [Client.Renew].
type Settlement struct {
	// Reservation is the reservation's id.
	Reservation string
	// Outcome is what happened; for a reservation that had already ended,
	// its first ending outcome.
	Outcome Outcome
	// Settled is the units that stay spent; Returned the units given back
	// (both 0 for a renew).
	Settled, Returned Decimal
	// Remaining is the service's snapshot of the units left in the limit
	// with the least left, after the call.
	Remaining Decimal
	// ExpiresIn is the time until the reservation expires (renew only; 0
	// otherwise).
	ExpiresIn time.Duration
}

// Reserve asks to hold cost whole units (1..[MaxCost]; the [Cost] option
// gives a decimal cost) for descriptor d for ttl (0: the service's default,
// [DefaultTTL]; at most [MaxTTL]). [RequestID] makes it idempotent (a retry
// gets the same reservation); [DryRun] asks what a real reserve would get,
// holding nothing (no ID).
//
// Outcomes: admitted (a Reservation with Allowed true and, unless no
// policy matched, an ID to settle); denied (Allowed false, no ID,
// RetryAfter or Never as for Decide, and a nil error); otherwise the errors
// of Decide, without the failure behaviour: unavailability is returned as
// the error ([IsUnavailable]).
func (c *Client) Reserve(ctx context.Context, d map[string]string, cost int64, ttl time.Duration, opts ...DecideOption) (*Reservation, error) {
	var o decideOptions
	for _, opt := range opts {
		opt(&o)
	}
	if _, err := checkRequest(d, cost, &o); err != nil {
		return nil, err
	}
	if err := checkTTL(ttl); err != nil {
		return nil, err
	}
	body := appendRequest(make([]byte, 0, 256), d, cost, &o)
	if ttl > 0 {
		body = appendTTL(body[:len(body)-1], ttl)
		body = append(body, '}')
	}
	data, err := c.request(ctx, c.reserveSubject, body)
	if err != nil {
		return nil, err
	}
	r, err := decodeReservation(data)
	if err != nil {
		return nil, fmt.Errorf("limitmesh client: %w", err)
	}
	return r, nil
}

// Settle ends reservation id keeping cost whole units spent (0..the
// reserved cost; the [Cost] option gives a decimal, "0" allowed;
// [SettleReserved] keeps the whole reserved cost) and giving the rest back.
// Settling an ended reservation again returns its first outcome. No other
// DecideOption applies: [RequestID] or [DryRun] make it an invalid request.
//
// Errors: [ErrNotFound] (a *[ServiceError] with code 404) when the
// reservation is unknown or expired; [ErrInvalidRequest] for a cost above
// the reserved one or a malformed id; unavailability ([IsUnavailable]) and
// the others as for Decide.
func (c *Client) Settle(ctx context.Context, id string, cost int64, opts ...DecideOption) (*Settlement, error) {
	var o decideOptions
	for _, opt := range opts {
		opt(&o)
	}
	if o.requestID != "" || o.dryRun {
		return nil, fmt.Errorf("%w: settle takes no request id or dry run", ErrInvalidRequest)
	}
	if err := checkID(id); err != nil {
		return nil, err
	}
	body := appendReservation(make([]byte, 0, 64+len(id)), id)
	switch {
	case o.cost != "":
		if _, err := parseCost(o.cost, true); err != nil {
			return nil, err
		}
		body = append(body, `,"cost":`...)
		body = wire.AppendString(body, o.cost)
	case cost == SettleReserved:
	case cost < 0 || cost > MaxCost:
		return nil, fmt.Errorf("%w: settle cost %d not in [0, %d]", ErrInvalidRequest, cost, MaxCost)
	default:
		body = append(body, `,"cost":`...)
		body = strconv.AppendInt(body, cost, 10)
	}
	return c.settlement(ctx, c.settleSubject, id, append(body, '}'))
}

// Release ends reservation id giving all its units back: a settle of 0.
// Errors as for [Client.Settle].
func (c *Client) Release(ctx context.Context, id string) (*Settlement, error) {
	if err := checkID(id); err != nil {
		return nil, err
	}
	body := appendReservation(make([]byte, 0, 32+len(id)), id)
	return c.settlement(ctx, c.releaseSubject, id, append(body, '}'))
}

// Renew extends open reservation id to expire ttl from now (0: the
// service's default, [DefaultTTL]; at most [MaxTTL]). A reservation that
// already ended is not reopened: the Settlement then carries its ending
// outcome (Outcome is not [OutcomeRenewed]). Errors as for
// [Client.Settle]; [ErrNotFound] means it expired.
func (c *Client) Renew(ctx context.Context, id string, ttl time.Duration) (*Settlement, error) {
	if err := checkID(id); err != nil {
		return nil, err
	}
	if err := checkTTL(ttl); err != nil {
		return nil, err
	}
	body := appendReservation(make([]byte, 0, 48+len(id)), id)
	if ttl > 0 {
		body = appendTTL(body, ttl)
	}
	return c.settlement(ctx, c.renewSubject, id, append(body, '}'))
}

// settlement sends a settle, release or renew body for id and decodes the
// reply.
func (c *Client) settlement(ctx context.Context, subject, id string, body []byte) (*Settlement, error) {
	data, err := c.request(ctx, subject, body)
	if err != nil {
		return nil, err
	}
	s, err := decodeSettlement(data, id)
	if err != nil {
		return nil, fmt.Errorf("limitmesh client: %w", err)
	}
	return s, nil
}

// request sends body to subject and returns the reply's body. The timeout
// is ctx's deadline, or the client's when ctx has none. A micro error reply
// is a *ServiceError; request errors are mapped as for Decide.
func (c *Client) request(ctx context.Context, subject string, body []byte) ([]byte, error) {
	rctx := ctx
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		rctx, cancel = context.WithTimeout(ctx, c.opts.timeout)
		defer cancel()
	}
	msg, err := c.nc.RequestWithContext(rctx, subject, body)
	if err != nil {
		return nil, c.mapError(ctx, err)
	}
	if code, desc := msg.Header.Get(headerErrorCode), msg.Header.Get(headerError); code != "" || desc != "" {
		return nil, fmt.Errorf("limitmesh client: %w", decodeServiceError(code, desc, msg.Data))
	}
	return msg.Data, nil
}

// checkTTL checks a reservation ttl: 0 (the service's default) or in
// (0, MaxTTL].
func checkTTL(ttl time.Duration) error {
	if ttl < 0 || ttl > MaxTTL {
		return fmt.Errorf("%w: ttl %v not in (0, %v]", ErrInvalidRequest, ttl, MaxTTL)
	}
	return nil
}

// checkID checks a reservation id: 1..MaxReservationIDLen bytes.
func checkID(id string) error {
	if id == "" || len(id) > MaxReservationIDLen {
		return fmt.Errorf("%w: reservation id of %d bytes not in [1, %d]", ErrInvalidRequest, len(id), MaxReservationIDLen)
	}
	return nil
}

// appendReservation appends `{"reservation":"<id>"` (no closing brace).
func appendReservation(dst []byte, id string) []byte {
	dst = append(dst, `{"reservation":`...)
	return wire.AppendString(dst, id)
}

// appendTTL appends `,"ttl":"<Go duration>"`.
func appendTTL(dst []byte, ttl time.Duration) []byte {
	dst = append(dst, `,"ttl":"`...)
	dst = append(dst, ttl.String()...)
	return append(dst, '"')
}

// wireReservation is the JSON reply of the reserve endpoint: the decide
// reply plus the reservation.
type wireReservation struct {
	wireReply
	Reservation string `json:"reservation"`
	ExpiresInMs int64  `json:"expires_in_ms"`
}

// decodeReservation decodes a reserve reply's body. Errors wrap
// ErrBadReply; it never panics.
func decodeReservation(data []byte) (*Reservation, error) {
	var w wireReservation
	if err := json.Unmarshal(data, &w); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadReply, err)
	}
	r, err := resultOf(&w.wireReply)
	if err != nil {
		return nil, err
	}
	switch {
	case len(w.Reservation) > MaxReservationIDLen:
		return nil, fmt.Errorf("%w: reservation id of %d bytes", ErrBadReply, len(w.Reservation))
	case w.Reservation != "" && !r.Allowed:
		return nil, fmt.Errorf("%w: a denial with reservation %q", ErrBadReply, w.Reservation)
	case w.ExpiresInMs < 0 || w.ExpiresInMs > maxMs:
		return nil, fmt.Errorf("%w: expires_in_ms %d out of range", ErrBadReply, w.ExpiresInMs)
	}
	res := &Reservation{Result: *r, ID: w.Reservation}
	if w.Reservation != "" {
		res.ExpiresIn = time.Duration(w.ExpiresInMs) * time.Millisecond
	}
	return res, nil
}

// wireSettlement is the JSON reply of the settle, release and renew
// endpoints.
type wireSettlement struct {
	Reservation string      `json:"reservation"`
	Outcome     string      `json:"outcome"`
	Settled     json.Number `json:"settled"`
	Returned    json.Number `json:"returned"`
	Remaining   json.Number `json:"remaining"`
	ExpiresInMs int64       `json:"expires_in_ms"`
}

// decodeSettlement decodes the reply's body to a settle, release or renew
// of reservation id. Errors wrap ErrBadReply; it never panics.
func decodeSettlement(data []byte, id string) (*Settlement, error) {
	var w wireSettlement
	if err := json.Unmarshal(data, &w); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadReply, err)
	}
	if w.Outcome == "" {
		return nil, fmt.Errorf("%w: no \"outcome\" field", ErrBadReply)
	}
	if w.Reservation != "" && w.Reservation != id {
		return nil, fmt.Errorf("%w: reply for reservation %q, asked about %q", ErrBadReply, w.Reservation, id)
	}
	if w.ExpiresInMs < 0 || w.ExpiresInMs > maxMs {
		return nil, fmt.Errorf("%w: expires_in_ms %d out of range", ErrBadReply, w.ExpiresInMs)
	}
	s := &Settlement{Reservation: id, Outcome: Outcome(w.Outcome),
		ExpiresIn: time.Duration(w.ExpiresInMs) * time.Millisecond}
	for _, f := range []struct {
		name string
		in   json.Number
		out  *Decimal
	}{{"settled", w.Settled, &s.Settled}, {"returned", w.Returned, &s.Returned}, {"remaining", w.Remaining, &s.Remaining}} {
		*f.out = "0"
		if f.in == "" {
			continue
		}
		if m, ok := parseMicro(string(f.in)); !ok || m < 0 {
			return nil, fmt.Errorf("%w: %s %q is not a non-negative decimal", ErrBadReply, f.name, f.in)
		}
		*f.out = Decimal(f.in)
	}
	return s, nil
}
