package storetest

import (
	"context"
	"errors"
	"testing"

	"github.com/limitmesh/limitmesh/kvstate"
)

func TestMem(t *testing.T) {
	s := NewMem()
	Contract(t, s)
	s.Delete("k")
	if _, _, err := s.Get(context.Background(), "k"); !errors.Is(err, kvstate.ErrNotFound) {
		t.Fatalf("after Delete: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, _, err := s.Get(ctx, "other"); !errors.Is(err, context.Canceled) {
		t.Fatalf("Get with a cancelled context: %v", err)
	}
}

// TestContractFails: a store that forgets a write is caught.
func TestContractFails(t *testing.T) {
	ft := &testing.T{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		Contract(ft, forgetful{NewMem()})
	}()
	<-done
	if !ft.Failed() {
		t.Fatal("Contract passed a store whose updates are lost")
	}
}

// forgetful acknowledges updates and keeps none.
type forgetful struct{ *Mem }

func (forgetful) Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error) {
	return rev + 1, nil
}
