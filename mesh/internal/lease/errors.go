package lease

import "errors"

// ErrUnknownGrant is returned for a report or return that names no
// outstanding grant (an id never made, returned or expired already, or
// another epoch's).
var ErrUnknownGrant = errors.New("lease: unknown grant")

// ErrStaleEpoch is returned for a report or return carrying an epoch older
// than the owner's: the grant was made by a deposed owner. Its units stay
// outstanding until the grant expires.
var ErrStaleEpoch = errors.New("lease: stale epoch")

// ErrBadSpend is returned for a report or return whose spend is negative
// or above the grant's units.
var ErrBadSpend = errors.New("lease: spend out of range")
