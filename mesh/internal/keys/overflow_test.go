package keys

import (
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/fail"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/policies"
)

// syncStore is a many-key store that answers at once, on the caller's
// goroutine (the table releases its locks before a store call, so the
// whole path runs synchronously), and counts its operations.
type syncStore struct {
	mu      sync.Mutex
	vals    map[string][]byte
	revs    map[string]uint64
	seq     uint64
	gets    map[string]int
	updates map[string]int
	// failGets makes every load fail (not found is not a failure).
	failGets bool
	// hold keeps the answers of the operations (done, with their
	// results) in held instead of calling them: a load reads and a write
	// lands at once, their answers come when the test calls answer.
	hold bool
	held []func()
}

// answer calls the held answers, in order.
func (s *syncStore) answer() {
	s.mu.Lock()
	held := s.held
	s.held = nil
	s.mu.Unlock()
	for _, f := range held {
		f()
	}
}

// reply calls f now, or holds it (hold).
func (s *syncStore) reply(f func()) {
	s.mu.Lock()
	if s.hold {
		s.held = append(s.held, f)
		s.mu.Unlock()
		return
	}
	s.mu.Unlock()
	f()
}

func newSyncStore() *syncStore {
	return &syncStore{vals: map[string][]byte{}, revs: map[string]uint64{}, gets: map[string]int{}, updates: map[string]int{}}
}

func (s *syncStore) GetAsync(key string, _ time.Duration, done func([]byte, uint64, error)) {
	s.mu.Lock()
	s.gets[key]++
	val, rev, ok := s.vals[key], s.revs[key], s.revs[key] != 0
	failing := s.failGets
	s.mu.Unlock()
	switch {
	case failing:
		s.reply(func() { done(nil, 0, errors.New("store unreachable")) })
	case !ok:
		s.reply(func() { done(nil, 0, kvstate.ErrNotFound) })
	default:
		s.reply(func() { done(val, rev, nil) })
	}
}

func (s *syncStore) UpdateAsync(key string, val []byte, _ []keyrec.Usage, rev uint64, _ time.Duration, done func(uint64, error)) {
	s.mu.Lock()
	s.updates[key]++
	if s.revs[key] != rev {
		s.mu.Unlock()
		s.reply(func() { done(0, kvstate.ErrConflict) })
		return
	}
	s.seq++
	s.vals[key], s.revs[key] = append([]byte(nil), val...), s.seq
	seq := s.seq
	s.mu.Unlock()
	s.reply(func() { done(seq, nil) })
}

func (s *syncStore) count(m map[string]int, key string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return m[key]
}

// manualRuntime is a Runtime whose clock the test sets; Go runs f at once
// and timers never fire (tests call what a timer would).
type manualRuntime struct{ now time.Time }

func (r *manualRuntime) Now() time.Time { return r.now }
func (r *manualRuntime) AfterFunc(time.Duration, func()) func() bool {
	return func() bool { return true }
}
func (r *manualRuntime) Go(f func()) { f() }

// doneCalls records the calls finished.
type doneCalls struct {
	mu   sync.Mutex
	list []*Call
}

func (d *doneCalls) Finish(c *Call) {
	d.mu.Lock()
	d.list = append(d.list, c)
	d.mu.Unlock()
}

// capTable is a table over a syncStore whose keys "a".."z" are in
// partitions by their first byte mod 4.
type capTable struct {
	t     *testing.T
	tbl   *Table
	st    *syncStore
	rt    *manualRuntime
	env   *fakeEnv
	ttl   time.Duration
	calls doneCalls
}

func newCapTable(t *testing.T, st *syncStore, ttl time.Duration, ps ...*policies.Policy) *capTable {
	ct := &capTable{t: t, st: st, rt: &manualRuntime{now: time.Unix(1000, 0)}, env: newFakeEnv(ps...), ttl: ttl}
	ct.tbl = New(Config{Env: ct.env, Store: st, Runtime: ct.rt, TTL: ttl,
		Partition: func(key string) int { return int(key[len(key)-1]) % 4 }})
	// No blind creates: every new key is read first, so the counts below
	// are the same whatever the table's blind score.
	ct.tbl.blind.v.Store(-blindScoreMax)
	return ct
}

// decide submits one call of cost 1 for key and returns it, finished.
func (ct *capTable) decide(p *policies.Policy, key string, overflow bool) *Call {
	ct.t.Helper()
	now := ct.rt.now.UnixNano()
	c := &Call{Policy: p, Cost: kvstate.Unit, Deadline: now + int64(time.Second), Overflow: overflow, Done: &ct.calls}
	n := len(ct.calls.list)
	ct.tbl.Submit(key, c, now, nil)
	if len(ct.calls.list) != n+1 || ct.calls.list[n] != c {
		ct.t.Fatalf("%s: the call did not finish synchronously", key)
	}
	if c.Err != nil {
		ct.t.Fatalf("%s: %v", key, c.Err)
	}
	return c
}

func (ct *capTable) mustDecide(p *policies.Policy, key string, allowed bool) {
	ct.t.Helper()
	c := ct.decide(p, key, false)
	if c.Overflowed || c.Out.Allowed != allowed || c.Out.Policy != p.Name {
		ct.t.Fatalf("%s: overflowed %v, %+v; want decided on its own state, allowed %v", key, c.Overflowed, c.Out, allowed)
	}
}

func (ct *capTable) mustOverflow(p *policies.Policy, key string) {
	ct.t.Helper()
	c := ct.decide(p, key, false)
	if !c.Overflowed || c.Out != (keyrec.Decision{}) {
		ct.t.Fatalf("%s: overflowed %v, %+v; want overflowed, nothing decided", key, c.Overflowed, c.Out)
	}
}

func (ct *capTable) mustLive(policy string, want int) {
	ct.t.Helper()
	if got := ct.tbl.live.count(policy); got != want {
		ct.t.Fatalf("%d live keys of %s, want %d", got, policy, want)
	}
}

// TestMaxKeysOverflow: a policy keeps max_keys live keys; a new key beyond
// them is read once (it might be live from another owner), found absent
// and overflows with nothing decided or written; it overflows again
// without a read; the overflow key takes no place; the live keys keep
// their own state.
func TestMaxKeysOverflow(t *testing.T) {
	p := tbPolicy(t, "p", 1, "1/h", 1, `,"max_keys":2`)
	ct := newCapTable(t, newSyncStore(), 0, p)
	ct.mustDecide(p, "a", true)
	ct.mustDecide(p, "b", true)
	ct.mustLive("p", 2)
	ct.mustOverflow(p, "c")
	if g, u := ct.st.count(ct.st.gets, "c"), ct.st.count(ct.st.updates, "c"); g != 1 || u != 0 {
		t.Fatalf("the probe of c: %d reads, %d writes; want 1, 0", g, u)
	}
	ct.mustOverflow(p, "c")
	if g := ct.st.count(ct.st.gets, "c"); g != 1 {
		t.Fatalf("c overflowed again after %d reads, want no second read", g)
	}
	if ct.tbl.Len() != 2 {
		t.Fatalf("%d keys held, want 2 (an overflowed key is not kept)", ct.tbl.Len())
	}
	// The overflow key: one state for every overflowing key.
	ok := p.OverflowKey()
	if c := ct.decide(p, ok, true); c.Overflowed || !c.Out.Allowed {
		t.Fatalf("overflow key: %+v", c)
	}
	if c := ct.decide(p, ok, true); c.Overflowed || c.Out.Allowed {
		t.Fatalf("overflow key after its burst: %+v, want denied", c)
	}
	ct.mustLive("p", 2)
	// Live keys stay on their own state (spent: denied), never moved.
	ct.mustDecide(p, "a", false)
	ct.mustDecide(p, "b", false)
	// Another policy has places of its own.
	q := tbPolicy(t, "q", 1, "1/h", 1, `,"max_keys":1`)
	ct.env.add(q, 0)
	ct.mustDecide(q, "qa", true)
	ct.mustOverflow(q, "qb")
	ct.mustLive("q", 1)
}

// TestMaxKeysStoredKeyIsLive: at max_keys, a key this node does not hold
// but the store does (live at a previous owner of its partition, or
// before a restart) takes a place beyond max_keys and keeps its state.
func TestMaxKeysStoredKeyIsLive(t *testing.T) {
	p := tbPolicy(t, "p", 1, "1/h", 2, `,"max_keys":1`)
	st := newSyncStore()
	prev := newCapTable(t, st, 0, p)
	prev.mustDecide(p, "x", true) // x has 1 of 2 left, stored
	ct := newCapTable(t, st, 0, p)
	ct.mustDecide(p, "a", true)
	ct.mustDecide(p, "x", true)  // its last unit: the stored state
	ct.mustDecide(p, "x", false) // spent
	ct.mustLive("p", 2)
	ct.mustOverflow(p, "y")
	ct.mustLive("p", 2)
}

// TestMaxKeysSweptKeysRest: a key swept from memory before its state is at
// rest keeps its place (resting) and takes it back when it returns; at
// rest it gives the place up.
func TestMaxKeysSweptKeysRest(t *testing.T) {
	p := tbPolicy(t, "p", 1, "10/s", 10, `,"max_keys":1`) // at rest 1 s after its last use
	ct := newCapTable(t, newSyncStore(), 0, p)
	for range 10 {
		ct.mustDecide(p, "a", true)
	}
	ct.mustDecide(p, "a", false)
	ct.rt.now = ct.rt.now.Add(100 * time.Millisecond)
	ct.tbl.Sweep(ct.rt.now.UnixNano(), 50*time.Millisecond)
	if ct.tbl.Len() != 0 {
		t.Fatalf("%d keys held after the sweep, want 0", ct.tbl.Len())
	}
	ct.mustLive("p", 1) // a rests
	ct.mustOverflow(p, "b")
	// a comes back to its own (stored) state: one unit refilled.
	ct.mustDecide(p, "a", true)
	ct.mustDecide(p, "a", false)
	ct.mustLive("p", 1)
	// Swept again, then at rest: the place is free.
	ct.rt.now = ct.rt.now.Add(100 * time.Millisecond)
	ct.tbl.Sweep(ct.rt.now.UnixNano(), 50*time.Millisecond)
	ct.mustLive("p", 1)
	ct.rt.now = ct.rt.now.Add(time.Second)
	ct.tbl.Sweep(ct.rt.now.UnixNano(), 50*time.Millisecond)
	ct.mustLive("p", 0)
	ct.mustDecide(p, "b", true)
	ct.mustLive("p", 1)
}

// TestMaxKeysDropPartition: the keys of a partition that moved away leave
// the live set, held or resting, and so do the keys its probes found
// absent (the next owner may store them).
func TestMaxKeysDropPartition(t *testing.T) {
	p := tbPolicy(t, "p", 1, "1/h", 5, `,"max_keys":2`)
	ct := newCapTable(t, newSyncStore(), 0, p)
	ct.mustDecide(p, "a", true) // partition 'a'%4 = 1
	ct.mustDecide(p, "b", true) // partition 2
	ct.mustOverflow(p, "e")     // partition 1
	ct.rt.now = ct.rt.now.Add(time.Second)
	ct.tbl.Sweep(ct.rt.now.UnixNano(), time.Millisecond) // a and b rest (1/h)
	ct.mustLive("p", 2)
	ct.tbl.DropPartition(1)
	ct.mustLive("p", 1)
	ct.mustDecide(p, "e", true) // a place, read again
	if g := ct.st.count(ct.st.gets, "e"); g != 2 {
		t.Fatalf("e read %d times, want 2 (the probe, then as a new live key)", g)
	}
	ct.mustDecide(p, "b", true) // b kept its place
	ct.mustLive("p", 2)
}

// TestLocalMaxKeys: the local table keeps max_keys keys of a policy; a new
// key beyond them overflows (nothing decided), the overflow key takes no
// place, and a key at rest gives its place up.
func TestLocalMaxKeys(t *testing.T) {
	p := tbPolicy(t, "p", 1, "10/s", 4, `,"mode":"local","max_keys":2`)
	env := newFakeEnv(p)
	tbl := newLocalTable(100)
	now := int64(100 * sec)
	decide := func(key string, overflow bool) *Call {
		c := newCall(p, 1, now+sec)
		c.Overflow = overflow
		tbl.decide(env, key, c, now)
		if c.Err != nil {
			t.Fatalf("%s: %v", key, c.Err)
		}
		return c
	}
	for _, k := range []string{"a", "b", "a"} {
		if c := decide(k, false); c.Overflowed || !c.Out.Allowed {
			t.Fatalf("%s: %+v", k, c)
		}
	}
	if c := decide("c", false); !c.Overflowed || c.Out != (keyrec.Decision{}) {
		t.Fatalf("c: %+v, want overflowed", c)
	}
	for range 4 {
		if c := decide(p.OverflowKey(), true); c.Overflowed || !c.Out.Allowed {
			t.Fatalf("overflow key: %+v", c)
		}
	}
	if c := decide(p.OverflowKey(), true); c.Out.Allowed {
		t.Fatalf("overflow key past its burst: %+v", c)
	}
	// At rest, a and b give their places up (the forced sweep runs at
	// most once a second).
	now += restSpan(p) + localSweepEvery
	if c := decide("c", false); c.Overflowed || !c.Out.Allowed {
		t.Fatalf("c after the others came to rest: %+v", c)
	}
}

// TestMaxKeysProbeFails: a probe whose load fails answers 503 and leaves
// the table (it holds nothing); the key's next call probes again.
func TestMaxKeysProbeFails(t *testing.T) {
	p := tbPolicy(t, "p", 1, "1/h", 1, `,"max_keys":1`)
	st := newSyncStore()
	ct := newCapTable(t, st, 0, p)
	ct.mustDecide(p, "a", true)
	st.failGets = true
	now := ct.rt.now.UnixNano()
	c := &Call{Policy: p, Cost: kvstate.Unit, Deadline: now + int64(time.Second), Done: &ct.calls}
	ct.tbl.Submit("b", c, now, nil)
	if !errors.Is(c.Err, fail.ErrUnavailable) || c.Overflowed {
		t.Fatalf("a failed probe: err %v, overflowed %v; want fail.ErrUnavailable", c.Err, c.Overflowed)
	}
	if ct.tbl.Len() != 1 {
		t.Fatalf("%d keys held after a failed probe, want 1", ct.tbl.Len())
	}
	st.failGets = false
	ct.mustOverflow(p, "b")
	if g := st.count(st.gets, "b"); g != 2 {
		t.Fatalf("b read %d times, want 2", g)
	}
	ct.mustLive("p", 1)
}

// TestLiveKeysPlaces: a policy's keys take places up to MaxKeys; beyond
// it a key is a probe, and once a probe found it absent it overflows
// without a read until a place frees up or its partition moves away; a
// key released before it rests takes its own place back.
func TestLiveKeysPlaces(t *testing.T) {
	p := tbPolicy(t, "p", 1, "10/s", 10, `,"max_keys":1`)
	l := newLiveKeys(newFakeEnv(p))
	call := &Call{Policy: p}
	ls, probe, ok := l.place("a", call)
	if ls == nil || probe || !ok || l.count("p") != 1 {
		t.Fatalf("first key: %v %v %v, %d live", ls, probe, ok, l.count("p"))
	}
	if ls, probe, ok := l.place("b", call); ls != nil || !probe || !ok {
		t.Fatalf("a key beyond max_keys: %v %v %v, want a probe", ls, probe, ok)
	}
	l.noteAbsent("b", 3)
	if _, _, ok := l.place("b", call); ok {
		t.Fatal("a key found absent takes a place or probes again")
	}
	if _, probe, ok := l.place("b", &Call{Policy: p, Overflow: true}); probe || !ok {
		t.Fatal("an overflow key is capped")
	}
	// a, swept while its bucket refills, rests: it keeps its place.
	e := &Entry{o: newOwner(l.env, 1, 0), live: ls, lastUsed: 0}
	l.release("a", e, 0, true)
	if l.count("p") != 1 {
		t.Fatalf("%d live after a rests, want 1", l.count("p"))
	}
	if ls2, _, ok := l.place("a", call); ls2 != ls || !ok {
		t.Fatal("a resting key does not take its place back")
	}
	l.prune(0, 3) // partition 3 moved away: b may be stored there now
	if _, probe, ok := l.place("b", call); !probe || !ok {
		t.Fatalf("after its partition moved: probe %v ok %v, want a probe", probe, ok)
	}
}
