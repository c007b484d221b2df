package journal

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/bugs"
	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/fail"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/rt"
	"github.com/nats-io/nats.go/jetstream"
)

// The scenarios of this file are the failover bugs the deterministic
// simulation (mesh/internal/sim) found, each reduced to the rule that now
// prevents it (docs/protocol.md, "Invariants"). Each fails when its rule is
// taken out.

// versioned returns a key record of version v whose policy name tells the
// records apart.
func versioned(name string, v uint64) []byte {
	return keyrec.Append(nil, &keyrec.Record{Policy: name, Revision: 1, Version: v})
}

// TestAdoptKeepsTheHighestVersion (J10): an adoption from several
// journals keeps, of a key's records, the one with the highest version,
// whatever journal it came from. Sources are read oldest first, and a
// source named later may still hold the older record of a key: its node
// journalled the key before the other source's node took the partition
// and wrote it again (simulation seeds 2532 and 2722).
func TestAdoptKeepsTheHighestVersion(t *testing.T) {
	const p = 7
	k1 := keyIn(p, "")
	k2 := keyIn(p, k1)
	j, _, js := testJournal(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	publish := func(node string, items ...item) {
		t.Helper()
		if _, err := js.Publish(ctx, j.subjOf(node), appendBatch(nil, 1, "b", items)); err != nil {
			t.Fatal(err)
		}
	}
	// a holds k1 at version 5 and k2 at version 2; b, named after a, holds
	// k1 at version 3 (older) and k2 at version 4 (newer).
	publish("a", item{key: k1, val: versioned("a", 5)}, item{key: k2, val: versioned("a", 2)})
	publish("b", item{key: k1, val: versioned("b", 3)}, item{key: k2, val: versioned("b", 4)})
	if err := wait(t, func(done func(error)) { j.Adopt(p, []string{"a", "b"}, 11, 10*time.Second, done) }); err != nil {
		t.Fatal(err)
	}
	for key, want := range map[string]string{k1: "a", k2: "b"} {
		val, _, err := get(t, j, key, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		r, err := keyrec.Decode(val)
		if err != nil {
			t.Fatal(err)
		}
		if r.Policy != want {
			t.Errorf("%s: adopted %s's record (version %d), want %s's", key, r.Policy, r.Version, want)
		}
	}
}

// TestReadCacheEndsAtTheSourcesMark (J8): a read of a node's journal goes
// on from where an earlier read of it ended only while the node's mark
// is below that point. Once the mark passed it, the messages after it may
// be purged, among them a tenure marker that supersedes a record the
// earlier read holds: the read starts again from the mark (simulation
// seeds 256, 334 and 372: a cached record from before such a marker was
// adopted over the state bucket's newer one).
func TestReadCacheEndsAtTheSourcesMark(t *testing.T) {
	const p = 5
	k1 := keyIn(p, "")
	k2 := keyIn(p, k1)
	j, kv, js := testJournal(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var last uint64
	publish := func(data []byte) {
		t.Helper()
		ack, err := js.Publish(ctx, j.subjOf("node"), data)
		if err != nil {
			t.Fatal(err)
		}
		last = ack.Sequence
	}
	read := func(what string, want map[string]string) {
		t.Helper()
		got := map[string]string{}
		err := wait(t, func(done func(error)) {
			j.rd.read("node", last, 5*time.Second, func(states map[string]state, _ uint64, err error) {
				for k, st := range states {
					got[k] = string(st.val)
				}
				done(err)
			})
		})
		if err != nil {
			t.Fatal(err)
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("%s: read %v, want %v", what, got, want)
		}
	}
	publish(appendBatch(nil, 1, "b", []item{{key: k1, val: []byte("a1")}}))
	read("first read", map[string]string{k1: "a1"})
	// The node's next tenure of p: a marker, a checkpoint of everything up
	// to the batch after it (the mark), and the purge below the mark.
	publish(appendFence(nil, fence{part: p, epoch: 9, node: "node"}))
	publish(appendBatch(nil, 1, "c", []item{{key: k2, val: []byte("b1")}}))
	mark := last
	if _, err := kv.Put(ctx, markPrefix+"node", strconv.AppendUint(nil, mark, 10)); err != nil {
		t.Fatal(err)
	}
	s, err := js.Stream(ctx, StreamName("rl"))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Purge(ctx, jetstream.WithPurgeSubject(j.subjOf("node")), jetstream.WithPurgeSequence(mark)); err != nil {
		t.Fatal(err)
	}
	publish(appendBatch(nil, 1, "d", []item{{key: k2, val: []byte("b2")}}))
	read("after the mark passed the earlier read", map[string]string{k2: "b2"})
}

// TestInheritedRecordsHoldTheMark (J3): a node restarted with the same id
// finds its journal above its mark holding records of its earlier
// incarnation, which this incarnation never read. Its mark stays at the
// recorded one until every partition is adopted by it or seen owned
// elsewhere: a mark moved past them would let the next owner miss them
// (simulation seed 232).
func TestInheritedRecordsHoldTheMark(t *testing.T) {
	r := newRecords(4)
	r.inherit(10)
	if m := r.markLimit(30, 0, 0); m != 10 {
		t.Fatalf("mark %d after a restart at mark 10, want 10", m)
	}
	r.settled(0)            // partition 0 seen owned by another node
	gen := r.adopting(1, 1) // partition 1 adopted by this incarnation
	r.adopted(1, gen)
	r.settled(2)
	if m := r.markLimit(30, 0, 0); m != 10 {
		t.Fatalf("mark %d with partition 3 still inherited, want 10", m)
	}
	gen = r.adopting(3, 1)
	r.lose(3) // lost during its adoption: still inherited
	r.adopted(3, gen)
	if m := r.markLimit(30, 0, 0); m != 10 {
		t.Fatalf("mark %d after a failed adoption of partition 3, want 10", m)
	}
	r.settled(3)
	if m := r.markLimit(30, 0, 0); m != 30 {
		t.Fatalf("mark %d once every partition settled, want 30", m)
	}
}

// TestCheckpointWriteNeedsTheLease (J9): a checkpoint writes a record to
// the state bucket only while this node holds the key's partition, checked
// before the read and the write and when the read answers: a write started
// after the lease lapsed could land over a newer owner's record
// (simulation seed 256: a release's checkpoint, late, overwrote it).
func TestCheckpointWriteNeedsTheLease(t *testing.T) {
	j, kv, _ := testJournal(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	key := keyIn(3, "")
	rev, err := kv.Put(ctx, key, []byte("newer owner"))
	if err != nil {
		t.Fatal(err)
	}
	write := func(known bool, held func() bool) error {
		return wait(t, func(done func(error)) {
			j.ck.writeRecord(key, []byte("lapsed owner"), rev, known, held, func(_ uint64, err error) { done(err) })
		})
	}
	// Lapsed before the write.
	if err := write(true, func() bool { return false }); !errors.Is(err, fail.ErrFenced) {
		t.Fatalf("write after the lease lapsed: %v, want fenced", err)
	}
	// Held for the read, lapsed when its answer arrives.
	calls := 0
	if err := write(false, func() bool { calls++; return calls == 1 }); !errors.Is(err, fail.ErrFenced) {
		t.Fatalf("write after the lease lapsed during the read: %v, want fenced", err)
	}
	e, err := kv.Get(ctx, key)
	if err != nil || string(e.Value()) != "newer owner" {
		t.Fatalf("the bucket holds %q (%v), want the newer owner's record", e.Value(), err)
	}
	// Held throughout: written.
	if err := write(true, func() bool { return true }); err != nil {
		t.Fatal(err)
	}
	if e, err := kv.Get(ctx, key); err != nil || string(e.Value()) != "lapsed owner" {
		t.Fatalf("the bucket holds %q (%v) after a write while held", e.Value(), err)
	}
}

// lostAck is a Stream whose first append lands but reports an unknown
// outcome (its acknowledgement lost), whose first Last answers as a
// replica that has not seen that message yet, and which, with
// fenceAfter, lets another node's fence land right after the message.
type lostAck struct {
	Stream
	t          *testing.T
	js         jetstream.JetStream
	fenceAfter *fence
	appends    int
	lasts      int
	before     uint64
	onLost     func() // called before the lost acknowledgement is reported
	prelude    func() // called before the first append is sent
}

func (s *lostAck) Append(subj string, data []byte, last uint64, ttl, timeout time.Duration, done func(uint64, error)) {
	s.appends++
	if s.appends > 1 {
		s.Stream.Append(subj, data, last, ttl, timeout, done)
		return
	}
	s.before = last
	if s.prelude != nil {
		s.prelude()
	}
	s.Stream.Append(subj, data, last, ttl, timeout, func(_ uint64, err error) {
		if err != nil {
			s.t.Errorf("the first append: %v", err)
		}
		if s.fenceAfter != nil {
			if _, err := s.js.Publish(context.Background(), subj, appendFence(nil, *s.fenceAfter)); err != nil {
				s.t.Errorf("the fence: %v", err)
			}
		}
		if s.onLost != nil {
			s.onLost()
		}
		done(0, errors.New("timeout: the acknowledgement was lost"))
	})
}

func (s *lostAck) Last(subj string, timeout time.Duration, done func(uint64, error)) {
	s.lasts++
	if s.lasts == 1 {
		done(s.before, nil)
		return
	}
	s.Stream.Last(subj, timeout, done)
}

// usageIDs records the usage the journal reports committed.
type usageIDs struct {
	mu  sync.Mutex
	ids []string
}

func (u *usageIDs) Add(node, boot string, seq uint64, idx uint32, key string, record []byte, us *keyrec.Usage) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.ids = append(u.ids, fmt.Sprintf("%s.%d.%d", node, seq, idx))
}
func (u *usageIDs) Sync(done func(error)) { done(nil) }

// TestUnknownOutcomeKeepsTheMessage (J13, K3): an append whose outcome is
// unknown is sent again as the same message (same nonce, same records and
// usage) while it may still land, so the resync that finds it landed
// commits it: its records are journalled once and its usage keeps the ids
// a reader of the journal computes. A batch sent again under a new nonce
// was not recognised once its first attempt landed: appended a second
// time (its admissions published twice under different ids), or, with a
// fence of another node right after it, failed as fenced, and its calls,
// already spent in the journal the new owner adopts, were decided again
// there.
func TestUnknownOutcomeKeepsTheMessage(t *testing.T) {
	for _, fenced := range []bool{false, true} {
		t.Run(fmt.Sprintf("fenced=%v", fenced), func(t *testing.T) {
			const p = 4
			key := keyIn(p, "")
			j, _, js := testJournal(t)
			s := &lostAck{Stream: j.cfg.Stream, t: t, js: js}
			if fenced {
				s.fenceAfter = &fence{part: p, epoch: 9, node: "other"}
			}
			j.cfg.Stream = s
			sink := &usageIDs{}
			j.cfg.Usage = sink
			j.recs.owned[p] = true
			if err := writeUsage(t, j, key, p, 1, 0, time.Now().Add(10*time.Second)); err != nil {
				t.Fatalf("the write failed: %v (its batch landed)", err)
			}
			batches := journalBatches(t, js)
			if len(batches) != 1 {
				t.Fatalf("the batch is in the journal %d times (sequences %v), want once", len(batches), batches)
			}
			want := fmt.Sprintf("me.%d.0", batches[0])
			if fmt.Sprint(sink.ids) != "["+want+"]" {
				t.Fatalf("usage ids %v, want [%s] (the message's)", sink.ids, want)
			}
		})
	}
}

// stalledSink blocks the first Add until release is closed, and records,
// for each Sync, how many usage records were added before it.
type stalledSink struct {
	entered, release chan struct{}
	once             sync.Once
	mu               sync.Mutex
	added            int
	syncs            []int
}

func (u *stalledSink) Add(node, boot string, seq uint64, idx uint32, key string, record []byte, us *keyrec.Usage) {
	u.once.Do(func() {
		close(u.entered)
		<-u.release
	})
	u.mu.Lock()
	u.added++
	u.mu.Unlock()
}

func (u *stalledSink) Sync(done func(error)) {
	u.mu.Lock()
	u.syncs = append(u.syncs, u.added)
	u.mu.Unlock()
	done(nil)
}

// TestMarkWaitsForCommittedUsage (J3 with usage): while the goroutine that
// commits an appended batch is held up before it queues the batch's usage,
// a checkpoint must not move the mark onto the batch. The writer's last
// sequence used to reach the batch first: a checkpoint then wrote its
// record, synced the usage queued so far (not the batch's) and recorded a
// mark that covered it; a node killed before its publisher caught up lost
// those admissions from the ledger, since readers of its journal start
// after the mark.
func TestMarkWaitsForCommittedUsage(t *testing.T) {
	const p = 4
	key := keyIn(p, "")
	j, _, _ := testJournal(t)
	sink := &stalledSink{entered: make(chan struct{}), release: make(chan struct{})}
	j.cfg.Usage = sink
	j.recs.owned[p] = true
	written := make(chan error, 1)
	j.w.enqueue(&write{key: key, val: versioned("x", 1), usage: []keyrec.Usage{{Cost: 1}}, part: p, gen: j.recs.genOf(p),
		deadline: time.Now().Add(time.Minute), done: func(_ uint64, err error) { written <- err }})
	select {
	case <-sink.entered:
	case err := <-written:
		t.Fatalf("the write was answered (%v) before its usage was queued", err)
	case <-time.After(time.Minute):
		t.Fatal("the batch's usage was never queued")
	}
	if err := wait(t, func(done func(error)) { j.ck.run(-1, nil, done) }); err != nil {
		t.Logf("checkpoint: %v", err)
	}
	mark := j.ck.ownMark()
	close(sink.release)
	if err := <-written; err != nil {
		t.Fatalf("the write failed: %v", err)
	}
	last := j.w.lastSeq()
	if mark >= last {
		t.Fatalf("the mark reached %d, the batch's sequence, while its usage was not queued (syncs saw %v records)", mark, sink.syncs)
	}
	// Once committed, a checkpoint covers it.
	if err := wait(t, func(done func(error)) { j.ck.run(-1, nil, done) }); err != nil {
		t.Fatal(err)
	}
	if m := j.ck.ownMark(); m != last {
		t.Fatalf("mark %d after the commit, want %d", m, last)
	}
}

// TestWriteOverAnUnseenCommitConflicts (J14): a write expecting a record
// that a later commit of the key replaced (an earlier write whose outcome
// its owner did not learn, landed after the owner read the key again) is
// a conflict, not written; a write expecting the latest record is written.
// So is a write expecting the bucket's revision while the key has a
// journalled record not checkpointed yet.
func TestWriteOverAnUnseenCommitConflicts(t *testing.T) {
	const p = 5
	key := keyIn(p, "")
	j, _, _ := testJournal(t)
	j.recs.owned[p] = true
	update := func(v, rev uint64) (uint64, error) {
		var got uint64
		err := wait(t, func(done func(error)) {
			j.UpdateAsync(key, versioned("x", v), nil, rev, 10*time.Second, func(r uint64, err error) { got = r; done(err) })
		})
		return got, err
	}
	// A bucket revision while nothing is journalled: written.
	gen := j.recs.genOf(p)
	first, err := update(1, tagRev(7, gen))
	if err != nil {
		t.Fatalf("the first write: %v", err)
	}
	// The owner's write of version 2 lands, but the owner never learns
	// it (its outcome was unknown; modelled by dropping the revision).
	if _, err := update(2, first); err != nil {
		t.Fatalf("the landed write: %v", err)
	}
	// Having read the key again before that landing, the owner writes
	// over version 1: refused.
	if _, err := update(3, first); !errors.Is(err, kvstate.ErrConflict) {
		t.Fatalf("a write over a replaced record: %v, want a conflict", err)
	}
	// A bucket revision now (the journalled record not checkpointed):
	// refused too.
	if _, err := update(3, tagRev(7, gen)); !errors.Is(err, kvstate.ErrConflict) {
		t.Fatalf("a write over the bucket's record while the journal holds a later one: %v, want a conflict", err)
	}
	// Read again: the latest record and its revision; writing over it works.
	val, rev := lookupRev(t, j, key)
	if v, _ := keyrec.PeekVersion(val); v != 2 {
		t.Fatalf("read version %d, want 2", v)
	}
	if _, err := update(3, rev); err != nil {
		t.Fatalf("a write over the latest record: %v", err)
	}
}

// TestWriteOverACheckpointedCommitConflicts (J14): an owner reads a key
// from the state bucket; its write over that record has an unknown outcome
// (it fails by its deadline) but lands, and the owner reads the key again
// before the next append's resync commits the landed batch (J15). A
// checkpoint then writes the landed record to the bucket, and the owner
// writes over the bucket revision it read. That write must be refused, like
// one taken before the checkpoint: the checkpoint does not make the owner's
// read newer. Accepted, it journals a record without the landed write: a
// reservation that write ended is ended again (R2). It must still be
// refused however long the owner waits before writing: the record the check
// needs is not forgotten while idle until a later write of the key commits.
func TestWriteOverACheckpointedCommitConflicts(t *testing.T) {
	const p = 6
	key := keyIn(p, "")
	j, _, js := testJournal(t)
	clk := &shiftedClock{}
	j.rt = clk
	ownAndCheckpoint(t, j, p, key, versioned("x", 1))
	val, read := lookupRev(t, j, key)
	if v, _ := keyrec.PeekVersion(val); v != 1 || read&journalRevBit != 0 {
		t.Fatalf("read version %d at revision %#x, want version 1 from the bucket", v, read)
	}
	later := func() { clk.off.Add(int64(time.Hour)) }
	j.cfg.Stream = &lostAck{Stream: j.cfg.Stream, t: t, js: js, onLost: later}
	if _, err := update(t, j, key, versioned("x", 2), read); err == nil {
		t.Fatal("the lost write succeeded: want it failed by its deadline (its outcome unknown)")
	}
	if _, rev := lookupRev(t, j, key); rev != read {
		t.Fatalf("read again at revision %#x, want the bucket's %#x (the landed batch not committed yet)", rev, read)
	}
	// Another key's append finds the landed batch and commits it.
	if _, err := update(t, j, keyIn(p, key), versioned("y", 1), 0); err != nil {
		t.Fatalf("another key's write: %v", err)
	}
	checkpoint := func() {
		t.Helper()
		if err := wait(t, func(done func(error)) { j.ck.run(-1, nil, done) }); err != nil {
			t.Fatal(err)
		}
	}
	checkpoint()
	if _, err := update(t, j, key, versioned("x", 3), read); !errors.Is(err, kvstate.ErrConflict) {
		t.Fatalf("a write over the bucket's record the checkpoint replaced: %v, want a conflict", err)
	}
	later()
	checkpoint()
	if _, err := update(t, j, key, versioned("x", 3), read); !errors.Is(err, kvstate.ErrConflict) {
		t.Fatalf("a write over the bucket's record the checkpoint replaced, idle since: %v, want a conflict", err)
	}
	// Read again: the checkpointed record and its revision; writing over
	// it works, and the key's record is then forgotten once idle.
	val, rev := lookupRev(t, j, key)
	if v, _ := keyrec.PeekVersion(val); v != 2 || rev == read {
		t.Fatalf("read version %d at revision %#x, want version 2 at a later revision than %#x", v, rev, read)
	}
	if _, err := update(t, j, key, versioned("x", 3), rev); err != nil {
		t.Fatalf("a write over the latest record: %v", err)
	}
	checkpoint()
	later()
	checkpoint()
	j.recs.mu.Lock()
	e := j.recs.entries[key]
	j.recs.mu.Unlock()
	if e != nil {
		t.Fatal("the key's record is still in memory, idle and written over by its owner")
	}
}

// lookupRev reads key through the journal's store interface.
func lookupRev(t *testing.T, j *Journal, key string) ([]byte, uint64) {
	t.Helper()
	var val []byte
	var rev uint64
	err := wait(t, func(done func(error)) {
		j.GetAsync(key, 10*time.Second, func(v []byte, r uint64, err error) { val, rev = v, r; done(err) })
	})
	if err != nil {
		t.Fatal(err)
	}
	return val, rev
}

// shiftedClock is the real runtime with a clock moved forward by off.
type shiftedClock struct{ off atomic.Int64 }

func (c *shiftedClock) Now() time.Time { return time.Now().Add(time.Duration(c.off.Load())) }
func (c *shiftedClock) AfterFunc(d time.Duration, f func()) func() bool {
	return rt.Real.AfterFunc(d, f)
}
func (c *shiftedClock) Go(f func()) { go f() }

// TestAbandonedFlightThatLandsIsCommitted (J15): a batch whose append
// outcome is unknown and whose writes all pass their deadline before it is
// resolved is abandoned (nobody waits on it), but it may still land, and
// here it did. The next batch's append then fails (the position it expects
// is taken) and its resync must commit the abandoned batch: its usage is
// published (with the ids a reader of the journal computes) before the
// next batch's, and its record is the key's latest. The resync used to
// skip it: its usage reached the stream only if another node read the
// journal later, after the ledger's watermark had passed it (the record
// was in the stream and never counted), and its record was not in view
// (the mark could pass it).
func TestAbandonedFlightThatLandsIsCommitted(t *testing.T) {
	const p = 4
	key := keyIn(p, "")
	j, _, js := testJournal(t)
	clk := &shiftedClock{}
	j.rt = clk
	s := &lostAck{Stream: j.cfg.Stream, t: t, js: js, onLost: func() { clk.off.Store(int64(time.Hour)) },
		// Another node's message first: the stream's sequences are shared
		// by every node's subject, so the batch lands at a sequence other
		// than the one after what it expected.
		prelude: func() {
			if _, err := js.Publish(context.Background(), Subjects("rl")+"other", []byte("x")); err != nil {
				t.Errorf("another node's message: %v", err)
			}
		}}
	j.cfg.Stream = s
	sink := &usageIDs{}
	j.cfg.Usage = sink
	j.recs.owned[p] = true
	if err := writeUsage(t, j, key, p, 1, 0, clk.Now().Add(time.Minute)); err == nil {
		t.Fatal("the first write succeeded: want it failed by its deadline (its outcome unknown)")
	}
	// The owner, not knowing the first write landed, writes over the
	// record before it: its batch is taken before the resync finds the
	// first, and fails as a conflict once it is committed (J14).
	err := writeUsage(t, j, key, p, 1, tagRev(journalRevBit, j.recs.genOf(p)), clk.Now().Add(time.Minute))
	if !errors.Is(err, kvstate.ErrConflict) {
		t.Fatalf("a write over the record before the landed batch: %v, want a conflict", err)
	}
	if err := writeUsage(t, j, key, p, 2, 0, clk.Now().Add(time.Minute)); err != nil {
		t.Fatalf("the next write: %v", err)
	}
	var want []string
	for _, seq := range journalBatches(t, js) {
		want = append(want, fmt.Sprintf("me.%d.0", seq))
	}
	if len(want) != 2 {
		t.Fatalf("%d batches in the journal (%v), want 2", len(want), want)
	}
	sink.mu.Lock()
	got := fmt.Sprint(sink.ids)
	sink.mu.Unlock()
	if got != fmt.Sprint(want) {
		t.Fatalf("usage ids %s, want %v (both batches, in order)", got, want)
	}
}

// journalBatches returns the sequences of the batches with records in the
// journal stream (fences and barriers left out).
func journalBatches(t *testing.T, js jetstream.JetStream) []uint64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	str, err := js.Stream(ctx, StreamName("rl"))
	if err != nil {
		t.Fatal(err)
	}
	info, err := str.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var batches []uint64
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq; seq++ {
		m, err := str.GetMsg(ctx, seq)
		if err != nil {
			continue
		}
		if d, err := decode(m.Data); err == nil && d.fence == nil && len(d.items) > 0 {
			batches = append(batches, seq)
		}
	}
	return batches
}

// writeUsage journals version v of key's record (partition p, held) with
// one usage record, expecting revision expect (0: none checked), and
// returns the write's answer.
func writeUsage(t *testing.T, j *Journal, key string, p int, v, expect uint64, deadline time.Time) error {
	t.Helper()
	return wait(t, func(done func(error)) {
		j.w.enqueue(&write{key: key, val: versioned("x", v), usage: []keyrec.Usage{{Cost: 1}}, part: p, gen: j.recs.genOf(p),
			expect: expect, deadline: deadline, done: func(_ uint64, err error) { done(err) }})
	})
}

// TestReleaseResolvesAnUnknownAppend (J16): a release checkpoints the
// records of an append whose outcome was unknown and that landed (its
// writes failed by their deadline, so the key owner's decisions are gone,
// but the journal holds them): the next owner claims over the deleted entry
// without reading this journal and loads the state bucket, which must hold
// them (simulation seed 658 with message loss: a reservation released in
// the landed batch was released again by the next owner).
func TestReleaseResolvesAnUnknownAppend(t *testing.T) {
	const p = 4
	key := keyIn(p, "")
	j, kv, js := testJournal(t)
	clk := &shiftedClock{}
	j.rt = clk
	j.cfg.Stream = &lostAck{Stream: j.cfg.Stream, t: t, js: js, onLost: func() { clk.off.Store(int64(time.Hour)) }}
	j.recs.owned[p] = true
	if err := writeUsage(t, j, key, p, 1, 0, clk.Now().Add(time.Minute)); err == nil {
		t.Fatal("the write succeeded: want it failed by its deadline (its outcome unknown)")
	}
	err := wait(t, func(done func(error)) { j.Release(p, clk.Now().Add(time.Minute), 10*time.Second, done) })
	if err != nil {
		t.Fatalf("release: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var got []byte
	e, err := kv.Get(ctx, key)
	if err == nil {
		got = e.Value()
	}
	if !bytes.Equal(got, versioned("x", 1)) {
		t.Fatalf("after the release the state bucket holds %q (%v), want the record of the batch that landed", got, err)
	}
}

// stepTimeouts is a Stream that records the longest timeout given to a
// fence's publish.
type stepTimeouts struct {
	Stream
	mu      sync.Mutex
	longest time.Duration
}

func (s *stepTimeouts) Publish(subj string, data []byte, ttl, timeout time.Duration, done func(uint64, error)) {
	s.mu.Lock()
	s.longest = max(s.longest, timeout)
	s.mu.Unlock()
	s.Stream.Publish(subj, data, ttl, timeout, done)
}

// TestAdoptionStepsHaveTheOperationTimeout (J12): a step of an adoption
// (here the fence of a source's journal) is bounded by the per-operation
// timeout, not by what is left of the adoption's deadline: a lost message
// costs one step, not the adoption (an early simulation seed: one slow
// step used up a whole adoption's deadline, and the partition went
// without an owner for it).
func TestAdoptionStepsHaveTheOperationTimeout(t *testing.T) {
	const p = 2
	j, _, _ := testJournal(t)
	s := &stepTimeouts{Stream: j.cfg.Stream}
	j.cfg.Stream = s
	err := wait(t, func(done func(error)) { j.Adopt(p, []string{"other"}, 7, time.Minute, done) })
	if err != nil {
		t.Fatalf("adopt: %v", err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.longest == 0 || s.longest > j.cfg.Timeout {
		t.Fatalf("the fence's publish had a timeout of %v; want at most the operation timeout %v (the adoption's is a minute)", s.longest, j.cfg.Timeout)
	}
}

// TestAdoptionFencesTheSourcesJournal (J1): a claimer appends a fence to a
// source's journal before it reads it, so the old owner, which may not
// know yet that it lost the partition, commits no record of it after the
// claimer's read: its append meets the fence and fails as fenced, and the
// claimer's adopted record is the key's latest. With the fence taken out
// (the planted bug bugs.JournalFence) the append commits: the check can
// fail. (The simulation's TestPlantedBugs reaches it too, through the
// appends a cut-off owner's client sends when it reconnects.)
func TestAdoptionFencesTheSourcesJournal(t *testing.T) {
	if err := appendAfterAdoption(t); !errors.Is(err, fail.ErrFenced) {
		t.Fatalf("the old owner's append after the adoption: %v, want fenced", err)
	}
	defer bugs.Plant(bugs.JournalFence)()
	if err := appendAfterAdoption(t); err != nil {
		t.Fatalf("with the fence taken out, the old owner's append after the adoption: %v, want committed", err)
	}
}

// appendAfterAdoption journals a record of a key in a journal, has
// another node adopt the key's partition from it, then appends the key's
// next record to the first journal and returns that append's answer. The
// adopter must hold the first record.
func appendAfterAdoption(t *testing.T) error {
	t.Helper()
	const p = 5
	key := keyIn(p, "")
	j, _, _ := testJournal(t)
	j.recs.owned[p] = true
	if err := writeUsage(t, j, key, p, 1, 0, time.Now().Add(10*time.Second)); err != nil {
		t.Fatal(err)
	}
	cfg := j.cfg
	cfg.Self = "claimer"
	c := New(cfg)
	t.Cleanup(c.Stop)
	if err := wait(t, func(done func(error)) { c.Adopt(p, []string{j.cfg.Self}, 11, 10*time.Second, done) }); err != nil {
		t.Fatal(err)
	}
	if val, _ := lookupRev(t, c, key); !bytes.Equal(val, versioned("x", 1)) {
		t.Fatalf("the claimer holds %q, want version 1", val)
	}
	return writeUsage(t, j, key, p, 2, 0, time.Now().Add(10*time.Second))
}

// TestQueuedWritesFailAfterAFence (J1, J5): a write queued behind an
// append whose outcome is unknown must not commit once the resync of that
// append has read another node's fence of the write's partition in an
// epoch above the tenure's: the new owner read this journal up to the
// fence, so a batch after it is never adopted. Failing only the writes of the
// append in flight is not enough: the queued ones would go out in the
// next batch, expecting the fence's sequence, and commit: admissions the
// new owner never read, decided again by it (J1). A fence of an earlier epoch than the
// tenure's (a claim this node's own adoption followed) ends nothing.
func TestQueuedWritesFailAfterAFence(t *testing.T) {
	for _, tenure := range []uint64{3, 20} {
		t.Run(fmt.Sprintf("tenure=%d", tenure), func(t *testing.T) {
			const p, q, fenceEpoch = 4, 5, 9
			inP, inQ := keyIn(p, ""), keyIn(q, "")
			j, _, js := testJournal(t)
			queued := make(chan error, 1)
			j.cfg.Stream = &lostAck{Stream: j.cfg.Stream, t: t, js: js,
				fenceAfter: &fence{part: p, epoch: fenceEpoch, node: "other"},
				prelude: func() {
					// Queued while the first append is in flight.
					j.w.enqueue(&write{key: inP, val: versioned("x", 1), usage: []keyrec.Usage{{Cost: 1}}, part: p, gen: j.recs.genOf(p),
						deadline: time.Now().Add(10 * time.Second), done: func(_ uint64, err error) { queued <- err }})
				}}
			j.recs.owned[p], j.recs.owned[q] = true, true
			j.recs.epoch[p] = tenure
			if err := writeUsage(t, j, inQ, q, 1, 0, time.Now().Add(10*time.Second)); err != nil {
				t.Fatalf("the write of partition %d: %v, want committed (its batch landed before the fence)", q, err)
			}
			var err error
			select {
			case err = <-queued:
			case <-time.After(30 * time.Second):
				t.Fatal("the queued write got no answer within 30s")
			}
			if tenure > fenceEpoch {
				if err != nil {
					t.Fatalf("the queued write, after a fence older than the tenure: %v, want committed", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("the write queued behind it, of the fenced partition %d, committed after the fence (batches at %v)", p, journalBatches(t, js))
			}
			if b := journalBatches(t, js); len(b) != 1 {
				t.Fatalf("batches at %v, want only the first", b)
			}
			err = wait(t, func(done func(error)) {
				j.UpdateAsync(inP, versioned("x", 2), nil, tagRev(1|journalRevBit, j.recs.genOf(p)), 10*time.Second,
					func(_ uint64, err error) { done(err) })
			})
			if !errors.Is(err, fail.ErrFenced) {
				t.Fatalf("a later write of partition %d: %v, want fenced (J5)", p, err)
			}
		})
	}
}
