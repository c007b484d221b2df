package keys

import (
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"pgregory.net/rapid"
)

// TestDenialsWriteNothing: a key flooded with denials (and dry runs)
// without request_id is neither read nor written again; a denial with a
// request_id writes its dedupe entry.
func TestDenialsWriteNothing(t *testing.T) {
	for _, mode := range []string{"strict", "async"} {
		t.Run(mode, func(t *testing.T) {
			p := tbPolicy(t, "p", 1, "1/h", 2, `,"mode":"`+mode+`"`)
			st := newSyncStore()
			ct := newCapTable(t, st, time.Hour, p)
			ct.mustDecide(p, "k", true)
			ct.mustDecide(p, "k", true)
			if mode == "async" {
				ct.flush("k")
			}
			gets, updates := st.count(st.gets, "k"), st.count(st.updates, "k")
			for i := range 1000 {
				ct.rt.now = ct.rt.now.Add(time.Millisecond)
				c := &Call{Policy: p, Cost: kvstate.Unit, Deadline: ct.rt.now.UnixNano() + int64(time.Second),
					DryRun: i%10 == 0, Done: &ct.calls}
				ct.tbl.Submit("k", c, ct.rt.now.UnixNano(), nil)
				if c.Err != nil || c.Out.Allowed || c.Out.Policy != "p" {
					t.Fatalf("call %d: %+v %v, want denied", i, c.Out, c.Err)
				}
			}
			if g, u := st.count(st.gets, "k"), st.count(st.updates, "k"); g != gets || u != updates {
				t.Fatalf("1000 denials: %d reads and %d writes, want none", g-gets, u-updates)
			}
			if e := ct.tbl.entries["k"]; e.running || !e.o.idle() {
				t.Fatal("the owner holds something to write after denials")
			}
			c := &Call{Policy: p, Cost: kvstate.Unit, Deadline: ct.rt.now.UnixNano() + int64(time.Second), Done: &ct.calls}
			withID(c, "r1")
			ct.tbl.Submit("k", c, ct.rt.now.UnixNano(), nil)
			if mode == "async" {
				ct.flush("k")
			}
			if u := st.count(st.updates, "k"); c.Out.Allowed || u != updates+1 {
				t.Fatalf("a denial with a request_id: %+v, %d writes, want denied and 1 write", c.Out, u-updates)
			}
		})
	}
}

// flush does what the async flush timer does for key.
func (ct *capTable) flush(key string) {
	ct.tbl.mu.Lock()
	e := ct.tbl.entries[key]
	ct.tbl.mu.Unlock()
	ct.tbl.flushKey(key, e)
}

// TestDenialsKeepAlive: denial-only traffic still writes the key once per
// TTL/2 (the keep-alive), so its state never expires while it is denied.
func TestDenialsKeepAlive(t *testing.T) {
	p := tbPolicy(t, "p", 1, "1/h", 1, "")
	st := newSyncStore()
	ct := newCapTable(t, st, 10*time.Second, p)
	ct.mustDecide(p, "k", true)
	updates := st.count(st.updates, "k")
	for range 60 {
		ct.rt.now = ct.rt.now.Add(time.Second)
		for range 10 {
			ct.mustDecide(p, "k", false)
		}
	}
	if u := st.count(st.updates, "k") - updates; u != 12 {
		t.Fatalf("60 s of denials with a 10 s TTL: %d keep-alive writes, want 12 (one per 5 s)", u)
	}
}

// TestDenyInlineMatchesTheQueue: strict decisions through the table (with
// the inline denials) are those of an owner driven through its queue
// alone, call for call, and the table writes exactly when that owner does.
func TestDenyInlineMatchesTheQueue(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		burst := rapid.IntRange(1, 5).Draw(rt, "burst")
		p := tbPolicy(t, "p", 1, "2/s", burst, "")
		st := newSyncStore()
		ct := newCapTable(t, st, 20*time.Second, p)
		ref := newOwner(newFakeEnv(p), 8, int64(20*time.Second))
		ref.blind = false
		refStore := &storeAt{}
		refWrites := 0
		n := rapid.IntRange(1, 60).Draw(rt, "calls")
		for i := range n {
			ct.rt.now = ct.rt.now.Add(time.Duration(rapid.IntRange(0, 3000).Draw(rt, "dt_ms")) * time.Millisecond)
			now := ct.rt.now.UnixNano()
			cost := int64(rapid.IntRange(1, 3).Draw(rt, "cost"))
			dry := rapid.IntRange(0, 4).Draw(rt, "dry") == 0
			id := ""
			if rapid.IntRange(0, 5).Draw(rt, "id") == 0 {
				id = rapid.StringMatching(`[a-c]`).Draw(rt, "request_id")
			}
			mk := func() *Call {
				c := &Call{Policy: p, Cost: cost * kvstate.Unit, Deadline: now + int64(time.Second), DryRun: dry, Done: &ct.calls}
				if id != "" {
					withID(c, id)
				}
				return c
			}
			got := mk()
			ct.tbl.Submit("k", got, now, nil)
			want := mk()
			ref.submit(want)
			for {
				a := ref.next(now)
				if a.kind == actLoad {
					ref.loadedResult(nil, 0, kvstate.ErrNotFound)
					continue
				}
				if a.kind == actWrite {
					refWrites++
					ref.written(refStore.write(t, a), nil)
					continue
				}
				break
			}
			if got.Err != nil || want.Err != nil || got.Out != want.Out || got.Deduped != want.Deduped {
				rt.Fatalf("call %d: table %+v (%v, deduped %v), queue %+v (%v, deduped %v)",
					i, got.Out, got.Err, got.Deduped, want.Out, want.Err, want.Deduped)
			}
			if w := st.count(st.updates, "k"); w != refWrites {
				rt.Fatalf("call %d: the table wrote %d times, the queue %d", i, w, refWrites)
			}
		}
	})
}
