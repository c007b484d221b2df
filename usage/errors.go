package usage

import "errors"

// ErrInvalid is matched (with errors.Is) by every error [DecodeBatch]
// returns: the bytes are not a usage batch of CONTRACT.md §6 (not JSON, a
// wrong shape, or a field breaking its rule). The error names the offending
// field, such as `records[3].key: is empty`.
var ErrInvalid = errors.New("usage: invalid batch")

// ErrClosed is returned by [Publisher.Sync] and [Publisher.Close] once the
// publisher is closed.
var ErrClosed = errors.New("usage: closed")

// ErrConfig is matched by the errors the constructors return for an
// invalid configuration (an empty node id, a negative interval...).
var ErrConfig = errors.New("usage: invalid configuration")

// ErrConflict is returned, wrapped, when a compare-and-swap write of the
// ledger lost against another writer. The
// reconciler handles it itself (it reloads and applies again); it is
// exported for tests and logs.
var ErrConflict = errors.New("usage: revision conflict")

// ErrCorruptEntry is matched by the error returned for a ledger entry that
// does not decode (someone wrote the bucket by hand). The reconciler logs
// it, counts it in limitmesh_usage_ledger_corrupt_total and starts that
// entry again from zero.
var ErrCorruptEntry = errors.New("usage: corrupt ledger entry")
