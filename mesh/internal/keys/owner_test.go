package keys

import (
	"errors"
	"fmt"
	"testing"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/fail"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/policies"
)

// version is one known version of a policy in a fakeEnv.
type version struct {
	p       *policies.Policy
	created int64
}

// fakeEnv is an Env over fixed versions.
type fakeEnv struct {
	cur      map[string]*policies.Policy
	versions map[string]version // name@rev
}

func newFakeEnv(ps ...*policies.Policy) *fakeEnv {
	e := &fakeEnv{cur: map[string]*policies.Policy{}, versions: map[string]version{}}
	for _, p := range ps {
		e.add(p, 0)
	}
	return e
}

func (e *fakeEnv) add(p *policies.Policy, created int64) {
	e.cur[p.Name] = p
	e.versions[fmt.Sprintf("%s@%d", p.Name, p.Revision)] = version{p: p, created: created}
}

func (e *fakeEnv) Current(name string) *policies.Policy { return e.cur[name] }
func (e *fakeEnv) Version(name string, rev uint64) (*policies.Policy, int64, bool) {
	v, ok := e.versions[fmt.Sprintf("%s@%d", name, rev)]
	return v.p, v.created, ok
}

func tbPolicy(t testing.TB, name string, rev uint64, rate string, burst int, extra string) *policies.Policy {
	t.Helper()
	doc := fmt.Sprintf(`{"match":{"tenant":"*"},"limits":[{"name":"rate","algorithm":"token_bucket","rate":%q,"burst":%d}]%s}`, rate, burst, extra)
	p, err := policies.Parse(name, []byte(doc))
	if err != nil {
		t.Fatalf("Parse: %v", err)
	}
	p.Revision = rev
	return p
}

const sec = kvstate.Second

func newCall(p *policies.Policy, cost int64, deadline int64) *Call {
	return &Call{Policy: p, Cost: cost * kvstate.Unit, Deadline: deadline}
}

func withID(c *Call, id string) *Call { c.ID, c.HasID = keyrec.IDHash(id), true; return c }

// storeAt is a one-key store the tests drive by hand: it applies actions
// the way JetStream would.
type storeAt struct {
	val []byte
	rev uint64
	seq uint64
}

func (s *storeAt) write(t *testing.T, a action) uint64 {
	t.Helper()
	if a.rev != s.rev {
		t.Fatalf("write expects rev %d, store at %d", a.rev, s.rev)
	}
	s.seq++
	s.val, s.rev = append([]byte(nil), a.value...), s.seq
	return s.rev
}

func mustKind(t *testing.T, a action, k actionKind) {
	t.Helper()
	if a.kind != k {
		t.Fatalf("action kind %d, want %d", a.kind, k)
	}
}

func TestOwnerGroupCommitOrder(t *testing.T) {
	p := tbPolicy(t, "p", 3, "10/s", 40, "")
	o := newOwner(newFakeEnv(p), 8, 0)
	now := int64(1000 * sec)
	c1 := newCall(p, 1, now+sec)
	o.submit(c1)
	a := o.next(now)
	mustKind(t, a, actLoad)
	// Two more arrive while the load is outstanding.
	c2, c3 := newCall(p, 1, now+sec), newCall(p, 2, now+sec)
	o.submit(c2)
	o.submit(c3)
	if a := o.next(now); a.kind != actNone || len(a.finished) != 0 {
		t.Fatalf("next while busy = %+v", a)
	}
	o.loadedResult(nil, 0, kvstate.ErrNotFound)
	a = o.next(now)
	mustKind(t, a, actWrite)
	if a.rev != 0 || len(a.finished) != 0 {
		t.Fatalf("first write rev=%d finished=%d, want 0, 0", a.rev, len(a.finished))
	}
	// One write carries all three, decided in arrival order.
	for i, want := range []int64{39, 38, 36} {
		c := []*Call{c1, c2, c3}[i]
		if !c.Out.Allowed || c.Out.Remaining != want*kvstate.Unit || c.Out.Revision != 3 {
			t.Fatalf("call %d = %+v, want allowed remaining %d rev 3", i+1, c.Out, want)
		}
	}
	// A fourth arrives during the write; nobody is answered before the ack.
	c4 := newCall(p, 1, now+sec)
	o.submit(c4)
	if a := o.next(now); len(a.finished) != 0 {
		t.Fatal("answered before the write was acknowledged")
	}
	if o.written(7, nil) {
		t.Fatal("conflict reported for a successful write")
	}
	a = o.next(now)
	mustKind(t, a, actWrite)
	if len(a.finished) != 3 || a.finished[0] != c1 || a.finished[2] != c3 {
		t.Fatalf("finished = %d calls, want c1..c3 in order", len(a.finished))
	}
	if a.rev != 7 || c4.Out.Remaining != 35*kvstate.Unit {
		t.Fatalf("second write rev %d remaining %d, want 7, 35", a.rev, c4.Out.Remaining)
	}
	o.written(8, nil)
	a = o.next(now)
	mustKind(t, a, actNone)
	if len(a.finished) != 1 || a.finished[0] != c4 || c4.Err != nil {
		t.Fatalf("c4 not finished cleanly: %+v", a)
	}
	if !o.idle() {
		t.Fatal("owner not idle")
	}
}

func TestOwnerConflictReloadsAndRedecides(t *testing.T) {
	p := tbPolicy(t, "p", 1, "1/s", 10, "")
	o := newOwner(newFakeEnv(p), 8, 0)
	now := int64(50 * sec)
	o.submit(newCall(p, 1, now+sec))
	mustKind(t, o.next(now), actLoad)
	o.loadedResult(nil, 0, kvstate.ErrNotFound)
	c := newCall(p, 3, now+sec)
	o.submit(c)
	// The first call's write is pending; pretend it was decided: drive it.
	a := o.next(now)
	mustKind(t, a, actWrite)
	// Meanwhile another node spent 8 of the 10 tokens at rev 5.
	other := keyrec.Record{Policy: "p", Revision: 1}
	_, other.States = kvstate.DecideAll([]kvstate.Limit{p.Limits[0].Limit}, nil, now, 8*kvstate.Unit, nil)
	if !o.written(0, fmt.Errorf("wrapped: %w", kvstate.ErrConflict)) {
		t.Fatal("conflict not reported")
	}
	a = o.next(now)
	mustKind(t, a, actLoad)
	o.loadedResult(keyrec.Append(nil, &other), 5, nil)
	a = o.next(now)
	mustKind(t, a, actWrite)
	if a.rev != 5 {
		t.Fatalf("retry expects rev %d, want 5", a.rev)
	}
	// Re-decided against the fresh state: 2 left, the cost-1 call is
	// admitted (1 left), the cost-3 call is denied.
	first := o.inflight[0]
	if !first.Out.Allowed || first.Out.Remaining != kvstate.Unit {
		t.Fatalf("first after reload = %+v", first.Out)
	}
	if c.Out.Allowed || c.Out.RetryAfter != 2*sec {
		t.Fatalf("second after reload = %+v, want denied retry 2s", c.Out)
	}
	if first.conflicts != 1 || c.conflicts != 1 {
		t.Fatalf("conflicts = %d, %d", first.conflicts, c.conflicts)
	}
	o.written(6, nil)
	if a := o.next(now); len(a.finished) != 2 {
		t.Fatalf("finished %d, want 2", len(a.finished))
	}
}

func TestOwnerConflictBound(t *testing.T) {
	p := tbPolicy(t, "p", 1, "1/s", 10, "")
	o := newOwner(newFakeEnv(p), 3, 0)
	now := int64(sec)
	c := newCall(p, 1, now+sec)
	o.submit(c)
	for i := 0; i < 3; i++ {
		mustKind(t, o.next(now), actLoad)
		o.loadedResult(nil, 0, kvstate.ErrNotFound)
		mustKind(t, o.next(now), actWrite)
		o.written(0, kvstate.ErrConflict)
	}
	a := o.next(now)
	mustKind(t, a, actNone)
	if len(a.finished) != 1 || !errors.Is(c.Err, fail.ErrUnavailable) {
		t.Fatalf("after 3 conflicts: finished %d err %v, want fail.ErrUnavailable", len(a.finished), c.Err)
	}
}

func TestOwnerDeadline(t *testing.T) {
	p := tbPolicy(t, "p", 1, "1/s", 10, "")
	o := newOwner(newFakeEnv(p), 8, 0)
	c := newCall(p, 1, 100)
	o.submit(c)
	a := o.next(100)
	mustKind(t, a, actNone)
	if len(a.finished) != 1 || !errors.Is(c.Err, fail.ErrUnavailable) {
		t.Fatalf("expired call: %+v err %v", a, c.Err)
	}
}

func TestOwnerStoreErrors(t *testing.T) {
	p := tbPolicy(t, "p", 1, "1/s", 10, "")
	o := newOwner(newFakeEnv(p), 8, 0)
	c := newCall(p, 1, 10*sec)
	o.submit(c)
	mustKind(t, o.next(sec), actLoad)
	o.loadedResult(nil, 0, errors.New("no responders"))
	if a := o.next(sec); len(a.finished) != 1 || !errors.Is(c.Err, fail.ErrUnavailable) {
		t.Fatalf("load failure: err %v", c.Err)
	}
	// A failed write (outcome unknown) fails the batch and reloads next time.
	c2 := newCall(p, 1, 10*sec)
	o.submit(c2)
	mustKind(t, o.next(sec), actLoad)
	o.loadedResult(nil, 0, kvstate.ErrNotFound)
	mustKind(t, o.next(sec), actWrite)
	o.written(0, errors.New("timeout"))
	if a := o.next(sec); len(a.finished) != 1 || !errors.Is(c2.Err, fail.ErrUnavailable) {
		t.Fatalf("write failure: err %v", c2.Err)
	}
	o.submit(newCall(p, 1, 10*sec))
	mustKind(t, o.next(sec), actLoad)
}

// TestOwnerDedupe: a retried request_id gets the first decision and spends
// once, until the dedupe window passes.
func TestOwnerDedupe(t *testing.T) {
	p := tbPolicy(t, "p", 2, "1/s", 10, "")
	o := newOwner(newFakeEnv(p), 8, 0)
	s := &storeAt{}
	now := int64(sec)
	first := withID(newCall(p, 4, now+sec), "abc")
	o.submit(first)
	mustKind(t, o.next(now), actLoad)
	o.loadedResult(nil, 0, kvstate.ErrNotFound)
	o.written(s.write(t, o.next(now)), nil)
	o.next(now)
	if !first.Out.Allowed || first.Out.Remaining != 6*kvstate.Unit {
		t.Fatalf("first = %+v", first.Out)
	}
	retry := withID(newCall(p, 4, now+2*sec), "abc")
	o.submit(retry)
	a := o.next(now + 500_000_000)
	mustKind(t, a, actNone)
	if len(a.finished) != 1 || !retry.Deduped || retry.Out != first.Out {
		t.Fatalf("retry = %+v deduped=%v, want the first decision %+v", retry.Out, retry.Deduped, first.Out)
	}
	// A dry run with the same id is decided fresh and spends nothing.
	dry := withID(newCall(p, 4, now+2*sec), "abc")
	dry.DryRun = true
	o.submit(dry)
	a = o.next(now)
	mustKind(t, a, actNone)
	if dry.Deduped || dry.Out.Remaining != 2*kvstate.Unit {
		t.Fatalf("dry run = %+v deduped=%v", dry.Out, dry.Deduped)
	}
	// After the window the id is forgotten: it spends again.
	later := now + keyrec.DedupeWindow
	again := withID(newCall(p, 4, later+sec), "abc")
	o.submit(again)
	a = o.next(later)
	mustKind(t, a, actWrite)
	if again.Deduped || !again.Out.Allowed {
		t.Fatalf("after window = %+v deduped=%v", again.Out, again.Deduped)
	}
}

// TestOwnerNoWrite: denials without request_id and dry runs are answered
// without a write.
func TestOwnerNoWrite(t *testing.T) {
	p := tbPolicy(t, "p", 1, "1/s", 2, "")
	o := newOwner(newFakeEnv(p), 8, 0)
	s := &storeAt{}
	now := int64(sec)
	big := newCall(p, 3, now+sec) // above burst: never
	o.submit(big)
	mustKind(t, o.next(now), actLoad)
	o.loadedResult(nil, 0, kvstate.ErrNotFound)
	a := o.next(now)
	mustKind(t, a, actNone)
	if big.Out.Allowed || big.Out.RetryAfter != kvstate.Never {
		t.Fatalf("cost above burst = %+v", big.Out)
	}
	dry := newCall(p, 2, now+sec)
	dry.DryRun = true
	o.submit(dry)
	mustKind(t, o.next(now), actNone)
	if !dry.Out.Allowed || dry.Out.Remaining != 0 {
		t.Fatalf("dry run = %+v", dry.Out)
	}
	spend := newCall(p, 2, now+sec)
	o.submit(spend)
	o.written(s.write(t, o.next(now)), nil)
	o.next(now)
	if !spend.Out.Allowed {
		t.Fatalf("dry run spent: %+v", spend.Out)
	}
}

// TestOwnerTransition: a record written under an older revision is moved
// to the new one (§28): a lowered burst clamps stored tokens, and the
// decision carries the new revision.
func TestOwnerTransition(t *testing.T) {
	v1 := tbPolicy(t, "p", 1, "1/s", 40, "")
	v2 := tbPolicy(t, "p", 2, "1/s", 5, "")
	env := newFakeEnv(v1)
	o := newOwner(env, 8, 0)
	s := &storeAt{}
	now := int64(100 * sec)
	o.submit(newCall(v1, 10, now+sec))
	mustKind(t, o.next(now), actLoad)
	o.loadedResult(nil, 0, kvstate.ErrNotFound)
	o.written(s.write(t, o.next(now)), nil)
	o.next(now)
	env.add(v2, now)
	c := newCall(v1, 1, now+sec) // resolved before the change reached it
	o.submit(c)
	a := o.next(now)
	mustKind(t, a, actWrite)
	if c.Out.Revision != 2 || c.Out.Remaining != 4*kvstate.Unit {
		t.Fatalf("after lowering burst to 5: %+v, want rev 2 remaining 4", c.Out)
	}
	o.written(s.write(t, a), nil)
	o.next(now)
	rec, err := keyrec.Decode(s.val)
	if err != nil || rec.Revision != 2 {
		t.Fatalf("stored record rev %d err %v", rec.Revision, err)
	}
	// An unknown old version: states kept by position and clamped.
	o2 := newOwner(newFakeEnv(v2), 8, 0)
	old := keyrec.Record{Policy: "p", Revision: 99, States: rec.States}
	c2 := newCall(v2, 1, now+sec)
	o2.submit(c2)
	mustKind(t, o2.next(now), actLoad)
	o2.loadedResult(keyrec.Append(nil, &old), 9, nil)
	mustKind(t, o2.next(now), actWrite)
	if c2.Out.Remaining != 3*kvstate.Unit {
		t.Fatalf("unknown old version: %+v, want remaining 3", c2.Out)
	}
}

// TestOwnerKeepAlive: with a state TTL, a batch that changes nothing is
// still written once the last write is ttl/2 old (and after a load), so
// denied-only traffic keeps the stored state alive.
func TestOwnerKeepAlive(t *testing.T) {
	p := tbPolicy(t, "p", 1, "1/h", 1, "")
	o := newOwner(newFakeEnv(p), 8, 10*sec)
	s := &storeAt{}
	now := int64(100 * sec)
	o.submit(newCall(p, 1, now+sec))
	mustKind(t, o.next(now), actLoad)
	o.loadedResult(nil, 0, kvstate.ErrNotFound)
	o.written(s.write(t, o.next(now)), nil)
	o.next(now)
	deny := func(at int64) action {
		c := newCall(p, 1, at+sec)
		o.submit(c)
		a := o.next(at)
		if c.Out.Allowed {
			t.Fatalf("at %d: allowed", at)
		}
		return a
	}
	mustKind(t, deny(now+4*sec), actNone)
	a := deny(now + 5*sec)
	mustKind(t, a, actWrite)
	o.written(s.write(t, a), nil)
	o.next(now + 5*sec)
	mustKind(t, deny(now+9*sec), actNone)
	// After a load the record's age is unknown: the first batch writes.
	o2 := newOwner(newFakeEnv(p), 8, 10*sec)
	c := newCall(p, 2, now+sec)
	o2.submit(c)
	mustKind(t, o2.next(now), actLoad)
	o2.loadedResult(s.val, s.rev, nil)
	mustKind(t, o2.next(now), actWrite)
	// A key that was never written has nothing to keep alive: a dry run
	// on it writes nothing.
	o3 := newOwner(newFakeEnv(p), 8, 10*sec)
	dry := newCall(p, 1, now+sec)
	dry.DryRun = true
	o3.submit(dry)
	mustKind(t, o3.next(now), actLoad)
	o3.loadedResult(nil, 0, kvstate.ErrNotFound)
	mustKind(t, o3.next(now), actNone)
}

func mustParse(t *testing.T, doc string) *policies.Policy {
	t.Helper()
	p, err := policies.Parse("p", []byte(doc))
	if err != nil {
		t.Fatalf("parse %s: %v", doc, err)
	}
	return p
}
