package kvstate

import (
	"context"
	"sync"
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
