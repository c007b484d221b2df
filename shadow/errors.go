package shadow

import "errors"

// ErrCorrupt is matched by the error [Replay.Restore] returns for bytes
// that are not a checkpoint of this package (an unknown version, truncated
// or trailing bytes, a field out of range). The error says which field.
var ErrCorrupt = errors.New("shadow: corrupt checkpoint")

// ErrConfig is matched by the errors constructors return for an invalid
// configuration (a bad prefix, a negative interval).
var ErrConfig = errors.New("shadow: invalid configuration")

// ErrNotCandidate is returned by [WithoutShadow] for a policy document
// that has no top-level "shadow": true.
var ErrNotCandidate = errors.New("shadow: not a candidate")

// ErrInvalidDocument is matched by the error [WithoutShadow] returns for a
// document that is not a JSON object.
var ErrInvalidDocument = errors.New("shadow: invalid policy document")
