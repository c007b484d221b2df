package policies

import "errors"

// ErrInvalid is matched (with errors.Is) by every error that rejects a
// policy document, a policy name, a descriptor or a cost: the input is
// malformed or breaks a rule of CONTRACT.md. The error itself is an [*Error]
// naming the offending field.
var ErrInvalid = errors.New("invalid")

// ErrMissingDimension is matched by the error [Policy.LimitKey] returns when
// the descriptor lacks a dimension the policy's key needs (a 400 on the
// wire). Such an error also matches [ErrInvalid].
var ErrMissingDimension = errors.New("missing dimension")

// Error is a structured rejection: Path names the offending field
// ("limits[0].rate", "match.tenant", "descriptor.tenant"; empty for the whole
// input) and Reason says what is wrong with it. Error() prints
// `Path: Reason`, for example
//
//	limits[0].rate: "ten per second" is not N/s, N/m or N/h
//
// Every *Error matches [ErrInvalid]; Err, when set, is a more specific
// sentinel it also matches (such as [ErrMissingDimension]).
type Error struct {
	Path   string
	Reason string
	Err    error
}

// Error returns `Path: Reason`, or Reason alone when Path is empty.
func (e *Error) Error() string {
	if e.Path == "" {
		return e.Reason
	}
	return e.Path + ": " + e.Reason
}

// Unwrap returns ErrInvalid and, when set, the more specific sentinel Err.
func (e *Error) Unwrap() []error {
	if e.Err == nil || e.Err == ErrInvalid {
		return []error{ErrInvalid}
	}
	return []error{ErrInvalid, e.Err}
}

func invalid(path, reason string) *Error { return &Error{Path: path, Reason: reason} }
