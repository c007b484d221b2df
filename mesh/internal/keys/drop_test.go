package keys

import (
	"errors"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/mesh/internal/fail"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/policies"
)

// submitRes submits a reservation call of key on ct's table at its clock
// and returns it (finished only if the store answers).
func (ct *capTable) submitRes(p *policies.Policy, key string, cost int64, op *ResOp) *Call {
	now := ct.rt.now.UnixNano()
	c := &Call{Policy: p, Cost: cost, Deadline: now + int64(time.Second), Res: op, Done: &ct.calls}
	ct.tbl.Submit(key, c, now, nil)
	return c
}

// TestMovedKeyKeepsNoStaleRecord: a key whose partition moves away while
// a load or write of it is outstanding keeps nothing here
// (Table.DropPartition). The outstanding write finishes and answers its
// call as it went; the calls queued behind the operation fail as fenced
// (the partition's owner decides them); and when the partition comes
// back, the key's next call loads it again. The record cached before the
// move lacks what the next owner wrote meanwhile: a call that writes
// nothing, answered from it, would answer a release of a reservation the
// next owner made not found (R1).
func TestMovedKeyKeepsNoStaleRecord(t *testing.T) {
	for _, tc := range []struct {
		name   string
		cached bool // the key is cached here, a decision's write outstanding; else its load is
	}{
		{"write outstanding", true},
		{"load outstanding", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := tbPolicy(t, "p", 1, "1/s", 100, "")
			st := newSyncStore()
			here := newCapTable(t, st, 0, p)  // the node that loses the partition, then gets it back
			other := newCapTable(t, st, 0, p) // the partition's owner meanwhile
			const key, part = "k", int('k') % 4
			first := other
			if tc.cached {
				first = here
			}
			r1 := &ResOp{Kind: ResReserve, Key: key, TTL: 30 * sec, Nonce: 1}
			if c := first.submitRes(p, key, 10*unit, r1); c.Err != nil || !c.Out.Allowed {
				t.Fatalf("reserve r1: %v %+v", c.Err, c.Out)
			}

			st.hold = true
			var write *Call
			if tc.cached {
				write = here.decide0(p, key, 1)
			}
			dry := &Call{Policy: p, Cost: unit, DryRun: true, Deadline: here.rt.now.UnixNano() + int64(time.Second), Done: &here.calls}
			here.tbl.Submit(key, dry, here.rt.now.UnixNano(), nil)
			if len(st.held) != 1 {
				t.Fatalf("%d store operations outstanding, want 1", len(st.held))
			}
			here.tbl.DropPartition(part)
			if n := here.tbl.Len(); n != 0 {
				t.Fatalf("%d keys held after their partition moved away, want 0", n)
			}

			st.hold = false
			r2 := &ResOp{Kind: ResReserve, Key: key, TTL: 30 * sec, Nonce: 2}
			if c := other.submitRes(p, key, 10*unit, r2); c.Err != nil || !c.Out.Allowed {
				t.Fatalf("reserve r2 at the next owner: %v %+v", c.Err, c.Out)
			}

			st.answer() // the outstanding operation's answer comes late
			if write != nil && (!finished(&here.calls, write) || write.Err != nil || !write.Out.Allowed) {
				t.Fatalf("the decision whose write landed: finished %v, %v %+v; want allowed", finished(&here.calls, write), write.Err, write.Out)
			}
			if !finished(&here.calls, dry) || !errors.Is(dry.Err, fail.ErrFenced) {
				t.Fatalf("the call queued behind it: finished %v, %v %+v; want fenced", finished(&here.calls, dry), dry.Err, dry.Out)
			}
			if n := here.tbl.Len(); n != 0 {
				t.Fatalf("%d keys held once the operation finished, want 0", n)
			}

			// The partition comes back: a release of r2 finds it.
			rel := &ResOp{Kind: ResRelease, Key: key, Seq: r2.Res.Seq, Nonce: 2}
			if c := here.submitRes(p, key, 0, rel); !finished(&here.calls, c) || c.Err != nil || rel.NotFound || rel.Res.Outcome != keyrec.Released {
				t.Fatalf("release of r2 once the partition is back: %v, %+v", c.Err, rel)
			}
			rec, err := keyrec.Decode(st.vals[key])
			if err != nil {
				t.Fatal(err)
			}
			if open, _ := rec.OpenReservations(); open != 1 {
				t.Fatalf("stored record holds %d open reservations, want 1 (r1)", open)
			}
		})
	}
}

// decide0 submits a decision of cost units for key at ct's clock and
// returns it (finished only if the store answers).
func (ct *capTable) decide0(p *policies.Policy, key string, cost int64) *Call {
	now := ct.rt.now.UnixNano()
	c := &Call{Policy: p, Cost: cost * unit, Deadline: now + int64(time.Second), Done: &ct.calls}
	ct.tbl.Submit(key, c, now, nil)
	return c
}

func finished(d *doneCalls, c *Call) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, f := range d.list {
		if f == c {
			return true
		}
	}
	return false
}

// TestMovedKeyWritesNoUnwrittenChanges: a key whose partition moves away
// with async changes not written yet never writes them (the next owner
// holds the key: they are lost, within the async bound); the usage of
// their admissions is published directly, once, when the flush comes.
func TestMovedKeyWritesNoUnwrittenChanges(t *testing.T) {
	p := tbPolicy(t, "p", 1, "10/s", 40, `,"mode":"async"`)
	st := newSyncStore()
	ct := newCapTable(t, st, 0, p)
	var lost []keyrec.Usage
	ct.tbl.cfg.LostUsage = func(policy, key string, us []keyrec.Usage) { lost = append(lost, us...) }
	const key, part = "k", int('k') % 4
	for _, tenant := range []string{"a", "b"} {
		c := &Call{Policy: p, Cost: unit, Deadline: ct.rt.now.UnixNano() + int64(time.Second), Done: &ct.calls,
			Desc: policies.Descriptor{{Name: "tenant", Value: tenant}}}
		ct.tbl.Submit(key, c, ct.rt.now.UnixNano(), nil)
		if !finished(&ct.calls, c) || c.Err != nil || !c.Out.Allowed {
			t.Fatalf("async call %s: %v %+v", tenant, c.Err, c.Out)
		}
	}
	ct.tbl.mu.Lock()
	e := ct.tbl.entries[key]
	ct.tbl.mu.Unlock()
	ct.tbl.DropPartition(part)
	ct.tbl.flushKey(key, e) // the flush timer armed by the first change
	ct.tbl.flushKey(key, e)
	if n := st.count(st.updates, key); n != 0 {
		t.Fatalf("%d writes of a key whose partition moved away, want 0", n)
	}
	if len(lost) != 2 || lost[0].Desc[0].Value != "a" || lost[1].Desc[0].Value != "b" {
		t.Fatalf("lost usage %+v, want tenants a and b once", lost)
	}
	if !e.Gone() || ct.tbl.Len() != 0 {
		t.Fatalf("entry gone %v, %d keys held; want gone, 0", e.Gone(), ct.tbl.Len())
	}
}
