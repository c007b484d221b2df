package leasing

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/keys"
	"github.com/limitmesh/limitmesh/mesh/internal/ownership"
	"github.com/limitmesh/limitmesh/mesh/internal/policyset"
	"github.com/limitmesh/limitmesh/mesh/internal/route"
	"github.com/limitmesh/limitmesh/policies"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
)

// The tests here drive a holder node and an owner node, each the
// production Leasing, on one deterministic scheduler: the clock moves only
// when the test runs the queue, callbacks run one at a time on the test's
// goroutine, and requests cross an in-process network (a Requester that
// delivers to the owner's ServeOwner) with a fixed delay each way. The
// owner applies them through a real keys.Table over a store in memory.

// event is a callback at an instant of the scheduler.
type event struct {
	at      time.Time
	seq     uint64
	f       func()
	stopped bool
}

// sched is an rt.Runtime whose callbacks the test runs (run), in order of
// instant, then of scheduling.
type sched struct {
	now time.Time
	seq uint64
	q   []*event
}

func newSched() *sched { return &sched{now: time.Unix(1_700_000_000, 0)} }

func (s *sched) Now() time.Time { return s.now }

func (s *sched) AfterFunc(d time.Duration, f func()) func() bool {
	s.seq++
	e := &event{at: s.now.Add(max(d, 0)), seq: s.seq, f: f}
	s.q = append(s.q, e)
	return func() bool {
		if e.stopped || !slices.Contains(s.q, e) {
			return false
		}
		e.stopped = true
		return true
	}
}

func (s *sched) Go(f func()) { s.AfterFunc(0, f) }

// run runs every callback due within d, moving the clock to each, then to
// the end of d.
func (s *sched) run(d time.Duration) {
	end := s.now.Add(d)
	for len(s.q) > 0 {
		i := 0
		for j, e := range s.q {
			if e.at.Before(s.q[i].at) || e.at.Equal(s.q[i].at) && e.seq < s.q[i].seq {
				i = j
			}
		}
		e := s.q[i]
		if e.at.After(end) {
			break
		}
		s.q = slices.Delete(s.q, i, i+1)
		s.now = e.at
		if !e.stopped {
			e.f()
		}
	}
	s.now = end
}

// sent is a request the network carried: when, where, what, and the
// result of its reply ("": none, such as no responders).
type sent struct {
	at      time.Duration // since the scheduler's start
	subject string
	req     ownerRequest
	result  string
}

// network is an rt.Requester over a sched: a request reaches the handler
// of its subject after delay and its reply comes back after delay; with
// no handler the error is no responders (after delay), with no reply by
// the deadline it is context.DeadlineExceeded.
type network struct {
	s     *sched
	start time.Time
	delay time.Duration
	subs  map[string]func(Request)
	log   []*sent
}

func (n *network) Request(m *nats.Msg, deadline time.Time, done func(*nats.Msg, error)) {
	rec := &sent{at: n.s.Now().Sub(n.start), subject: m.Subject}
	if err := json.Unmarshal(m.Data, &rec.req); err != nil {
		panic(err)
	}
	n.log = append(n.log, rec)
	answered := false
	answer := func(r *nats.Msg, err error) {
		if !answered {
			answered = true
			done(r, err)
		}
	}
	n.s.AfterFunc(deadline.Sub(n.s.Now()), func() { answer(nil, context.DeadlineExceeded) })
	n.s.AfterFunc(n.delay, func() {
		h := n.subs[m.Subject]
		if h == nil {
			answer(nil, nats.ErrNoResponders)
			return
		}
		h(netRequest{data: m.Data, respond: func(b []byte) {
			var r reply
			_ = json.Unmarshal(b, &r)
			rec.result = r.Result
			n.s.AfterFunc(n.delay, func() { answer(&nats.Msg{Data: b}, nil) })
		}})
	})
}

// A micro.Request is a Request: the simulation's requests of the decide
// service serve the lease subjects too.
var _ Request = micro.Request(nil)

// netRequest is a request as the network delivers it.
type netRequest struct {
	data    []byte
	respond func([]byte)
}

func (r netRequest) Data() []byte { return r.data }

func (r netRequest) Respond(b []byte, _ ...micro.RespondOpt) error { r.respond(b); return nil }

// memStore is a keys.Store in memory whose answers come as callbacks of
// the scheduler.
type memStore struct {
	s    *sched
	recs map[string]memRec
}

type memRec struct {
	val []byte
	rev uint64
}

func (st *memStore) GetAsync(key string, _ time.Duration, done func([]byte, uint64, error)) {
	st.s.Go(func() {
		r, ok := st.recs[key]
		if !ok {
			done(nil, 0, kvstate.ErrNotFound)
			return
		}
		done(r.val, r.rev, nil)
	})
}

func (st *memStore) UpdateAsync(key string, value []byte, _ []keyrec.Usage, rev uint64, _ time.Duration, done func(uint64, error)) {
	st.s.Go(func() {
		if st.recs[key].rev != rev {
			done(0, kvstate.ErrConflict)
			return
		}
		st.recs[key] = memRec{val: value, rev: rev + 1}
		done(rev+1, nil)
	})
}

const (
	drivenPrefix = "t"
	drivenParts  = 4
	drivenDelay  = time.Millisecond
	drivenTTL    = 2 * time.Second
)

// world is a holder node ("n1") and an owner node ("o") of leased policy
// acme (grants of 10 units, a ttl of 2 s, a timeout of 500 ms).
type world struct {
	t      *testing.T
	s      *sched
	net    *network
	p      *policies.Policy
	store  *memStore
	route  *route.Table // the owner's
	owner  *Leasing
	holder *Leasing
}

func newWorld(t *testing.T) *world {
	t.Helper()
	p, err := policies.Parse("acme", []byte(`{"match":{"tenant":"*"},"limits":[{"algorithm":"token_bucket","rate":"10/s","burst":40}],`+
		`"mode":"leased","lease":{"size":10,"max_outstanding":40,"ttl":"2s"}}`))
	if err != nil {
		t.Fatal(err)
	}
	s := newSched()
	w := &world{t: t, s: s, p: p, store: &memStore{s: s, recs: map[string]memRec{}},
		net: &network{s: s, start: s.Now(), delay: drivenDelay, subs: map[string]func(Request){}}}
	set := policyset.New()
	set.Put(p, s.Now().UnixNano())
	w.route = route.New(drivenPrefix, drivenParts, s, s.Now())
	tbl := keys.New(keys.Config{Env: set, Store: w.store, Runtime: s,
		Partition: func(key string) int { return ownership.PartitionOf(key, drivenParts) }})
	node := func(self string, route *route.Table) *Leasing {
		l, err := New(Config{Requests: w.net, Prefix: drivenPrefix, Self: self, Policies: set, Keys: tbl, Route: route,
			Runtime: s, Timeout: 500 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	w.owner = node("o", w.route)
	w.holder = node("n1", route.New(drivenPrefix, drivenParts, s, s.Now()))
	return w
}

// key returns tenant's limit key and its partition.
func (w *world) key(tenant string) (string, int) {
	desc, err := descriptorOf(map[string]string{"tenant": tenant})
	if err != nil {
		w.t.Fatal(err)
	}
	key, err := w.p.LimitKey(desc)
	if err != nil {
		w.t.Fatal(err)
	}
	return key, ownership.PartitionOf(key, drivenParts)
}

// subscribe has the owner node take the owner subjects of every partition.
func (w *world) subscribe() {
	for p := range drivenParts {
		w.net.subs[OwnerSubject(drivenPrefix, p)] = w.owner.ServeOwner
	}
}

// serve has the owner node serve every partition in epoch.
func (w *world) serve(epoch uint64) {
	for p := range drivenParts {
		w.route.Set(p, epoch, math.MaxInt64)
	}
}

// spend decides a request of a unit of tenant's key from the holder's
// grants; ok false: at the owner.
func (w *world) spend(tenant string) (keyrec.Decision, bool) {
	key, part := w.key(tenant)
	return w.holder.Spend(w.p, key, part, u, w.s.Now())
}

// grants returns the grants in tenant's record at the owner.
func (w *world) grants(tenant string) []keyrec.Grant {
	w.t.Helper()
	key, _ := w.key(tenant)
	r, ok := w.store.recs[key]
	if !ok {
		return nil
	}
	rec, err := keyrec.Decode(r.val)
	if err != nil {
		w.t.Fatal(err)
	}
	return rec.Grants
}

func (r *sent) String() string {
	return fmt.Sprintf("%v %s %+v -> %s", r.at, r.subject, r.req, r.result)
}

// requests returns the requests sent since the n-th.
func (w *world) requests(from int) []*sent { return w.net.log[from:] }

// at runs the queue until d after the start.
func (w *world) at(d time.Duration) { w.s.run(w.net.start.Add(d).Sub(w.s.Now())) }

// TestDrivenLeased: a plain decision finds no grant, so the holder asks
// the key's owner for one: while nothing serves the partition (no
// responders, then not_owner) it asks again every 3 ms, then gets the
// grant, written in the key's record; decisions spend from it; a tick
// reports its use, which the record takes; Return gives it back with what
// was spent, calls back once answered, and ends the ticks.
func TestDrivenLeased(t *testing.T) {
	w := newWorld(t)
	w.s.AfterFunc(8*time.Millisecond, w.subscribe)
	w.s.AfterFunc(15*time.Millisecond, func() { w.serve(41) })
	if _, ok := w.spend("a"); ok {
		t.Fatal("spent before any grant")
	}
	w.at(50 * time.Millisecond)
	reqs := w.requests(0)
	var results []string
	for i, r := range reqs {
		if r.req.Op != opAcquire || r.req.Holder != "n1" || r.req.Want != 10*u || r.req.Min != u {
			t.Fatalf("request %+v", r.req)
		}
		if i > 0 && r.at-reqs[i-1].at < retryEvery {
			t.Fatalf("sent again %v after the last", r.at-reqs[i-1].at)
		}
		results = append(results, r.result)
	}
	// No responders until 8 ms, then not_owner until 15 ms.
	if got := strings.Join(results, ","); got != ",,not_owner,not_owner,granted" {
		t.Fatalf("results %s", got)
	}
	if g := w.grants("a"); len(g) != 1 || g[0].Holder != "n1" || g[0].Units != 10*u || g[0].Epoch != 41 {
		t.Fatalf("grants in the record: %+v", g)
	}
	if d, ok := w.spend("a"); !ok || !d.Allowed || d.Remaining != 9*u {
		t.Fatalf("spend from the grant: %+v %v", d, ok)
	}

	w.holder.Start()
	for i := range 3 {
		w.at(time.Duration(100*(i+1)) * time.Millisecond)
		if _, ok := w.spend("a"); !ok {
			t.Fatal("spend from the grant")
		}
	}
	n := len(w.net.log)
	w.at(600 * time.Millisecond) // past a quarter ttl: the use is reported
	reqs = w.requests(n)
	if len(reqs) != 1 || reqs[0].req.Op != opReport || reqs[0].req.Grant != 1 || reqs[0].req.Epoch != 41 || reqs[0].req.Spent != 4*u || reqs[0].result != resOK {
		t.Fatalf("requests after the spends: %+v", reqs)
	}
	if g := w.grants("a"); len(g) != 1 || g[0].Spent != 4*u {
		t.Fatalf("grants after the report: %+v", g)
	}

	n = len(w.net.log)
	returned := time.Duration(-1)
	w.holder.Return(func() { returned = w.s.Now().Sub(w.net.start) })
	if returned >= 0 {
		t.Fatal("Return called back before it returned")
	}
	w.at(650 * time.Millisecond)
	reqs = w.requests(n)
	if len(reqs) != 1 || reqs[0].req.Op != opReturn || reqs[0].req.Grant != 1 || reqs[0].req.Spent != 4*u || reqs[0].result != resOK {
		t.Fatalf("requests after Return: %+v", reqs)
	}
	if returned < reqs[0].at+2*drivenDelay {
		t.Fatalf("Return called back at %v, before the return was answered", returned)
	}
	if g := w.grants("a"); len(g) != 0 {
		t.Fatalf("grants after the return: %+v", g)
	}
	if _, ok := w.spend("a"); ok {
		t.Fatal("spent after Return")
	}
	n = len(w.net.log)
	w.at(5 * time.Second)
	if reqs := w.requests(n); len(reqs) != 0 {
		t.Fatalf("requests after Return: %+v", reqs)
	}
}

// TestDrivenStale: the owner refuses a report of the grant's epoch once
// the partition is in a greater one; the holder marks the grant stale:
// it spends it to its deadline and reports it no more.
func TestDrivenStale(t *testing.T) {
	w := newWorld(t)
	w.subscribe()
	w.serve(41)
	w.spend("a")
	w.holder.Start()
	w.at(100 * time.Millisecond)
	w.serve(42) // the partition moved
	spendEvery := func(from, to time.Duration) {
		for at := from; at <= to; at += 100 * time.Millisecond {
			w.at(at)
			if _, ok := w.spend("a"); !ok {
				t.Fatalf("%v: spend from the grant", at)
			}
		}
	}
	spendEvery(100*time.Millisecond, 400*time.Millisecond)
	n := len(w.net.log)
	w.at(600 * time.Millisecond)
	reqs := w.requests(n)
	if len(reqs) != 1 || reqs[0].req.Op != opReport || reqs[0].req.Epoch != 41 || reqs[0].result != resStale {
		t.Fatalf("requests: %+v", reqs)
	}
	key, part := w.key("a")
	e := w.holder.lookup(w.p, key, part)
	if held := e.pool.Held(); len(held) != 1 || !held[0].Stale {
		t.Fatalf("held %+v, want the grant stale", held)
	}
	spendEvery(700*time.Millisecond, 1500*time.Millisecond)
	for _, r := range w.requests(n + 1) {
		if r.req.Grant == 1 && r.req.Op == opReport {
			t.Fatalf("stale grant reported: %+v", r)
		}
	}
}

// TestDrivenTimeout: while no node serves the partition the holder asks
// again every 3 ms until the timeout, then the acquire ends with no grant
// (and requests go to the owner for a while).
func TestDrivenTimeout(t *testing.T) {
	w := newWorld(t)
	w.subscribe() // never served: not_owner
	w.spend("a")
	key, part := w.key("a")
	e := w.holder.lookup(w.p, key, part)
	e.mu.Lock()
	done := e.done
	e.mu.Unlock()
	w.at(499 * time.Millisecond)
	select {
	case <-done:
		t.Fatal("the acquire ended before its timeout")
	default:
	}
	w.at(510 * time.Millisecond)
	select {
	case <-done:
	default:
		t.Fatal("the acquire did not end at its timeout")
	}
	reqs := w.requests(0)
	// Each attempt: 1 ms there, 1 ms back, 3 ms later the next.
	if len(reqs) != 100 {
		t.Fatalf("%d attempts, want 100", len(reqs))
	}
	for _, r := range reqs {
		if r.at >= 500*time.Millisecond || r.result != resNotOwner && r.at < 498*time.Millisecond {
			t.Fatalf("attempt %+v", r)
		}
	}
	if _, ok := w.spend("a"); ok {
		t.Fatal("spent with no grant")
	}
}

// TestDrivenReturnLate: a grant that arrives after Return is returned at
// once, and Return calls back only once that return is answered.
func TestDrivenReturnLate(t *testing.T) {
	w := newWorld(t)
	w.subscribe()
	w.serve(41)
	w.spend("a") // the acquire is in flight
	returned := false
	w.holder.Return(func() { returned = true })
	w.at(time.Millisecond)
	if returned {
		t.Fatal("called back with the acquire in flight")
	}
	w.at(100 * time.Millisecond)
	var ops []string
	for _, r := range w.requests(0) {
		ops = append(ops, r.req.Op+":"+r.result)
	}
	if got := strings.Join(ops, ","); got != "acquire:granted,return:ok" || !returned {
		t.Fatalf("requests %s, called back %v", got, returned)
	}
	if g := w.grants("a"); len(g) != 0 {
		t.Fatalf("grants: %+v", g)
	}
}

// TestDrivenReturnNothing: with nothing held and nothing in flight,
// Return calls back on a callback of its own.
func TestDrivenReturnNothing(t *testing.T) {
	w := newWorld(t)
	returned := false
	w.holder.Return(func() { returned = true })
	if returned {
		t.Fatal("called back before Return returned")
	}
	w.s.run(0)
	if !returned {
		t.Fatal("not called back")
	}
}

// TestDrivenStartStop: the ticks end when Start's stop is called: a
// grant past its deadline is not returned any more.
func TestDrivenStartStop(t *testing.T) {
	w := newWorld(t)
	w.subscribe()
	w.serve(41)
	w.spend("a")
	stop := w.holder.Start()
	w.at(100 * time.Millisecond)
	stop()
	n := len(w.net.log)
	w.at(3 * time.Second)
	if reqs := w.requests(n); len(reqs) != 0 {
		t.Fatalf("requests after stop: %+v", reqs)
	}
	if g := w.grants("a"); len(g) != 1 {
		t.Fatalf("grants: %+v", g)
	}
}

// TestDrivenOrder: the requests a tick or Return sends for several keys
// go out in key order, so a run replays exactly: two runs of the same
// schedule send the same requests at the same instants.
func TestDrivenOrder(t *testing.T) {
	tenants := []string{"h", "c", "f", "a", "g", "b", "e", "d"}
	run := func() []sent {
		w := newWorld(t)
		w.subscribe()
		w.serve(41)
		w.holder.Start()
		for _, tn := range tenants {
			w.spend(tn)
		}
		for at := 50 * time.Millisecond; at < 500*time.Millisecond; at += 100 * time.Millisecond {
			w.at(at)
			for _, tn := range tenants {
				if _, ok := w.spend(tn); !ok {
					t.Fatalf("spend of %s", tn)
				}
			}
		}
		w.at(600 * time.Millisecond) // every grant reported in one tick
		w.holder.Return(func() {})
		w.at(700 * time.Millisecond)
		var out []sent
		for _, r := range w.net.log {
			out = append(out, *r)
		}
		return out
	}
	a := run()
	for _, op := range []string{opReport, opReturn} {
		var keys []string
		for _, r := range a {
			if r.req.Op == op {
				keys = append(keys, r.req.Key)
			}
		}
		if len(keys) != len(tenants) || !slices.IsSorted(keys) {
			t.Fatalf("%ss sent for %v, want every key once in order", op, keys)
		}
	}
	if b := run(); !slices.Equal(a, b) {
		t.Fatalf("two runs differ:\n%+v\n%+v", a, b)
	}
}

// TestDrivenBadRequest: ServeOwner answers what it cannot decode at once.
func TestDrivenBadRequest(t *testing.T) {
	w := newWorld(t)
	var got []byte
	w.owner.ServeOwner(netRequest{data: []byte(`{"op":"steal"}`), respond: func(b []byte) { got = b }})
	var r reply
	if err := json.Unmarshal(got, &r); err != nil || r.Result != resBadRequest {
		t.Fatalf("reply %s: %v", got, err)
	}
	got = nil
	w.owner.ServeOwner(netRequest{data: []byte(`{"op":"acquire","policy":"other","key":"p.other","holder":"n1","want":1}`), respond: func(b []byte) { got = b }})
	if err := json.Unmarshal(got, &r); err != nil || r.Result != resNotLeased {
		t.Fatalf("reply %s: %v", got, err)
	}
}
