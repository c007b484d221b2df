package mesh

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
)

// Pipelined store operations. With the JetStream store, a key's load or
// write is started by its runner (runKey) and its result, delivered on the
// store's reply subscription, continues the runner: the result is applied
// to the owner core, and the core's next action (often the write of the
// calls that queued meanwhile) is started at once, with the replies it
// releases. So many keys' writes are in flight together while each key
// still has at most one store operation outstanding (the owner core's
// rule), and no goroutine is parked per key. The rare slow steps run in a
// goroutine of their own: the fencing check after a lost compare-and-swap
// (a read of the partition's entry) and fetching an old policy version a
// loaded record names.

// asyncStore returns the node's store as an AsyncStore (nil when it is
// not one) and whether writes must be fenced (fencedStore's rule).
func (n *Node) asyncStore() (kvstate.AsyncStore, bool) {
	if f, ok := n.store.(*fencedStore); ok {
		as, _ := f.Store.(kvstate.AsyncStore)
		return as, true
	}
	as, _ := n.store.(kvstate.AsyncStore)
	return as, false
}

// loadAsync starts the load a and continues key's runner with its result.
func (n *Node) loadAsync(as kvstate.AsyncStore, key string, e *keyEntry, o *owner, a action, now int64) {
	timeout := n.opTimeout(a, now)
	t0 := time.Now()
	as.GetAsync(key, timeout, func(val []byte, rev uint64, err error) {
		n.observeOp("get", t0, err)
		if err == nil {
			if _, _, need := n.policies.peek(val); need {
				go func() {
					ctx, cancel := context.WithTimeout(context.Background(), timeout)
					n.ensureVersion(ctx, val)
					cancel()
					n.continueLoad(key, e, o, val, rev, err)
				}()
				return
			}
		}
		n.continueLoad(key, e, o, val, rev, err)
	})
}

func (n *Node) continueLoad(key string, e *keyEntry, o *owner, val []byte, rev uint64, err error) {
	defer func() {
		if v := recover(); v != nil {
			n.recoverKey(key, e, v)
		}
	}()
	n.applyLoad(key, e, o, val, rev, err)
	n.runKey(key, e)
}

// writeAsync starts the write a and continues key's runner with its
// result. fenced applies fencedStore's rule to a lost compare-and-swap.
func (n *Node) writeAsync(as kvstate.AsyncStore, fenced bool, key string, e *keyEntry, o *owner, a action, now int64) {
	timeout := n.opTimeout(a, now)
	t0 := time.Now()
	blind := a.blind // the closure keeps only what it needs, not a
	as.UpdateAsync(key, a.value, a.rev, timeout, func(rev uint64, err error) {
		// A lost blind create is the normal outcome for an existing key:
		// no fencing check (the write after the load does it if needed).
		if fenced && !blind && errors.Is(err, kvstate.ErrConflict) && n.shards != nil {
			go func() {
				ctx, cancel := context.WithTimeout(context.Background(), timeout)
				err := n.fenceConflict(ctx, key, err)
				cancel()
				n.observeOp("update", t0, err)
				n.continueWrite(key, e, o, false, 0, err)
			}()
			return
		}
		n.observeOp("update", t0, err)
		n.continueWrite(key, e, o, blind, rev, err)
	})
}

func (n *Node) continueWrite(key string, e *keyEntry, o *owner, blind bool, rev uint64, err error) {
	defer func() {
		if v := recover(); v != nil {
			n.recoverKey(key, e, v)
		}
	}()
	n.applyWrite(key, e, o, blind, rev, err)
	n.runKey(key, e)
}

// fenceConflict is fencedStore.Update's rule for a write of key that lost
// its compare-and-swap (err): still a conflict while this node serves the
// key's partition in the epoch the partition entry names, else errFenced.
func (n *Node) fenceConflict(ctx context.Context, key string, err error) error {
	part := partitionOf(key, n.router.parts)
	if n.router.serving(part) && n.shards.verify(ctx, part) {
		return err
	}
	return fmt.Errorf("%w (%v)", errFenced, err)
}
