package client

import (
	"errors"
	"strconv"
)

// Sentinel errors returned (wrapped) by [Client.Decide] and the reservation
// calls ([Client.Reserve], [Client.Settle], [Client.Acquire], [Meter]...). Test them with
// errors.Is; a service answer with an error code is also a *[ServiceError]
// (errors.As) that carries the code, the symbol and the service's message.
var (
	// ErrInvalidRequest: the request can never succeed as sent. Either the
	// service answered 400 (bad_request) or 413 (too_large), or the client
	// rejected it before sending (empty descriptor, cost out of range or not
	// a decimal). Never masked by the failure behaviour.
	ErrInvalidRequest = errors.New("limitmesh: invalid request")

	// ErrUnavailable: the service answered 503 (no decision within the
	// node's deadline, e.g. its state store is unreachable), or the NATS
	// connection is closed or disconnected. Triggers the failure behaviour.
	ErrUnavailable = errors.New("limitmesh: service unavailable")

	// ErrNoResponders: no node subscribes to the decide subject (NATS
	// answered "no responders" at once). Triggers the failure behaviour.
	ErrNoResponders = errors.New("limitmesh: no responders")

	// ErrTimeout: no reply before the request deadline (the caller's
	// context deadline, or the client's timeout when the context has none).
	// The error also matches context.DeadlineExceeded when that was the
	// cause. Triggers the failure behaviour.
	ErrTimeout = errors.New("limitmesh: timeout")

	// ErrInternal: the service answered 500 or an error code this client
	// does not know. Not masked by the failure behaviour.
	ErrInternal = errors.New("limitmesh: internal service error")

	// ErrBadReply: the reply could not be decoded (not the contract's JSON).
	// Not masked by the failure behaviour.
	ErrBadReply = errors.New("limitmesh: malformed reply")

	// ErrNotFound: the service answered 404 (not_found) to a settle,
	// release or renew: the reservation is unknown or already expired
	// (CONTRACT.md §10). An expired reservation was counted as spent at its
	// reserved cost in rate, window and quota limits and gave its units back
	// in concurrency limits.
	ErrNotFound = errors.New("limitmesh: reservation not found")

	// ErrChunkDenied: a [Meter] could not reserve its next chunk (the
	// service denied it); the error is a *[ChunkDeniedError] carrying the
	// decision. The meter has stopped.
	ErrChunkDenied = errors.New("limitmesh: meter chunk denied")

	// ErrMeterClosed: [Meter.Add] after [Meter.Close].
	ErrMeterClosed = errors.New("limitmesh: meter closed")
)

// IsUnavailable reports whether err means that no decision could be obtained
// from the service (ErrUnavailable, ErrNoResponders or ErrTimeout): the
// errors that the failure behaviour configured with [OnUnavailable] handles.
func IsUnavailable(err error) bool {
	return errors.Is(err, ErrUnavailable) || errors.Is(err, ErrNoResponders) || errors.Is(err, ErrTimeout)
}

// ServiceError is an error answer of the decide service (CONTRACT.md §2): a
// NATS micro error with headers Nats-Service-Error-Code and Nats-Service-Error
// and a body {"error": symbol, "message": text}.
//
// It unwraps to the sentinel of its code: 400 and 413 to [ErrInvalidRequest],
// 404 to [ErrNotFound], 503 to [ErrUnavailable], anything else to
// [ErrInternal].
type ServiceError struct {
	Code    int    // the Nats-Service-Error-Code header, e.g. 400
	Symbol  string // bad_request, too_large, forbidden, not_found, unavailable or internal ("" if the body had none)
	Message string // human text: the body's message, else the Nats-Service-Error header
}

// Error implements error.
func (e *ServiceError) Error() string {
	s := "limitmesh: service error " + strconv.Itoa(e.Code)
	if e.Symbol != "" {
		s += " " + e.Symbol
	}
	if e.Message != "" {
		s += ": " + e.Message
	}
	return s
}

// Unwrap returns the sentinel error matching e.Code.
func (e *ServiceError) Unwrap() error {
	switch e.Code {
	case 400, 413:
		return ErrInvalidRequest
	case 404:
		return ErrNotFound
	case 503:
		return ErrUnavailable
	default:
		return ErrInternal
	}
}
