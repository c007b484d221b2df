// Package fail holds the sentinel errors the mesh's packages share: each
// says how a decide request fails (CONTRACT §2's codes), so the decide
// service maps any wrapped error to its reply with errors.Is.
package fail

import "errors"

var (
	// ErrBadRequest is matched by every error that makes a decide request a 400.
	ErrBadRequest = errors.New("mesh: bad request")
	// ErrForbidden is matched by a request naming another tenant than the
	// caller's (a 403, CONTRACT §9).
	ErrForbidden = errors.New("mesh: forbidden")
	// ErrTooLarge is returned for a decide request body over the size limit (a 413).
	ErrTooLarge = errors.New("mesh: request too large")
	// ErrUnavailable is returned when no decision could be made within the
	// decision deadline or the conflict-retry bound (a 503).
	ErrUnavailable = errors.New("mesh: unavailable")
	// ErrInternal marks a 500: a bug, never the client's fault.
	ErrInternal = errors.New("mesh: internal error")
	// ErrFenced is the error of a load or write of a key whose partition
	// this node does not hold (any more): nothing was written, and the
	// request goes to the partition's owner.
	ErrFenced = errors.New("mesh: partition fenced: not the owner")
)
