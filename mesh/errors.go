package mesh

import "errors"

// ErrConfig is returned, wrapped with the offending setting, by
// [StartEmbedded] and [NewNode] for an invalid configuration.
var ErrConfig = errors.New("mesh: invalid configuration")

// ErrCorruptRecord is returned, wrapped with a description, when a stored
// key record (the envelope around the kvstate states) cannot be decoded.
var ErrCorruptRecord = errors.New("mesh: corrupt key record")

// ErrBadRequest is matched by every error that makes a decide request a 400.
var ErrBadRequest = errors.New("mesh: bad request")

// ErrTooLarge is returned for a decide request body over [MaxRequestBytes]
// (a 413).
var ErrTooLarge = errors.New("mesh: request too large")

// ErrUnavailable is returned when no decision could be made within the
// decision deadline or the conflict-retry bound (a 503).
var ErrUnavailable = errors.New("mesh: unavailable")

// ErrStopped is returned by [Node.Start] after [Node.Stop].
var ErrStopped = errors.New("mesh: node stopped")

// errInternal marks a 500: a bug, never the client's fault.
var errInternal = errors.New("mesh: internal error")

// ErrPartitionMismatch is returned, wrapped, by [Node.Start] when the
// shards bucket records another partition count than NodeConfig.Partitions.
var ErrPartitionMismatch = errors.New("mesh: partition count differs from the mesh's")
