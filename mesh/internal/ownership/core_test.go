package ownership

import (
	"errors"
	"reflect"
	"slices"
	"strconv"
	"testing"
)

// simKV is an in-memory shards bucket with per-key revisions from one
// sequence (as a JetStream stream), CAS and delete markers.
type simKV struct {
	seq     uint64
	entries map[string]simEntry
}

type simEntry struct {
	v       partValue
	rev     uint64
	deleted bool
}

var errSimConflict = errors.New("sim: revision mismatch")

func (kv *simKV) cas(key string, v partValue, rev uint64, del bool) (uint64, error) {
	if kv.entries[key].rev != rev {
		return 0, errSimConflict
	}
	kv.seq++
	kv.entries[key] = simEntry{v: v, rev: kv.seq, deleted: del}
	return kv.seq, nil
}

// sim is a mesh of shard cores on one simKV with one explicit clock. Every
// write is delivered to every running core at once (a watch without lag),
// unless the core is paused.
type sim struct {
	t      *testing.T
	lease  int64
	parts  int
	now    int64
	kv     *simKV
	cores  map[string]*shardCore
	down   map[string]bool // killed: no ticks, no deliveries
	failIO map[string]bool // its writes fail (cut off from the KV)
}

func newSim(t *testing.T, parts int) *sim {
	return &sim{t: t, lease: 3000, parts: parts, now: 1, kv: &simKV{entries: map[string]simEntry{}},
		cores: map[string]*shardCore{}, down: map[string]bool{}, failIO: map[string]bool{}}
}

// join starts a core that first observes every existing entry.
func (s *sim) join(id string) *shardCore {
	c := newShardCore(id, s.parts, s.lease)
	for k, e := range s.kv.entries {
		s.deliverTo(c, k, e)
	}
	s.cores[id] = c
	return c
}

func (s *sim) deliverTo(c *shardCore, key string, e simEntry) {
	if id, ok := cutPrefix(key, "node."); ok {
		c.observeNode(id, e.rev, e.deleted, s.now)
		return
	}
	if p, ok := cutPrefix(key, "part."); ok {
		n, _ := strconv.Atoi(p)
		c.observePart(n, e.v, e.rev, e.deleted, s.now)
	}
}

func cutPrefix(s, p string) (string, bool) {
	if len(s) >= len(p) && s[:len(p)] == p {
		return s[len(p):], true
	}
	return "", false
}

func (s *sim) broadcast(key string) {
	e := s.kv.entries[key]
	for id, c := range s.cores {
		if !s.down[id] {
			s.deliverTo(c, key, e)
		}
	}
}

// step ticks every running core once at the current time and executes
// their operations synchronously.
func (s *sim) step() {
	for _, id := range sortedKeys(s.cores) {
		if s.down[id] {
			continue
		}
		c := s.cores[id]
		for _, op := range c.tick(s.now) {
			s.exec(id, c, op)
		}
	}
}

func sortedKeys(m map[string]*shardCore) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	for i := range ks {
		for j := i + 1; j < len(ks); j++ {
			if ks[j] < ks[i] {
				ks[i], ks[j] = ks[j], ks[i]
			}
		}
	}
	return ks
}

func (s *sim) exec(id string, c *shardCore, op shardOp) {
	key := "part." + strconv.Itoa(op.part)
	var rev uint64
	var err error
	if s.failIO[id] {
		err = errors.New("sim: timeout")
	}
	switch op.kind {
	case opHeartbeat:
		if err == nil {
			key = "node." + id
			s.kv.seq++
			s.kv.entries[key] = simEntry{rev: s.kv.seq}
		}
		c.beat(op, s.kv.seq, err)
	case opClaim:
		if err == nil {
			rev, err = s.kv.cas(key, partValue{Node: id}, op.rev, false)
		}
		c.claimed(op, rev, err, s.now)
	case opRenew:
		if err == nil {
			rev, err = s.kv.cas(key, partValue{Node: id, Epoch: op.epoch}, op.rev, false)
		}
		c.renewed(op, rev, err, errors.Is(err, errSimConflict), s.now)
	case opRelease:
		if err == nil {
			_, err = s.kv.cas(key, partValue{}, op.rev, true)
		}
		c.released(op, err == nil, s.now)
	}
	if err == nil {
		s.broadcast(key)
	}
}

// run advances the clock by dt per step for steps steps.
func (s *sim) run(steps int, dt int64) {
	for range steps {
		s.now += dt
		s.step()
	}
}

// owners returns, per partition, the running cores that serve it now.
func (s *sim) owners() [][]string {
	out := make([][]string, s.parts)
	for _, id := range sortedKeys(s.cores) {
		if s.down[id] {
			continue
		}
		for p := range s.parts {
			if _, ok := s.cores[id].serving(p, s.now); ok {
				out[p] = append(out[p], id)
			}
		}
	}
	return out
}

// checkExclusive fails when a partition is served by more than one core.
func (s *sim) checkExclusive() {
	s.t.Helper()
	for p, o := range s.owners() {
		if len(o) > 1 {
			s.t.Fatalf("t=%d: partition %d served by %v", s.now, p, o)
		}
	}
}

func (s *sim) epochs() []uint64 {
	e := make([]uint64, s.parts)
	for p := range s.parts {
		ent := s.kv.entries["part."+strconv.Itoa(p)]
		if !ent.deleted {
			e[p] = ent.v.Epoch
			if e[p] == 0 {
				e[p] = ent.rev
			}
		}
	}
	return e
}

func hrwAssign(nodes []string, parts int) []string {
	out := make([]string, parts)
	for p := range parts {
		out[p] = hrwTarget(nodes, p)
	}
	return out
}

func TestHRWSpreadAndMinimalMovement(t *testing.T) {
	const parts = 1024
	nodes := []string{"a1", "b2", "c3"}
	before := hrwAssign(nodes, parts)
	count := map[string]int{}
	for _, n := range before {
		count[n]++
	}
	for _, n := range nodes {
		// Even spread: each of 3 nodes within 20% of parts/3.
		if c := count[n]; c < parts/3*8/10 || c > parts/3*12/10 {
			t.Fatalf("node %s got %d of %d partitions: %v", n, c, parts, count)
		}
	}
	// A join moves only partitions to the new node, about parts/4 of them.
	after := hrwAssign(append(nodes, "d4"), parts)
	moved := 0
	for p := range parts {
		if before[p] != after[p] {
			moved++
			if after[p] != "d4" {
				t.Fatalf("partition %d moved %s -> %s on a join of d4", p, before[p], after[p])
			}
		}
	}
	if moved < parts/4*8/10 || moved > parts/4*12/10 {
		t.Fatalf("a join moved %d of %d partitions, want about %d", moved, parts, parts/4)
	}
	// A leave moves only the leaver's partitions.
	left := hrwAssign([]string{"a1", "c3"}, parts)
	for p := range parts {
		if before[p] != "b2" && before[p] != left[p] {
			t.Fatalf("partition %d moved %s -> %s on the leave of b2", p, before[p], left[p])
		}
		if left[p] == "b2" {
			t.Fatalf("partition %d still on b2 after it left", p)
		}
	}
	// Order of the node list does not matter.
	if got := hrwTarget([]string{"c3", "a1", "b2"}, 5); got != before[5] {
		t.Fatalf("target depends on list order: %s vs %s", got, before[5])
	}
}

func TestShardSingleNodeClaimsAll(t *testing.T) {
	s := newSim(t, 16)
	s.join("a")
	s.run(1, 10)
	for p, o := range s.owners() {
		if len(o) != 1 || o[0] != "a" {
			t.Fatalf("partition %d owners %v", p, o)
		}
	}
	ep := s.epochs()
	for p := range s.parts {
		if ep[p] == 0 || s.cores["a"].mine[p].epoch != ep[p] {
			t.Fatalf("partition %d epoch %d, core %d", p, ep[p], s.cores["a"].mine[p].epoch)
		}
	}
	// Renewals keep the epoch and move the revision.
	s.run(20, s.lease/6)
	ep2 := s.epochs()
	for p := range s.parts {
		if ep2[p] != ep[p] {
			t.Fatalf("partition %d: epoch changed on renewal %d -> %d", p, ep[p], ep2[p])
		}
		if s.kv.entries["part."+strconv.Itoa(p)].rev <= ep[p] {
			t.Fatalf("partition %d was never renewed", p)
		}
	}
	s.checkExclusive()
}

func TestShardJoinSpreadsGracefully(t *testing.T) {
	s := newSim(t, 64)
	s.join("a")
	s.run(2, 10)
	ep := s.epochs()
	s.join("b")
	s.join("c")
	for range 10 {
		s.run(1, 10)
		s.checkExclusive()
	}
	owners := s.owners()
	count := map[string]int{}
	live := []string{"a", "b", "c"}
	for p, o := range owners {
		if len(o) != 1 {
			t.Fatalf("partition %d owners %v after the joins", p, o)
		}
		if want := hrwTarget(live, p); o[0] != want {
			t.Fatalf("partition %d on %s, HRW target %s", p, o[0], want)
		}
		count[o[0]]++
	}
	ep2 := s.epochs()
	for p, o := range owners {
		if o[0] != "a" && ep2[p] <= ep[p] {
			t.Fatalf("partition %d moved to %s in epoch %d, not greater than %d", p, o[0], ep2[p], ep[p])
		}
		if o[0] == "a" && ep2[p] != ep[p] {
			t.Fatalf("partition %d stayed on a but its epoch changed", p)
		}
	}
	for _, id := range live {
		if count[id] < 10 {
			t.Fatalf("uneven spread %v", count)
		}
	}
	if c := s.cores["a"]; c.releases != count["b"]+count["c"] || c.losses != 0 {
		t.Fatalf("a: releases %d losses %d, want %d releases", c.releases, c.losses, count["b"]+count["c"])
	}
}

func TestShardDeadOwnerExpiresAfterLease(t *testing.T) {
	s := newSim(t, 8)
	s.join("a")
	s.run(1, 10)
	ep := s.epochs()
	s.down["a"] = true // killed: no renewals, no heartbeats
	b := s.join("b")
	joined := s.now
	// Before the lease has passed (as b observes it), b claims nothing.
	for s.now+100 < joined+s.lease {
		s.run(1, 100)
		if k := b.owned(); k != 0 {
			t.Fatalf("t=%d: b claimed %d partitions while a's lease is live", s.now-joined, k)
		}
	}
	s.run(3, 100)
	if k := b.owned(); k != s.parts {
		t.Fatalf("b owns %d partitions after the lease, want %d", k, s.parts)
	}
	ep2 := s.epochs()
	for p := range s.parts {
		if ep2[p] <= ep[p] {
			t.Fatalf("partition %d: epoch %d after the takeover, not above %d", p, ep2[p], ep[p])
		}
	}
}

func TestShardSelfFenceBeforeOthersClaim(t *testing.T) {
	s := newSim(t, 4)
	a := s.join("a")
	b := s.join("b")
	s.run(1, 10)
	var aParts []int
	for p := range s.parts {
		if a.holds(p) {
			aParts = append(aParts, p)
		}
	}
	if len(aParts) == 0 {
		t.Fatal("HRW gave node a no partition of 4 with ids a and b: the test needs ids that split them")
	}
	// a is cut off from the KV: its renewals and heartbeats fail.
	s.failIO["a"] = true
	for range 100 {
		s.run(1, 50)
		for _, p := range aParts {
			_, aServes := a.serving(p, s.now)
			bHolds := b.holds(p)
			if aServes && bHolds {
				t.Fatalf("t=%d: partition %d served by a while b holds it", s.now, p)
			}
		}
		s.checkExclusive()
	}
	for _, p := range aParts {
		if _, ok := a.serving(p, s.now); ok {
			t.Fatalf("a still serves partition %d without renewals", p)
		}
		if !b.holds(p) {
			t.Fatalf("b did not take over partition %d", p)
		}
	}
	// When a reconnects, its renewal loses the CAS: the partition is lost,
	// and it never serves it again in its old epoch.
	s.failIO["a"] = false
	s.run(5, 50)
	for _, p := range aParts {
		if a.holds(p) && a.mine[p].epoch == b.mine[p].epoch {
			t.Fatalf("partition %d: a and b share epoch %d", p, a.mine[p].epoch)
		}
	}
	s.checkExclusive()
}

func TestShardForeignEntryLosesPartition(t *testing.T) {
	s := newSim(t, 2)
	a := s.join("a")
	s.run(1, 10)
	// Someone else takes partition 0 (CAS on the current revision).
	e := s.kv.entries["part.0"]
	if _, err := s.kv.cas("part.0", partValue{Node: "z"}, e.rev, false); err != nil {
		t.Fatal(err)
	}
	s.broadcast("part.0")
	if a.holds(0) || a.losses != 1 {
		t.Fatalf("a holds partition 0 after a foreign claim (losses %d)", a.losses)
	}
	if lost := a.takeLost(); len(lost) != 1 || lost[0] != 0 {
		t.Fatalf("lost = %v", lost)
	}
	// z never renews: after the lease a claims it back in a greater epoch.
	before := s.kv.entries["part.0"].rev
	s.run(int(s.lease/100)+2, 100)
	if !a.holds(0) || a.mine[0].epoch <= before {
		t.Fatalf("a holds %v epoch %d, want a claim above %d", a.holds(0), a.mine[0].epoch, before)
	}
}

func TestShardLeaveReleasesEverything(t *testing.T) {
	s := newSim(t, 16)
	a := s.join("a")
	b := s.join("b")
	s.run(2, 10)
	a.leaving = true
	// The node entry is deleted on leave.
	s.kv.seq++
	s.kv.entries["node.a"] = simEntry{rev: s.kv.seq, deleted: true}
	s.broadcast("node.a")
	s.run(3, 10)
	if !a.empty() {
		t.Fatalf("a still holds partitions after leaving")
	}
	if k := b.owned(); k != s.parts {
		t.Fatalf("b owns %d of %d after a left", k, s.parts)
	}
	s.checkExclusive()
}

func TestShardRestartWithSameIDReclaims(t *testing.T) {
	s := newSim(t, 4)
	s.join("a")
	s.run(1, 10)
	ep := s.epochs()
	delete(s.cores, "a") // crashed
	a2 := s.join("a")    // same id, fresh state
	s.run(1, 10)
	ep2 := s.epochs()
	for p := range s.parts {
		if !a2.holds(p) || ep2[p] <= ep[p] {
			t.Fatalf("partition %d: restarted node holds %v in epoch %d (before %d)", p, a2.holds(p), ep2[p], ep[p])
		}
	}
}

func TestShardSettled(t *testing.T) {
	s := newSim(t, 4)
	a := s.join("a")
	if a.settled(s.now) {
		t.Fatal("settled before any claim")
	}
	s.run(1, 10)
	if !a.settled(s.now) {
		t.Fatal("not settled after claiming everything")
	}
	b := s.join("b")
	if !b.settled(s.now) {
		t.Fatal("a joining node with every partition owned by a live node is settled")
	}
}

func TestPartValueRoundTrip(t *testing.T) {
	for _, v := range []partValue{{Node: "a"}, {Node: "node-1_X", Epoch: 77}, {Node: "b", From: []string{"a", "c-1"}}} {
		got, err := decodePartValue(appendPartValue(nil, v))
		if err != nil || !reflect.DeepEqual(got, v) {
			t.Fatalf("%+v -> %+v, %v", v, got, err)
		}
	}
	for _, bad := range []string{"", "{}", `{"node":""}`, `{"node":"a b"}`, `{"node":1}`, "nul",
		`{"node":"a","from":["b c"]}`, `{"node":"a","from":["1","2","3","4","5","6","7","8","9"]}`} {
		if _, err := decodePartValue([]byte(bad)); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("%q: err %v, want ErrCorrupt", bad, err)
		}
	}
}

func FuzzDecodePartValue(f *testing.F) {
	f.Add([]byte(`{"node":"a","epoch":3}`))
	f.Add([]byte(`{"node":"a"}`))
	f.Add([]byte(`{"epoch":-1}`))
	f.Add([]byte(`[]`))
	f.Add([]byte(`{"node":"b","from":["a"]}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		v, err := decodePartValue(b)
		if err != nil {
			return
		}
		again, err := decodePartValue(appendPartValue(nil, v))
		if err != nil || !reflect.DeepEqual(again, v) {
			t.Fatalf("re-encoding %+v: %+v, %v", v, again, err)
		}
	})
}

func TestAdoptSources(t *testing.T) {
	many := []string{"n0", "n1", "n2", "n3", "n4", "n5", "n6", "n7"}
	cases := []struct {
		name string
		o    partObs
		want []string
	}{
		{"absent", partObs{}, nil},
		{"deleted entry keeps no sources", partObs{exists: false, node: "b", from: []string{"a"}}, nil},
		{"renewed entry", partObs{exists: true, node: "b"}, []string{"b"}},
		{"unfinished claim", partObs{exists: true, node: "b", from: []string{"a"}}, []string{"a", "b"}},
		{"duplicates: the last place wins", partObs{exists: true, node: "b", from: []string{"a", "b", "a", "c"}}, []string{"a", "c", "b"}},
		{"claimed back", partObs{exists: true, node: "a", from: []string{"a", "b"}}, []string{"b", "a"}},
		{"invalid ids", partObs{exists: true, node: "?", from: []string{"", "a b", "a", "x/y"}}, []string{"a"}},
		{"capped, newest kept", partObs{exists: true, node: "x", from: many}, append(slices.Clone(many[1:]), "x")},
		{"at the cap", partObs{exists: true, node: "n7", from: many[:7]}, many},
	}
	for _, c := range cases {
		got := adoptSources(c.o)
		if !reflect.DeepEqual(got, c.want) {
			t.Errorf("%s: adoptSources(%+v) = %q, want %q", c.name, c.o, got, c.want)
		}
		if len(got) > maxAdoptSources {
			t.Errorf("%s: %d sources, above maxAdoptSources", c.name, len(got))
		}
	}
	// The observed entry's sources are not modified.
	o := partObs{exists: true, node: "b", from: []string{"a"}}
	_ = adoptSources(o)
	if !reflect.DeepEqual(o.from, []string{"a"}) {
		t.Fatalf("adoptSources modified its input: %q", o.from)
	}
}

// partsTargeting returns the partitions of parts whose HRW target among
// nodes is node.
func partsTargeting(nodes []string, node string, parts int) []int {
	var ps []int
	for p := range parts {
		if hrwTarget(nodes, p) == node {
			ps = append(ps, p)
		}
	}
	return ps
}

func opsOf(ops []shardOp, p int) []shardOp {
	var out []shardOp
	for _, op := range ops {
		if op.part == p && op.kind != opHeartbeat {
			out = append(out, op)
		}
	}
	return out
}

// TestShardUnfinishedClaimNotReleased: an own claim entry (epoch 0) that
// carries adoption sources, of a partition whose target is another live
// node, is left to expire (deleting it would lose the sources), while an
// own entry without sources is released. The target then claims it over
// the expired entry with the sources and this node.
func TestShardUnfinishedClaimNotReleased(t *testing.T) {
	const parts, lease = 16, 3000
	toB := partsTargeting([]string{"a", "b"}, "b", parts)
	if len(toB) < 2 {
		t.Fatalf("partitions targeting b: %v", toB)
	}
	withFrom, plain := toB[0], toB[1]
	a, b, now := twoLiveCores(parts, lease)
	for _, c := range []*shardCore{a, b} {
		c.observePart(withFrom, partValue{Node: "a", From: []string{"c"}}, 10, false, now)
		c.observePart(plain, partValue{Node: "a"}, 11, false, now)
	}
	// Both entries are this incarnation's (claims whose outcome it did
	// not learn).
	a.sent[withFrom], a.sent[plain] = true, true
	ops := a.tick(now)
	if got := opsOf(ops, withFrom); len(got) != 0 {
		t.Fatalf("own unfinished claim of partition %d: ops %+v, want none", withFrom, got)
	}
	if got := opsOf(ops, plain); len(got) != 1 || got[0].kind != opRelease || got[0].rev != 11 {
		t.Fatalf("own entry without sources of partition %d: ops %+v, want one release at rev 11", plain, got)
	}
	// Still not released later, nor claimed back by a (not its target),
	// as long as b is live.
	for _, dt := range []int64{lease / 3, lease - 1, lease, 2 * lease} {
		a.observeNode("b", uint64(2+dt), false, now+dt)
		if got := opsOf(a.tick(now+dt), withFrom); len(got) != 0 {
			t.Fatalf("at +%d: ops %+v for partition %d, want none", dt, got, withFrom)
		}
		if a.mine[withFrom].state != holdNone {
			t.Fatalf("at +%d: a holds partition %d in state %d", dt, withFrom, a.mine[withFrom].state)
		}
	}
	// b, the target, waits for the lease, then claims over the expired
	// entry, adopting from its sources and from a.
	b.observeNode("b", 3, false, now+lease/3)
	if got := opsOf(b.tick(now+lease-1), withFrom); len(got) != 0 {
		t.Fatalf("b before the lease: %+v", got)
	}
	got := opsOf(b.tick(now+lease), withFrom)
	if len(got) != 1 || got[0].kind != opClaim || got[0].rev != 10 || !reflect.DeepEqual(got[0].sources, []string{"c", "a"}) {
		t.Fatalf("b after the lease: ops %+v, want a claim at rev 10 from [c a]", got)
	}
}

// TestShardClaimCarriesSources: a claim over the expired entry of another
// node adopts from that node; a claim of a partition without entry adopts
// from none.
func TestShardClaimCarriesSources(t *testing.T) {
	const parts, lease = 4, 3000
	a := newShardCore("a", parts, lease)
	now := int64(1)
	a.observeNode("b", 1, false, now) // b's heartbeat, never renewed
	a.observePart(1, partValue{Node: "b", Epoch: 5}, 7, false, now)
	a.observePart(2, partValue{Node: "b"}, 8, false, now)
	a.observePart(3, partValue{Node: "b"}, 9, true, now) // released by b
	// While b is live and its entries fresh, a claims only what has no
	// entry and targets it.
	for _, op := range a.tick(now) {
		if op.kind == opClaim && op.part != 0 && op.part != 3 {
			t.Fatalf("claim of partition %d with b's entry fresh: %+v", op.part, op)
		}
	}
	a = newShardCore("a", parts, lease)
	a.observeNode("b", 1, false, now)
	a.observePart(1, partValue{Node: "b", Epoch: 5}, 7, false, now)
	a.observePart(2, partValue{Node: "b"}, 8, false, now)
	a.observePart(3, partValue{Node: "b"}, 9, true, now)
	ops := a.tick(now + lease)
	want := map[int]struct {
		rev     uint64
		sources []string
	}{
		0: {0, nil},
		1: {7, []string{"b"}},
		2: {8, []string{"b"}},
		3: {9, nil},
	}
	for p, w := range want {
		got := opsOf(ops, p)
		if len(got) != 1 || got[0].kind != opClaim || got[0].rev != w.rev || !reflect.DeepEqual(got[0].sources, w.sources) {
			t.Fatalf("partition %d: ops %+v, want a claim at rev %d from %q", p, got, w.rev, w.sources)
		}
	}
}

// TestShardFailedReleaseExpires: a release that fails before its delete
// (the partition's records could not be checkpointed, e.g. orphans of a
// lost tenure) leaves the entry to expire: the node does not release it
// again, nor forget it; the target claims it after the lease, adopting
// from the node; and should the node become the target again, it claims
// it back adopting from its own journal.
func TestShardFailedReleaseExpires(t *testing.T) {
	const parts, lease = 16, 3000
	toB := partsTargeting([]string{"a", "b"}, "b", parts)
	if len(toB) == 0 {
		t.Fatal("no partition targets b")
	}
	p := toB[0]
	a, b, now := twoLiveCores(parts, lease)
	for _, c := range []*shardCore{a, b} {
		c.observePart(p, partValue{Node: "a", Epoch: 5}, 11, false, now)
	}
	a.sent[p] = true // this incarnation's entry
	got := opsOf(a.tick(now), p)
	if len(got) != 1 || got[0].kind != opRelease || got[0].rev != 11 {
		t.Fatalf("a's entry of partition %d targeting b: ops %+v, want one release at rev 11", p, got)
	}
	a.released(got[0], false, now)
	for _, dt := range []int64{1, lease / 3, lease, 2 * lease} {
		a.observeNode("b", uint64(2+dt), false, now+dt)
		if got := opsOf(a.tick(now+dt), p); len(got) != 0 {
			t.Fatalf("at +%d after the failed release: ops %+v, want none", dt, got)
		}
	}
	if got := opsOf(b.tick(now+lease-1), p); len(got) != 0 {
		t.Fatalf("b before the lease: %+v", got)
	}
	got = opsOf(b.tick(now+lease), p)
	if len(got) != 1 || got[0].kind != opClaim || got[0].rev != 11 || !reflect.DeepEqual(got[0].sources, []string{"a"}) {
		t.Fatalf("b after the lease: ops %+v, want a claim at rev 11 from [a]", got)
	}
	// b is gone: a is the target again and claims its own entry back,
	// adopting from its own journal.
	a = newShardCore("a", parts, lease)
	a.observeNode("a", 1, false, now)
	a.observePart(p, partValue{Node: "a", Epoch: 5}, 11, false, now)
	rel := shardOp{kind: opRelease, part: p, rev: 11}
	a.mine[p].state = holdReleasing
	a.released(rel, false, now)
	got = opsOf(a.tick(now+1), p)
	if len(got) != 1 || got[0].kind != opClaim || got[0].rev != 11 || !reflect.DeepEqual(got[0].sources, []string{"a"}) {
		t.Fatalf("a as the target after its failed release: ops %+v, want a claim at rev 11 from [a]", got)
	}
}

// twoLiveCores returns the cores of nodes a and b, each having seen both
// heartbeats at now.
func twoLiveCores(parts int, lease int64) (a, b *shardCore, now int64) {
	a, b, now = newShardCore("a", parts, lease), newShardCore("b", parts, lease), 1
	for _, c := range []*shardCore{a, b} {
		c.observeNode("a", 1, false, now)
		c.observeNode("b", 2, false, now)
	}
	return a, b, now
}

// TestShardClaimBackoff: a failed claim is not sent again before its
// backoff (lease/32, doubling with each consecutive failure, at most
// lease/4); a claim that lands resets it. Before, a claim that failed at
// once was sent again at every tick (TestFaultPartition: a node whose
// journal failed tried its tenure markers for some fifty partitions every
// tick, and its journal writer had time for nothing else).
func TestShardClaimBackoff(t *testing.T) {
	const parts, lease = 4, 3200
	c := newShardCore("a", parts, lease)
	now := int64(1)
	c.observeNode("a", 1, false, now)
	claimOf := func(at int64) *shardOp {
		t.Helper()
		got := opsOf(c.tick(at), 0)
		switch {
		case len(got) == 0:
			return nil
		case len(got) == 1 && got[0].kind == opClaim:
			return &got[0]
		}
		t.Fatalf("at %d: ops %+v, want at most a claim", at, got)
		return nil
	}
	op := claimOf(now)
	if op == nil {
		t.Fatal("no first claim")
	}
	for i, wait := range []int64{lease / 32, lease / 16, lease / 8, lease / 4, lease / 4} {
		c.claimed(*op, 0, errors.New("refused"), now)
		if got := claimOf(now + wait - 1); got != nil {
			t.Fatalf("failure %d: claimed again after %d, want a pause of %d", i+1, wait-1, wait)
		}
		now += wait
		if op = claimOf(now); op == nil {
			t.Fatalf("failure %d: no claim after the pause of %d", i+1, wait)
		}
	}
	c.claimed(*op, 7, nil, now)
	if c.claimFails[0] != 0 || c.claimAfter[0] != 0 {
		t.Fatalf("after a claim that landed: %d failures, pause until %d; want none", c.claimFails[0], c.claimAfter[0])
	}
}

// heldCore returns a core of node "a" (the only live node) holding
// partition 0 of parts, claimed at now in epoch 7.
func heldCore(t *testing.T, parts int, lease, now int64) *shardCore {
	t.Helper()
	c := newShardCore("a", parts, lease)
	c.observeNode("a", 1, false, now)
	got := opsOf(c.tick(now), 0)
	if len(got) != 1 || got[0].kind != opClaim {
		t.Fatalf("first tick: ops %+v, want a claim", got)
	}
	c.claimed(got[0], 7, nil, now)
	return c
}

// TestShardRetryPause: a renewal or heartbeat that fails is not sent again
// before retryPause (the runner ticks after every result: a write failing
// at once was a busy loop), and is sent again after it, while the lease
// lasts.
func TestShardRetryPause(t *testing.T) {
	const parts, lease, pause = 2, 3200, 3200 / 16
	now := int64(1)
	c := heldCore(t, parts, lease, now)
	c.beat(shardOp{kind: opHeartbeat, at: now}, 0, nil)
	renewals := func(at int64) []shardOp {
		var out []shardOp
		for _, op := range c.tick(at) {
			switch {
			case op.kind == opHeartbeat:
				c.beat(op, 0, nil)
			case op.kind == opRenew && op.part == 0:
				out = append(out, op)
			}
		}
		return out
	}
	now += lease / 3
	got := renewals(now)
	if len(got) != 1 || got[0].rev != 7 || got[0].epoch != 7 {
		t.Fatalf("after lease/3: renewals %+v, want one over revision 7", got)
	}
	for i := range 3 {
		c.renewed(got[0], 0, errors.New("nats: connection closed"), false, now)
		if got = renewals(now + pause - 1); len(got) != 0 {
			t.Fatalf("failure %d: renewed again before the pause: %+v", i+1, got)
		}
		if _, ok := c.serving(0, now); !ok {
			t.Fatalf("failure %d: not serving within the lease", i+1)
		}
		now += pause
		if got = renewals(now); len(got) != 1 || got[0].rev != 7 {
			t.Fatalf("failure %d: renewals after the pause %+v, want one over revision 7", i+1, got)
		}
	}
	c.renewed(got[0], 9, nil, false, now)
	if got := renewals(now + 1); len(got) != 0 {
		t.Fatalf("after a renewal that landed: renewals %+v, want none before lease/3", got)
	}

	beats := func(at int64) int {
		n := 0
		for _, op := range c.tick(at) {
			if op.kind == opHeartbeat {
				n++
				if op.at != at {
					t.Fatalf("heartbeat at %d sent with instant %d", at, op.at)
				}
			}
		}
		return n
	}
	now = c.lastBeat + lease/3
	if beats(now) != 1 {
		t.Fatal("no heartbeat after lease/3")
	}
	c.beat(shardOp{kind: opHeartbeat, at: now}, 0, errors.New("nats: connection closed"))
	if n := beats(now + pause - 1); n != 0 {
		t.Fatalf("%d heartbeats before the pause after a failed one", n)
	}
	if beats(now+pause) != 1 {
		t.Fatal("no heartbeat after the pause")
	}
}

// TestShardRenewLanded: a renewal refused as a conflict with this node's
// own earlier renewal (renewLanded, after the runner read the entry) keeps
// the partition, with the lease still counted from the last renewal known
// to have landed, and the next renewal goes over the revision read; a
// conflict otherwise loses it.
func TestShardRenewLanded(t *testing.T) {
	const parts, lease = 2, 3200
	now := int64(1)
	c := heldCore(t, parts, lease, now)
	now += lease / 3
	op := opsOf(c.tick(now), 0)
	if len(op) != 1 || op[0].kind != opRenew {
		t.Fatalf("after lease/3: ops %+v, want a renewal", op)
	}
	c.renewLanded(op[0], 12, now)
	if !c.holds(0) || c.mine[0].rev != 12 || c.mine[0].renewedAt != 1 {
		t.Fatalf("after renewLanded: %+v, want held at revision 12, renewed at 1", c.mine[0])
	}
	op = opsOf(c.tick(now), 0)
	if len(op) != 1 || op[0].kind != opRenew || op[0].rev != 12 || op[0].epoch != 7 {
		t.Fatalf("next tick: ops %+v, want a renewal of epoch 7 over revision 12", op)
	}
	c.renewLanded(shardOp{kind: opRenew, part: 0, rev: 12, epoch: 8}, 13, now) // another epoch: ignored
	if c.mine[0].state != holdRenewing || c.mine[0].rev != 12 {
		t.Fatalf("renewLanded of another epoch changed the holding: %+v", c.mine[0])
	}
	c.renewed(op[0], 0, errSimConflict, true, now)
	if c.holds(0) || len(c.takeLost()) != 1 {
		t.Fatalf("a conflict: %+v, want the partition lost", c.mine[0])
	}
}

// TestShardEarlierIncarnationEntryClaimedBack: an entry naming this node
// that this incarnation never claimed (a restart with the same id) is
// claimed back, adopting from this node's journal (and the entry's
// sources), even when the partition is another node's target now: a
// release by this incarnation, which holds none of the partition's
// records in memory, would checkpoint nothing and delete the entry, and
// the next owner would read older records from the state bucket (seed 54
// of the simulation). Once adopted, the partition is released to its
// target as usual.
func TestShardEarlierIncarnationEntryClaimedBack(t *testing.T) {
	const parts, lease = 16, 3000
	toB := partsTargeting([]string{"a", "b"}, "b", parts)
	if len(toB) < 2 {
		t.Fatalf("partitions targeting b: %v", toB)
	}
	renewed, unfinished := toB[0], toB[1]
	a, _, now := twoLiveCores(parts, lease)
	a.observePart(renewed, partValue{Node: "a", Epoch: 5}, 11, false, now)
	a.observePart(unfinished, partValue{Node: "a", From: []string{"c"}}, 12, false, now)
	ops := a.tick(now)
	for p, want := range map[int]struct {
		rev     uint64
		sources []string
	}{renewed: {11, []string{"a"}}, unfinished: {12, []string{"c", "a"}}} {
		got := opsOf(ops, p)
		if len(got) != 1 || got[0].kind != opClaim || got[0].rev != want.rev || !reflect.DeepEqual(got[0].sources, want.sources) {
			t.Fatalf("partition %d (an earlier incarnation's entry): ops %+v, want a claim at rev %d from %v", p, got, want.rev, want.sources)
		}
		a.claimed(got[0], 20+uint64(p), nil, now)
	}
	// Held now, and another node's target: released (checkpointed first).
	ops = a.tick(now + 1)
	for _, p := range []int{renewed, unfinished} {
		if got := opsOf(ops, p); len(got) != 1 || got[0].kind != opRelease {
			t.Fatalf("partition %d after taking it back: ops %+v, want a release", p, got)
		}
	}
}

// TestShardHeartbeatWaitsForTheWatch: a heartbeat that landed but that the
// watch has not delivered holds the next heartbeat back (the others then
// stop assigning partitions to a node that cannot see their releases), and
// a third of a lease after it was sent the watch is stale: the driver
// watches anew.
func TestShardHeartbeatWaitsForTheWatch(t *testing.T) {
	const lease = 3000
	c := newShardCore("a", 4, lease)
	var beats []shardOp
	tick := func(now int64) {
		for _, op := range c.tick(now) {
			if op.kind == opHeartbeat {
				beats = append(beats, op)
			}
		}
	}
	tick(1)
	if len(beats) != 1 {
		t.Fatalf("first tick: %d heartbeats", len(beats))
	}
	c.beat(beats[0], 7, nil) // landed at revision 7, not delivered yet
	tick(1 + lease/3)
	if len(beats) != 1 {
		t.Fatal("a heartbeat sent while the last one has not come back through the watch")
	}
	if c.watchStale(lease/3) || !c.watchStale(2+lease/3) {
		t.Fatalf("watchStale at +lease/3: %v, just after: %v", c.watchStale(lease/3), c.watchStale(2+lease/3))
	}
	c.observeNode("a", 7, false, 2+lease/3) // the watch delivers it
	if c.watchStale(3 + lease/3) {
		t.Fatal("stale after the delivery")
	}
	tick(3 + lease/3)
	if len(beats) != 2 {
		t.Fatalf("%d heartbeats once the last came back, want 2", len(beats))
	}
}

// TestShardRenewalTimedOutSentAgainAtOnce: the retry pause counts from a
// failed renewal's send, so one that failed by its timeout (longer than the
// pause) is sent again at the next tick, while one that failed at once
// waits the pause.
func TestShardRenewalTimedOutSentAgainAtOnce(t *testing.T) {
	const parts, lease, timeout = 2, 3200, 3200 / 6
	now := int64(1)
	c := heldCore(t, parts, lease, now)
	now += lease / 3
	op := opsOf(c.tick(now), 0)
	if len(op) != 1 || op[0].kind != opRenew {
		t.Fatalf("after lease/3: ops %+v, want a renewal", op)
	}
	now += timeout
	c.renewed(op[0], 0, errors.New("nats: timeout"), false, now)
	if op = opsOf(c.tick(now), 0); len(op) != 1 || op[0].kind != opRenew || op[0].at != now {
		t.Fatalf("after a renewal timed out: ops %+v, want it sent again at once", op)
	}
}

// TestShardEarlierIncarnationEntryAfterAFailedClaim (O4): a claim of an
// earlier incarnation's entry that fails (its write lost, the entry
// unchanged) leaves the entry the earlier incarnation's: it is claimed
// again after the backoff, never released (deleted), even when the
// partition is another node's target (simulation seed 345 with message
// loss: the restarted node deleted the entry, the next owner claimed
// without sources and forgot admissions only its journal held).
func TestShardEarlierIncarnationEntryAfterAFailedClaim(t *testing.T) {
	const parts, lease = 16, 3000
	toB := partsTargeting([]string{"a", "b"}, "b", parts)
	p := toB[0]
	a, _, now := twoLiveCores(parts, lease)
	a.observePart(p, partValue{Node: "a", Epoch: 5}, 11, false, now)
	got := opsOf(a.tick(now), p)
	if len(got) != 1 || got[0].kind != opClaim {
		t.Fatalf("an earlier incarnation's entry: ops %+v, want a claim", got)
	}
	a.claimed(got[0], 0, errors.New("nats: timeout"), now)
	for step := int64(1); step <= lease/4; step += lease / 32 {
		for _, op := range opsOf(a.tick(now+step), p) {
			if op.kind == opRelease {
				t.Fatalf("%d after the failed claim: %+v, want no release of the earlier incarnation's entry", step, op)
			}
			if op.kind == opClaim {
				return
			}
		}
	}
	t.Fatal("the earlier incarnation's entry was not claimed again after the backoff")
}
