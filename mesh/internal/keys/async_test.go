package keys

import (
	"errors"
	"fmt"
	"testing"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/policies"
)

// asyncOwner is an owner of an async policy (rate 10/s, burst 40) loaded
// on an absent key by a first call of cost 1, which is answered at once.
func asyncOwner(t *testing.T) (*owner, *policies.Policy, *storeAt, int64) {
	t.Helper()
	p := tbPolicy(t, "p", 1, "10/s", 40, `,"mode":"async"`)
	o := newOwner(newFakeEnv(p), 8, 0)
	now := int64(1000 * sec)
	c := newCall(p, 1, now+sec)
	if ok, _ := o.decideInline(c, now); ok {
		t.Fatal("decided inline before the key was loaded")
	}
	o.submit(c)
	mustKind(t, o.next(now), actLoad)
	o.loadedResult(nil, 0, kvstate.ErrNotFound)
	a := o.next(now)
	mustKind(t, a, actNone)
	if len(a.finished) != 1 || a.finished[0] != c || !c.Out.Allowed || c.Out.Remaining != 39*kvstate.Unit {
		t.Fatalf("first async call not answered before any write: %+v, %+v", a, c.Out)
	}
	if !a.arm || o.idle() {
		t.Fatalf("arm = %v, idle = %v: want a flush armed and a dirty owner", a.arm, o.idle())
	}
	return o, p, &storeAt{}, now
}

func storedTokens(t *testing.T, val []byte) int64 {
	t.Helper()
	rec, err := keyrec.Decode(val)
	if err != nil || len(rec.States) != 1 {
		t.Fatalf("stored record: %+v %v", rec, err)
	}
	return rec.States[0].Tokens
}

// TestAsyncCoalescesOneWritePerInterval: every call is answered when
// decided; all changes of an interval go out in one write, only after the
// flush timer.
func TestAsyncCoalescesOneWritePerInterval(t *testing.T) {
	o, p, s, now := asyncOwner(t)
	for i := range 4 {
		c := newCall(p, 2, now+sec)
		ok, arm := o.decideInline(c, now)
		if !ok || arm || !c.Out.Allowed || c.Out.Remaining != int64(37-2*i)*kvstate.Unit {
			t.Fatalf("inline %d: ok %v arm %v out %+v", i, ok, arm, c.Out)
		}
	}
	if a := o.next(now); a.kind != actNone {
		t.Fatalf("wrote before the interval passed: %+v", a)
	}
	o.requestFlush()
	a := o.next(now)
	mustKind(t, a, actWrite)
	if a.rev != 0 || a.deadline != noDeadline || len(a.finished) != 0 {
		t.Fatalf("write-behind %+v", a)
	}
	if got := storedTokens(t, a.value); got != 31*kvstate.Unit {
		t.Fatalf("written tokens %d, want 31 units (all five calls in one write)", got)
	}
	// Calls keep being decided while the write is outstanding.
	c := newCall(p, 1, now+sec)
	ok, arm := o.decideInline(c, now)
	if !ok || !arm || c.Out.Remaining != 30*kvstate.Unit {
		t.Fatalf("inline during the write: ok %v arm %v %+v", ok, arm, c.Out)
	}
	if o.written(s.write(t, a), nil) {
		t.Fatal("conflict")
	}
	if o.idle() || o.next(now).kind != actNone {
		t.Fatal("the change made during the write was forgotten or written without the timer")
	}
	o.requestFlush()
	a = o.next(now)
	mustKind(t, a, actWrite)
	if a.rev != s.rev || storedTokens(t, a.value) != 30*kvstate.Unit {
		t.Fatalf("second write rev %d (store %d)", a.rev, s.rev)
	}
	o.written(s.write(t, a), nil)
	if a := o.next(now); a.kind != actNone || a.arm || !o.idle() {
		t.Fatalf("after the last write: %+v idle %v", a, o.idle())
	}
	// A flush timer that fires with nothing to write does nothing.
	o.requestFlush()
	if a := o.next(now); a.kind != actNone {
		t.Fatalf("flush of a clean owner: %+v", a)
	}
}

// TestAsyncLostCASReloads: another writer won; the unwritten changes are
// dropped (counted), and the key continues from the stored state.
func TestAsyncLostCASReloads(t *testing.T) {
	o, p, _, now := asyncOwner(t)
	o.requestFlush()
	a := o.next(now)
	mustKind(t, a, actWrite)
	if !o.written(0, errors.Join(errors.New("x"), kvstate.ErrConflict)) || o.lost != 1 {
		t.Fatalf("conflict not reported or not counted (lost %d)", o.lost)
	}
	c := newCall(p, 1, now+sec)
	if ok, _ := o.decideInline(c, now); ok {
		t.Fatal("decided inline on a dropped cache")
	}
	o.submit(c)
	mustKind(t, o.next(now), actLoad)
	other := keyrec.Record{Policy: "p", Revision: 1, States: []kvstate.State{{Algorithm: kvstate.TokenBucket, Tokens: 5 * kvstate.Unit, Last: now}}}
	o.loadedResult(keyrec.Append(nil, &other), 9, nil)
	a = o.next(now)
	if len(a.finished) != 1 || c.Out.Remaining != 4*kvstate.Unit || !a.arm {
		t.Fatalf("after reload: %+v %+v, want 4 left from the stored 5", a, c.Out)
	}
	o.requestFlush()
	if a := o.next(now); a.kind != actWrite || a.rev != 9 {
		t.Fatalf("write after reload: %+v, want rev 9", a)
	}
}

// TestAsyncWriteErrorRetriesSameRevision: a write with an unknown outcome
// keeps the record and is retried with the same expected revision.
func TestAsyncWriteErrorRetriesSameRevision(t *testing.T) {
	o, _, s, now := asyncOwner(t)
	o.requestFlush()
	a := o.next(now)
	if o.written(0, errors.New("timeout")) {
		t.Fatal("timeout reported as a conflict")
	}
	a = o.next(now)
	if a.kind != actNone || !a.arm || o.idle() || o.lost != 0 {
		t.Fatalf("after a failed write-behind: %+v idle %v lost %d", a, o.idle(), o.lost)
	}
	o.requestFlush()
	a = o.next(now)
	mustKind(t, a, actWrite)
	if a.rev != 0 || storedTokens(t, a.value) != 39*kvstate.Unit {
		t.Fatalf("retry %+v", a)
	}
	o.written(s.write(t, a), nil)
	if !o.idle() {
		t.Fatal("not idle after the retry landed")
	}
}

// TestAsyncThenStrict: a policy switched from async to strict; the strict
// call is decided on top of the unwritten changes and answered only after
// the write that carries them all.
func TestAsyncThenStrict(t *testing.T) {
	o, p, s, now := asyncOwner(t)
	env := o.env.(*fakeEnv)
	strict := tbPolicy(t, "p", 2, "10/s", 40, "")
	env.add(strict, now)
	c := newCall(p, 1, now+sec) // arrived under the async version
	if ok, _ := o.decideInline(c, now); ok {
		t.Fatal("a call of a policy now strict was decided inline")
	}
	o.submit(c)
	a := o.next(now)
	mustKind(t, a, actWrite)
	if len(a.finished) != 0 || c.Out.Remaining != 38*kvstate.Unit || c.Out.Revision != 2 {
		t.Fatalf("strict call answered before its write, or decided without the async change: %+v %+v", a, c.Out)
	}
	if got := storedTokens(t, a.value); got != 38*kvstate.Unit {
		t.Fatalf("strict write carries %d tokens, want 38 units", got)
	}
	// While the strict write is outstanding, async calls queue.
	c2 := newCall(p, 1, now+sec)
	env.add(tbPolicy(t, "p", 3, "10/s", 40, `,"mode":"async"`), now)
	if ok, _ := o.decideInline(c2, now); ok {
		t.Fatal("decided inline during a strict write")
	}
	o.submit(c2)
	o.written(s.write(t, a), nil)
	a = o.next(now)
	if len(a.finished) != 2 || a.finished[0] != c || a.finished[1] != c2 || c2.Out.Remaining != 37*kvstate.Unit {
		t.Fatalf("after the strict write: %+v", a)
	}
	// The timer armed by the first change is still pending: it flushes.
	if a.arm || o.idle() {
		t.Fatalf("arm %v idle %v: want the async change pending on the armed timer", a.arm, o.idle())
	}
	o.requestFlush()
	if a := o.next(now); a.kind != actWrite || storedTokens(t, a.value) != 37*kvstate.Unit {
		t.Fatalf("flush after the switch back: %+v", a)
	}
}

// TestCorruptRecordStartsEmpty: an unreadable record starts the key as if
// it had just spent its whole capacity, never full.
func TestCorruptRecordStartsEmpty(t *testing.T) {
	bucket := tbPolicy(t, "p", 1, "10/s", 40, "")
	window, err := policies.Parse("w", []byte(`{"match":{"tenant":"*"},"limits":[{"algorithm":"fixed_window","limit":5,"window":"1s"},{"name":"log","algorithm":"sliding_log","limit":3,"window":"1s"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	window.Revision = 4
	for _, tc := range []struct {
		p        *policies.Policy
		at       int64 // when the load was asked for
		later    int64 // first instant a cost-1 call is admitted again
		leftThen int64 // units left after it
	}{
		{bucket, 1000 * sec, 1000*sec + sec/10, 0},
		{window, 1000*sec + sec/2, 1001*sec + sec/2, 2},
	} {
		o := newOwner(newFakeEnv(tc.p), 8, 0)
		c := newCall(tc.p, 1, tc.at+10*sec)
		o.submit(c)
		mustKind(t, o.next(tc.at), actLoad)
		o.loadedResult([]byte{9, 9, 9}, 7, nil)
		if o.corrupt != 1 || !o.loaded {
			t.Fatalf("%s: corrupt %d loaded %v", tc.p.Name, o.corrupt, o.loaded)
		}
		a := o.next(tc.at)
		if len(a.finished) != 1 || c.Out.Allowed || c.Out.Remaining != 0 {
			t.Fatalf("%s: first call on a corrupt record %+v, want denied with nothing left", tc.p.Name, c.Out)
		}
		c = newCall(tc.p, 1, tc.later+sec)
		o.submit(c)
		a = o.next(tc.later - 1)
		if c.Out.Allowed {
			t.Fatalf("%s: admitted before the capacity came back", tc.p.Name)
		}
		c = newCall(tc.p, 1, tc.later+sec)
		o.submit(c)
		a = o.next(tc.later)
		mustKind(t, a, actWrite)
		if !c.Out.Allowed || c.Out.Remaining != tc.leftThen*kvstate.Unit || a.rev != 7 {
			t.Fatalf("%s: at the refill %+v (write rev %d), want allowed with %d left over rev 7", tc.p.Name, c.Out, a.rev, tc.leftThen)
		}
	}
	// No call waiting when the corrupt value arrives: nothing to build the
	// record for, so the key loads again on its next call.
	o := newOwner(newFakeEnv(bucket), 8, 0)
	c := newCall(bucket, 1, 10)
	o.submit(c)
	mustKind(t, o.next(1), actLoad)
	o.queue = nil
	o.loadedResult([]byte{1}, 3, nil)
	if o.loaded || o.corrupt != 1 {
		t.Fatalf("loaded %v corrupt %d", o.loaded, o.corrupt)
	}
}

// TestAsyncBlindStart: with blind allowed, the first async call on a key
// never read is decided inline against the empty record (no load), and the
// write-behind is a blind create (expected revision 0). If it wins, the key
// is an ordinary loaded key; if it loses (the key existed), the changes are
// dropped and counted, and the key reloads and continues from the stored
// record.
func TestAsyncBlindStart(t *testing.T) {
	p := tbPolicy(t, "p", 1, "10/s", 40, `,"mode":"async"`)
	now := int64(1000 * sec)
	for _, tc := range []struct {
		name    string
		exists  bool // the key is in the store (with 5 units left)
		wantRev uint64
	}{
		{"absent", false, 1},
		{"exists", true, 9},
	} {
		o := newOwner(newFakeEnv(p), 8, 0)
		o.blind = true
		c := newCall(p, 1, now+sec)
		ok, arm := o.decideInline(c, now)
		if !ok || !arm || !c.Out.Allowed || c.Out.Remaining != 39*kvstate.Unit {
			t.Fatalf("%s: blind start: ok %v arm %v %+v", tc.name, ok, arm, c.Out)
		}
		c2 := newCall(p, 2, now+sec)
		if ok, arm := o.decideInline(c2, now); !ok || arm || c2.Out.Remaining != 37*kvstate.Unit {
			t.Fatalf("%s: second call: ok %v arm %v %+v", tc.name, ok, arm, c2.Out)
		}
		if a := o.next(now); a.kind != actNone {
			t.Fatalf("%s: store operation before the interval: %+v", tc.name, a)
		}
		o.requestFlush()
		a := o.next(now)
		mustKind(t, a, actWrite)
		if !a.blind || a.rev != 0 || storedTokens(t, a.value) != 37*kvstate.Unit {
			t.Fatalf("%s: first write-behind %+v, want a blind create of 37 units", tc.name, a)
		}
		if !tc.exists {
			if o.written(1, nil) || !o.idle() || o.unread {
				t.Fatalf("%s: after the create: idle %v unread %v", tc.name, o.idle(), o.unread)
			}
		} else {
			if !o.written(0, errors.Join(errors.New("wrong last sequence"), kvstate.ErrConflict)) || o.lost != 1 || o.loaded {
				t.Fatalf("%s: lost create: lost %d loaded %v", tc.name, o.lost, o.loaded)
			}
			c3 := newCall(p, 1, now+sec)
			if ok, _ := o.decideInline(c3, now); ok {
				t.Fatalf("%s: a second blind start", tc.name)
			}
			o.submit(c3)
			mustKind(t, o.next(now), actLoad)
			stored := keyrec.Record{Policy: "p", Revision: 1, States: []kvstate.State{{Algorithm: kvstate.TokenBucket, Tokens: 5 * kvstate.Unit, Last: now}}}
			o.loadedResult(keyrec.Append(nil, &stored), 9, nil)
			if a := o.next(now); len(a.finished) != 1 || c3.Out.Remaining != 4*kvstate.Unit {
				t.Fatalf("%s: after the reload %+v, want 4 left from the stored 5", tc.name, c3.Out)
			}
		}
		c4 := newCall(p, 1, now+sec)
		if ok, _ := o.decideInline(c4, now); !ok {
			t.Fatalf("%s: not decided inline after the first write", tc.name)
		}
		o.requestFlush()
		a = o.next(now)
		if a.kind != actWrite || a.blind || a.rev != tc.wantRev {
			t.Fatalf("%s: next write-behind %+v, want an ordinary write at rev %d", tc.name, a, tc.wantRev)
		}
	}
}

// TestAsyncBlindStartNotTaken: a blind start needs blind allowed and a
// call that changes the empty record; otherwise the key is loaded first.
// A strict write made while the record is unread is a blind create too.
func TestAsyncBlindStartNotTaken(t *testing.T) {
	p := tbPolicy(t, "p", 1, "10/s", 40, `,"mode":"async"`)
	now := int64(1000 * sec)
	dry := newCall(p, 1, now+sec)
	dry.DryRun = true
	for _, tc := range []struct {
		name  string
		blind bool
		c     *Call
	}{
		{"not allowed", false, newCall(p, 1, now+sec)},
		{"dry run", true, dry},
		{"denied", true, newCall(p, 41, now+sec)},
	} {
		o := newOwner(newFakeEnv(p), 8, 0)
		o.blind = tc.blind
		if ok, _ := o.decideInline(tc.c, now); ok || o.loaded || o.blind != tc.blind || tc.c.Out != (keyrec.Decision{}) {
			t.Fatalf("%s: decided inline (ok %v, loaded %v, out %+v)", tc.name, ok, o.loaded, tc.c.Out)
		}
		o.submit(tc.c)
		mustKind(t, o.next(now), actLoad)
	}

	o := newOwner(newFakeEnv(p), 8, 0)
	o.blind = true
	env := o.env.(*fakeEnv)
	if ok, _ := o.decideInline(newCall(p, 1, now+sec), now); !ok {
		t.Fatal("no blind start")
	}
	strict := tbPolicy(t, "p", 2, "10/s", 40, "")
	env.add(strict, now)
	c := newCall(strict, 1, now+sec)
	o.submit(c)
	a := o.next(now)
	mustKind(t, a, actWrite)
	if !a.blind || a.rev != 0 || storedTokens(t, a.value) != 38*kvstate.Unit {
		t.Fatalf("strict write on an unread record %+v, want a blind create of 38 units", a)
	}
	// It loses: the strict call is decided again after a load, without
	// counting a conflict against it.
	if !o.written(0, kvstate.ErrConflict) || c.conflicts != 0 || o.lost != 1 {
		t.Fatalf("lost blind strict write: conflicts %d lost %d", c.conflicts, o.lost)
	}
	mustKind(t, o.next(now), actLoad)
}

// TestAsyncUnknownOutcomeUsageOnce: an async write-behind whose outcome is
// unknown is retried carrying its usage; when the retry loses its
// compare-and-swap the first write may have landed, and with a store that
// journals usage (the state journal publishes a landed write's usage) that
// usage is not published again as lost: only the admissions decided after
// the first write are. With a store that does not (the usage of a write is
// published when it is answered as written), both are.
func TestAsyncUnknownOutcomeUsageOnce(t *testing.T) {
	for _, kept := range []bool{true, false} {
		p := tbPolicy(t, "p", 1, "10/s", 40, `,"mode":"async"`)
		o := newOwner(newFakeEnv(p), 8, 0)
		o.usageKept = kept
		now := int64(1000 * sec)
		call := func(tenant string) *Call {
			c := newCall(p, 1, now+sec)
			c.Desc = policies.Descriptor{{Name: "tenant", Value: tenant}}
			return c
		}
		o.submit(call("first"))
		mustKind(t, o.next(now), actLoad)
		o.loadedResult(nil, 0, kvstate.ErrNotFound)
		o.next(now)
		o.requestFlush()
		a := o.next(now)
		mustKind(t, a, actWrite)
		if len(a.usage) != 1 {
			t.Fatalf("first write carries %d usage records, want 1", len(a.usage))
		}
		o.written(0, errors.New("timeout")) // it may have landed
		if ok, _ := o.decideInline(call("second"), now); !ok {
			t.Fatal("second call not decided inline")
		}
		o.requestFlush()
		a = o.next(now)
		mustKind(t, a, actWrite)
		if len(a.usage) != 2 {
			t.Fatalf("the retry carries %d usage records, want 2 (the first write's again)", len(a.usage))
		}
		if !o.written(0, kvstate.ErrConflict) {
			t.Fatal("conflict not reported")
		}
		lost, _ := o.takeLostUsage()
		var got []string
		for _, u := range lost {
			got = append(got, u.Desc[0].Value)
		}
		want := "[second]"
		if !kept {
			want = "[first second]"
		}
		if fmt.Sprint(got) != want {
			t.Fatalf("usageKept=%v: lost usage %v, want %s", kept, got, want)
		}
	}
}
