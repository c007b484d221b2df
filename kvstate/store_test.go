package kvstate

import (
	"context"
	"errors"
	"testing"
)

// storeContract checks the behaviour every Store implementation shares.
func storeContract(t *testing.T, s Store) {
	ctx := context.Background()
	if _, rev, err := s.Get(ctx, "k"); !errors.Is(err, ErrNotFound) || rev != 0 {
		t.Fatalf("Get of a missing key: rev %d err %v, want 0 ErrNotFound", rev, err)
	}
	if _, err := s.Update(ctx, "k", []byte("x"), 5); !errors.Is(err, ErrConflict) {
		t.Fatalf("Update of a missing key at rev 5: %v, want ErrConflict", err)
	}
	r1, err := s.Update(ctx, "k", []byte("v1"), 0)
	if err != nil || r1 == 0 {
		t.Fatalf("create: rev %d err %v", r1, err)
	}
	if _, err := s.Update(ctx, "k", []byte("again"), 0); !errors.Is(err, ErrConflict) {
		t.Fatalf("create of an existing key: %v, want ErrConflict", err)
	}
	r2, err := s.Update(ctx, "k", []byte("v2"), r1)
	if err != nil || r2 <= r1 {
		t.Fatalf("update: rev %d err %v", r2, err)
	}
	if _, err := s.Update(ctx, "k", []byte("stale"), r1); !errors.Is(err, ErrConflict) {
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

func TestMemStore(t *testing.T) {
	s := NewMemStore()
	storeContract(t, s)
	s.Delete("k")
	if _, _, err := s.Get(context.Background(), "k"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("after Delete: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, _, err := s.Get(ctx, "other"); !errors.Is(err, context.Canceled) {
		t.Fatalf("Get with a cancelled context: %v", err)
	}
}
