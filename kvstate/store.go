package kvstate

import (
	"context"
	"sync"
	"time"
)

// Store is where the encoded state of limit keys lives between decisions: a
// key-value map with per-key revisions and compare-and-swap writes. The
// JetStream KV implementation is [JetStreamStore]; [MemStore] is an in-memory
// one for tests and single-process use.
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

// MemStore is a [Store] in process memory. Its revisions are one sequence
// for the whole store, like a JetStream stream's. The zero value is not
// usable; call [NewMemStore].
type MemStore struct {
	mu   sync.Mutex
	seq  uint64
	vals map[string]memEntry
}

type memEntry struct {
	val []byte
	rev uint64
}

// NewMemStore returns an empty in-memory store.
func NewMemStore() *MemStore { return &MemStore{vals: make(map[string]memEntry)} }

// Get implements [Store]. The returned slice is a copy.
func (m *MemStore) Get(ctx context.Context, key string) ([]byte, uint64, error) {
	if err := ctx.Err(); err != nil {
		return nil, 0, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	e, ok := m.vals[key]
	if !ok {
		return nil, 0, ErrNotFound
	}
	return append([]byte(nil), e.val...), e.rev, nil
}

// Update implements [Store]. The value is copied.
func (m *MemStore) Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.vals[key].rev != rev {
		return 0, ErrConflict
	}
	m.seq++
	m.vals[key] = memEntry{val: append([]byte(nil), value...), rev: m.seq}
	return m.seq, nil
}

// Delete removes key, as an expiry would. It is a test helper.
func (m *MemStore) Delete(key string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.vals, key)
}
