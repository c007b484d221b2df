package mesh

import (
	"errors"

	"github.com/limitmesh/limitmesh/mesh/internal/fail"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/ownership"
)

// ErrConfig is returned, wrapped with the offending setting, by
// [StartEmbedded] and [NewNode] for an invalid configuration.
var ErrConfig = errors.New("mesh: invalid configuration")

// ErrCorruptRecord is returned, wrapped with a description, when a stored
// key record (the envelope around the kvstate states) cannot be decoded.
var ErrCorruptRecord = keyrec.ErrCorrupt

// ErrBadRequest is matched by every error that makes a decide request a 400.
var ErrBadRequest = fail.ErrBadRequest

// ErrForbidden is matched by a request naming a tenant other than the
// caller's in a secured deployment (a 403).
var ErrForbidden = fail.ErrForbidden

// ErrTooLarge is returned for a decide request body over [MaxRequestBytes]
// (a 413).
var ErrTooLarge = fail.ErrTooLarge

// ErrUnavailable is returned when no decision could be made within the
// decision deadline or the conflict-retry bound (a 503).
var ErrUnavailable = fail.ErrUnavailable

// ErrStopped is returned by [Node.Start] after [Node.Stop].
var ErrStopped = errors.New("mesh: node stopped")

// ErrPartitionMismatch is returned, wrapped, by [Node.Start] when the
// shards bucket records another partition count than NodeConfig.Partitions.
var ErrPartitionMismatch = ownership.ErrPartitionMismatch
