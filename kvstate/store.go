package kvstate

import (
	"context"
	"time"
)

// Store is where the encoded state of limit keys lives between decisions: a
// key-value map with per-key revisions and compare-and-swap writes. The
// implementation is [JetStreamStore], on a JetStream KV bucket.
//
// Values are opaque bytes to a Store. Revisions are positive and strictly
// increase with every write of a key; 0 means "no value".
//
// Implementations are safe for concurrent use.
type Store interface {
	// Get returns the value and revision of key. It returns an error
	// wrapping ErrNotFound when the key was never written, was deleted or
	// purged, or expired; the revision returned with ErrNotFound is the one
	// an Update must then expect (0, or the revision of a delete marker).
	Get(ctx context.Context, key string) ([]byte, uint64, error)
	// Update writes value if key's revision is still rev (0: the key must
	// not exist) and returns the new revision. It returns an error wrapping
	// ErrConflict when the revision is no longer rev.
	Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error)
}

// AsyncStore is a [Store] that can also start its operations without
// blocking the caller, so many keys' reads and writes are in flight at
// once without a goroutine waiting on each.
//
// done is called exactly once with the result (the same values and errors
// as the blocking method), on a goroutine of the store's, never on the
// caller's (it may run before the starting method returns, so the caller
// must not hold a lock done takes); an operation with no answer within
// timeout fails with an error wrapping context.DeadlineExceeded (its
// outcome is unknown: a write may have landed). done must not block for
// long: it delays other operations' results.
type AsyncStore interface {
	Store
	GetAsync(key string, timeout time.Duration, done func(val []byte, rev uint64, err error))
	UpdateAsync(key string, value []byte, rev uint64, timeout time.Duration, done func(rev uint64, err error))
}
