package keys

import (
	"testing"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
)

// A new key with blind creates allowed is written with expected revision 0
// and no load; the calls are answered only after the acknowledgement.
func TestOwnerBlindCreateAbsentKey(t *testing.T) {
	p := tbPolicy(t, "p", 3, "10/s", 40, "")
	o := newOwner(newFakeEnv(p), 8, 0)
	o.blind = true
	now := int64(1000 * sec)
	c1, c2 := newCall(p, 1, now+sec), newCall(p, 2, now+sec)
	o.submit(c1)
	o.submit(c2)
	a := o.next(now)
	mustKind(t, a, actWrite)
	if !a.blind || a.rev != 0 || len(a.finished) != 0 {
		t.Fatalf("blind write: blind %v rev %d finished %d, want true 0 0", a.blind, a.rev, len(a.finished))
	}
	if c1.Out.Remaining != 39*kvstate.Unit || c2.Out.Remaining != 37*kvstate.Unit {
		t.Fatalf("decided %d, %d; want 39, 37 remaining", c1.Out.Remaining, c2.Out.Remaining)
	}
	st := &storeAt{}
	st.write(t, a)
	o.written(st.rev, nil)
	a = o.next(now)
	mustKind(t, a, actNone)
	if len(a.finished) != 2 || c1.Err != nil || c2.Err != nil || !o.idle() {
		t.Fatalf("after the ack: %d finished, errs %v %v", len(a.finished), c1.Err, c2.Err)
	}
	// The next batch is an ordinary write on the acknowledged revision.
	c3 := newCall(p, 1, now+sec)
	o.submit(c3)
	a = o.next(now)
	mustKind(t, a, actWrite)
	if a.blind || a.rev != st.rev || c3.Out.Remaining != 36*kvstate.Unit {
		t.Fatalf("second write: blind %v rev %d remaining %d", a.blind, a.rev, c3.Out.Remaining)
	}
}

// A blind create of a key that exists loses; the calls are decided again
// against the loaded record, and the loss does not count as a conflict.
func TestOwnerBlindCreateExistingKey(t *testing.T) {
	p := tbPolicy(t, "p", 3, "1/h", 10, "")
	env := newFakeEnv(p)
	now := int64(1000 * sec)
	// Another owner spent 9 of the 10 before.
	prev := newOwner(env, 8, 0)
	st := &storeAt{}
	for range 9 {
		prev.submit(newCall(p, 1, now+sec))
	}
	mustKind(t, prev.next(now), actLoad)
	prev.loadedResult(nil, 0, kvstate.ErrNotFound)
	st.write(t, prev.next(now))

	o := newOwner(env, 1, 0) // one conflict would fail a call
	o.blind = true
	c1, c2 := newCall(p, 1, now+sec), newCall(p, 1, now+sec)
	o.submit(c1)
	o.submit(c2)
	a := o.next(now)
	mustKind(t, a, actWrite)
	if !a.blind || !c2.Out.Allowed {
		t.Fatal("not a blind write admitting both")
	}
	if !o.written(0, kvstate.ErrConflict) {
		t.Fatal("a lost blind create is a conflict")
	}
	a = o.next(now)
	mustKind(t, a, actLoad)
	if len(a.finished) != 0 {
		t.Fatalf("%d calls finished after a blind loss, want none", len(a.finished))
	}
	o.loadedResult(st.val, st.rev, nil)
	a = o.next(now)
	mustKind(t, a, actWrite)
	if a.blind || a.rev != st.rev || !c1.Out.Allowed || c2.Out.Allowed {
		t.Fatalf("after the load: blind %v rev %d (want %d), c1 %+v c2 %+v", a.blind, a.rev, st.rev, c1.Out, c2.Out)
	}
	st.write(t, a)
	o.written(st.rev, nil)
	a = o.next(now)
	if len(a.finished) != 2 || c1.Err != nil || c2.Err != nil {
		t.Fatalf("finished %d, errs %v %v", len(a.finished), c1.Err, c2.Err)
	}
}

// A batch that would write nothing from the empty record (a dry run, a
// denial), or holds an async call, is not decided blind: the key is
// loaded first.
func TestOwnerBlindCreateNeedsAChange(t *testing.T) {
	p := tbPolicy(t, "p", 3, "1/h", 2, "")
	ap := tbPolicy(t, "a", 3, "1/h", 2, `,"mode":"async"`)
	now := int64(1000 * sec)
	dry := newCall(p, 1, now+sec)
	dry.DryRun = true
	big := newCall(p, 5, now+sec)
	for name, c := range map[string]*Call{"dry run": dry, "denial": big, "async": newCall(ap, 1, now+sec)} {
		o := newOwner(newFakeEnv(p, ap), 8, 0)
		o.blind = true
		o.submit(c)
		a := o.next(now)
		if a.kind != actLoad || len(a.finished) != 0 || c.Out != (keyrec.Decision{}) {
			t.Errorf("%s: action %d, %d finished, out %+v; want a load, nothing decided", name, a.kind, len(a.finished), c.Out)
		}
	}
}
