package kvstate

import "errors"

// ErrCorrupt is returned, wrapped with a description of the defect, by
// [DecodeStates] when stored state bytes are not a valid encoding: unknown
// version or algorithm, truncated or trailing bytes, or a field out of range.
var ErrCorrupt = errors.New("kvstate: corrupt state")

// ErrConflict is returned by [Store.Update] when a compare-and-swap write
// lost: the key's revision is no longer the expected one (another writer
// got there first). The caller reloads the state and decides again.
var ErrConflict = errors.New("kvstate: revision conflict")

// ErrNotFound is returned by [Store.Get] when no state is stored for a key
// (never written, deleted, purged or expired). Callers treat it as a
// never-seen key: the zero [State].
var ErrNotFound = errors.New("kvstate: state not found")

// ErrInvalidLimit is returned, wrapped with the offending field, by
// [Limit.Validate] for limit parameters no algorithm can enforce.
var ErrInvalidLimit = errors.New("kvstate: invalid limit")

// ErrStale is returned by [JetStreamStore.GetAsyncFloor] when the replica
// that answered does not hold the stream up to the read's floor (a
// follower catching up, or a stream leader cut off from its cluster that
// has not yet learnt it was replaced). Reading again later may succeed.
var ErrStale = errors.New("kvstate: replica behind the read's floor")
