// Package storetest holds what tests of [kvstate.Store] users share: an
// in-memory store and the contract every store keeps.
//
// Only _test.go files import it.
package storetest

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/limitmesh/limitmesh/kvstate"
)

// Mem is a [kvstate.Store] in process memory. Its revisions are one
// sequence for the whole store, like a JetStream stream's. The zero value
// is not usable; call [NewMem]. It is safe for concurrent use.
type Mem struct {
	mu   sync.Mutex
	seq  uint64
	vals map[string]memEntry
}

type memEntry struct {
	val []byte
	rev uint64
}

// NewMem returns an empty in-memory store.
func NewMem() *Mem { return &Mem{vals: make(map[string]memEntry)} }

// Get implements [kvstate.Store]. The returned slice is a copy.
func (m *Mem) Get(ctx context.Context, key string) ([]byte, uint64, error) {
	if err := ctx.Err(); err != nil {
		return nil, 0, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	e, ok := m.vals[key]
	if !ok {
		return nil, 0, kvstate.ErrNotFound
	}
	return append([]byte(nil), e.val...), e.rev, nil
}

// Update implements [kvstate.Store]. The value is copied.
func (m *Mem) Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.vals[key].rev != rev {
		return 0, kvstate.ErrConflict
	}
	m.seq++
	m.vals[key] = memEntry{val: append([]byte(nil), value...), rev: m.seq}
	return m.seq, nil
}

// Delete removes key, as an expiry would: no delete marker is left.
func (m *Mem) Delete(key string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.vals, key)
}

// Contract checks the behaviour every [kvstate.Store] shares, on an empty
// store s: a missing key is [kvstate.ErrNotFound] at revision 0, creates
// and updates compare the revision ([kvstate.ErrConflict] when it moved),
// and revisions increase store-wide.
func Contract(t *testing.T, s kvstate.Store) {
	t.Helper()
	ctx := context.Background()
	if _, rev, err := s.Get(ctx, "k"); !errors.Is(err, kvstate.ErrNotFound) || rev != 0 {
		t.Fatalf("Get of a missing key: rev %d err %v, want 0 ErrNotFound", rev, err)
	}
	if _, err := s.Update(ctx, "k", []byte("x"), 5); !errors.Is(err, kvstate.ErrConflict) {
		t.Fatalf("Update of a missing key at rev 5: %v, want ErrConflict", err)
	}
	r1, err := s.Update(ctx, "k", []byte("v1"), 0)
	if err != nil || r1 == 0 {
		t.Fatalf("create: rev %d err %v", r1, err)
	}
	if _, err := s.Update(ctx, "k", []byte("again"), 0); !errors.Is(err, kvstate.ErrConflict) {
		t.Fatalf("create of an existing key: %v, want ErrConflict", err)
	}
	r2, err := s.Update(ctx, "k", []byte("v2"), r1)
	if err != nil || r2 <= r1 {
		t.Fatalf("update: rev %d err %v", r2, err)
	}
	if _, err := s.Update(ctx, "k", []byte("stale"), r1); !errors.Is(err, kvstate.ErrConflict) {
		t.Fatalf("stale update: %v, want ErrConflict", err)
	}
	v, rev, err := s.Get(ctx, "k")
	if err != nil || rev != r2 || string(v) != "v2" {
		t.Fatalf("Get = %q %d %v, want v2 %d", v, rev, err, r2)
	}
	r3, err := s.Update(ctx, "other", []byte("o"), 0)
	if err != nil || r3 <= r2 {
		t.Fatalf("second key: rev %d err %v (revisions increase store-wide)", r3, err)
	}
}
