package journal

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/fail"
)

// TestReadJournalTenureMarker: a node's tenure marker of a partition (a
// fence naming the node itself, appended when it claims the partition)
// drops that partition's earlier records of its journal from what a reader
// gets; another node's fence does not, nor does a marker of another
// partition.
func TestReadJournalTenureMarker(t *testing.T) {
	k1 := keyIn(5, "")
	k2 := keyIn(5, k1)
	other := keyIn(9, "")
	j, _, js := testJournal(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var last uint64
	appendMsg := func(data []byte) {
		t.Helper()
		ack, err := js.Publish(ctx, j.subjOf("node"), data)
		if err != nil {
			t.Fatal(err)
		}
		last = ack.Sequence
	}
	batch := func(kv ...string) []byte {
		var items []item
		for i := 0; i < len(kv); i += 2 {
			items = append(items, item{key: kv[i], val: []byte(kv[i+1])})
		}
		return appendBatch(nil, 1, "b", items)
	}
	check := func(what string, want map[string]string) {
		t.Helper()
		got := map[string]string{}
		// A fresh reader each time: from the node's mark (none: 1).
		j.rd.cache = map[string]*sourceRead{}
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
	appendMsg(batch(k1, "a1", other, "o1"))
	appendMsg(batch(k2, "b1"))
	check("first tenure", map[string]string{k1: "a1", k2: "b1", other: "o1"})
	appendMsg(appendFence(nil, fence{part: 5, epoch: 7, node: "someone"}))
	check("another node's fence", map[string]string{k1: "a1", k2: "b1", other: "o1"})
	appendMsg(appendFence(nil, fence{part: 9, epoch: 8, node: "node"}))
	check("a marker of another partition", map[string]string{k1: "a1", k2: "b1"})
	appendMsg(appendFence(nil, fence{part: 5, epoch: 9, node: "node"}))
	check("second tenure, nothing written yet", map[string]string{})
	appendMsg(batch(k1, "a2"))
	check("second tenure", map[string]string{k1: "a2"})
}

// get loads key through j.
func get(t *testing.T, j *Journal, key string, timeout time.Duration) ([]byte, uint64, error) {
	t.Helper()
	type res struct {
		val []byte
		rev uint64
		err error
	}
	ch := make(chan res, 1)
	j.GetAsync(key, timeout, func(v []byte, r uint64, err error) { ch <- res{v, r, err} })
	select {
	case r := <-ch:
		return r.val, r.rev, r.err
	case <-time.After(30 * time.Second):
		t.Fatal("no answer within 30s")
		return nil, 0, nil
	}
}

// update writes key through j.
func update(t *testing.T, j *Journal, key string, val []byte, rev uint64) (uint64, error) {
	t.Helper()
	type res struct {
		rev uint64
		err error
	}
	ch := make(chan res, 1)
	j.UpdateAsync(key, val, nil, rev, 5*time.Second, func(r uint64, err error) { ch <- res{r, err} })
	select {
	case r := <-ch:
		return r.rev, r.err
	case <-time.After(30 * time.Second):
		t.Fatal("no answer within 30s")
		return 0, nil
	}
}

// TestJournalFloorRead: after a claim a partition's keys are read from the
// state bucket by a replica at least as current as the claim's floor; a
// replica behind it (here: a floor above the stream's end, as a cut-off
// stream leader would be) is asked again until the call's deadline and
// then the load is unavailable (a 503, never a decision on an old record).
// A claim that could not write its floor has its first load write it. Past
// floorWindow, reads are leader reads. Once the partition is lost, its
// keys are neither loaded nor written.
func TestJournalFloorRead(t *testing.T) {
	j, kv, _ := testJournal(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	key := keyIn(3, "")
	p := j.partOf(key)
	j.recs.owned[p] = true
	rev, err := kv.Put(ctx, key, []byte("rec"))
	if err != nil {
		t.Fatal(err)
	}
	if err := wait(t, func(done func(error)) { j.floors.claim(p, done) }); err != nil {
		t.Fatal(err)
	}
	if j.floors.parts[p].seq <= rev {
		t.Fatalf("floor %d, not above the key's revision %d", j.floors.parts[p].seq, rev)
	}
	if val, r, err := get(t, j, key, time.Second); err != nil || string(val) != "rec" || r&revSeqMask != rev {
		t.Fatalf("floor read: %q rev %d err %v, want rec rev %d", val, r&revSeqMask, err, rev)
	}
	j.floors.parts[p].seq += 1000 // the replica answering is behind the floor
	start := time.Now()
	if val, _, err := get(t, j, key, 300*time.Millisecond); !errors.Is(err, fail.ErrUnavailable) || !errors.Is(err, kvstate.ErrStale) || val != nil {
		t.Fatalf("floor read on a replica behind the floor: %q %v, want ErrUnavailable wrapping ErrStale", val, err)
	}
	if d := time.Since(start); d < 50*time.Millisecond {
		t.Fatalf("gave up after %v: want retries until the call's deadline", d)
	}
	// A claim that could not write its floor (no state stream leader
	// yet): the first load writes it, then reads.
	j.floors.parts[p] = partFloor{at: time.Now().UnixNano()}
	if val, _, err := get(t, j, key, time.Second); err != nil || string(val) != "rec" {
		t.Fatalf("read with the floor unset: %q %v", val, err)
	}
	if written := j.floors.parts[p].seq; written <= rev {
		t.Fatalf("floor %d after the load, want it written (above %d)", written, rev)
	}
	j.floors.parts[p].at -= int64(floorWindow) // the claim is old: a leader read
	if val, _, err := get(t, j, key, time.Second); err != nil || string(val) != "rec" {
		t.Fatalf("read after the floor window: %q %v", val, err)
	}
	// Lost: a key runner still busy can neither reload the key nor
	// journal a decision of it.
	j.Lost(p)
	if _, _, err := get(t, j, key, time.Second); !errors.Is(err, fail.ErrFenced) {
		t.Fatalf("load of a lost partition's key: %v, want ErrFenced", err)
	}
	if _, err := update(t, j, key, []byte("x"), 0); !errors.Is(err, fail.ErrFenced) {
		t.Fatalf("write of a lost partition's key: %v, want ErrFenced", err)
	}
}

// TestJournalMarkRules: the mark never passes a record that is not
// checkpointed, nor one pinned by a claim that is not renewed; a loss or
// a release keeps a pinned record (as an orphan) until another node is
// seen to own the partition, and the renewal releases it.
func TestJournalMarkRules(t *testing.T) {
	r := newRecords(testParts)
	now := time.Now().UnixNano()
	put := func(p int, jseq uint64, pin bool) string {
		k := keyIn(p, "")
		r.entries[k] = &entry{part: p, jseq: jseq, pin: pin, touched: now}
		return k
	}
	// Checkpointed records: of partition 3 (claimed, not renewed) in
	// batch 10, of partition 5 in batch 15; the journal ends at 20.
	r.unrenewed[3] = true
	k3 := put(3, 10, true)
	put(5, 15, false)
	if m := r.markLimit(20, 0, 0); m != 9 {
		t.Fatalf("mark %d with a pinned record in batch 10, want 9", m)
	}
	r.lose(3)
	if e := r.entries[k3]; e == nil || !e.orphan {
		t.Fatalf("a lost partition's pinned record was forgotten: %+v", e)
	}
	if m := r.markLimit(20, 0, 0); m != 9 {
		t.Fatalf("mark %d after the loss, want 9 still", m)
	}
	r.dropOrphans(3) // another node renewed the partition: it adopted them
	r.unrenewed[4] = true
	put(4, 12, true)
	if m := r.markLimit(20, 0, 0); m != 11 {
		t.Fatalf("mark %d with a pinned record in batch 12, want 11", m)
	}
	r.renewed(4)
	if m := r.markLimit(20, 0, 0); m != 20 {
		t.Fatalf("mark %d after the renewal, want 20", m)
	}
	// Not checkpointed: the mark stays below its first dirty batch.
	k7 := put(7, 22, false)
	r.entries[k7].firstDirty = 21
	if m := r.markLimit(25, 0, 0); m != 20 {
		t.Fatalf("mark %d with a record dirty since batch 21, want 20", m)
	}
	delete(r.entries, k7)
	// A release of a claim not renewed keeps its checkpointed records in
	// view (its entry's delete may fail, and then the next claimer reads
	// the claim's sources) until the entry is seen deleted.
	r.unrenewed[6] = true
	r.owned[6] = true
	k6 := put(6, 21, true)
	if n := r.releasing(6); n != 0 {
		t.Fatalf("%d orphans", n)
	}
	r.released(6, nil)
	if e := r.entries[k6]; e == nil || !e.orphan || r.markLimit(25, 0, 0) != 20 {
		t.Fatalf("after releasing a claim not renewed: entry %+v, mark %d; want it kept, mark 20", e, r.markLimit(25, 0, 0))
	}
	r.dropOrphans(6) // the entry was seen deleted
	if m := r.markLimit(25, 0, 0); m != 25 {
		t.Fatalf("mark %d once the release was seen, want 25", m)
	}
	// Idle checkpointed records are forgotten; one whose owner has not
	// seen it (J14) only past its own cutoff.
	r.owned[8] = true
	k8 := keyIn(8, "")
	r.commit([]*write{{key: k8, part: 8, gen: r.gen[8], failed: true}}, 26, now)
	r.entries[k8].firstDirty = 0
	if r.markLimit(26, now+1, now); r.entries[k8] == nil {
		t.Fatal("a record its owner has not seen was forgotten before its cutoff")
	}
	if r.markLimit(26, now+1, now+1); r.entries[k8] != nil {
		t.Fatal("a record its owner has not seen was kept past its cutoff")
	}
	r.commit([]*write{{key: k8, part: 8, gen: r.gen[8]}}, 27, now)
	r.entries[k8].firstDirty = 0
	if r.markLimit(27, now+1, now); r.entries[k8] != nil {
		t.Fatal("an idle record its owner has seen was kept")
	}
}

// TestJournalNewKeyChecks: the first writes of keys new to the node are
// checked against the state bucket together, one floor read per batch: an
// absent key is journalled expecting no record, a deleted one expecting
// its marker's revision, one with a record loses (ErrConflict). A batch
// whose read keeps failing (here: the floor is above the stream's end, as
// on a replica behind it) is read checkTries times, then checked key by
// key with leader reads.
func TestJournalNewKeyChecks(t *testing.T) {
	j, kv, _ := testJournal(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := kv.Put(ctx, "p.new.k=exists", []byte("rec")); err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, "p.new.k=gone", []byte("rec")); err != nil {
		t.Fatal(err)
	}
	if err := kv.Delete(ctx, "p.new.k=gone"); err != nil {
		t.Fatal(err)
	}
	floor, err := kv.Put(ctx, j.floors.key, nil)
	if err != nil {
		t.Fatal(err)
	}
	for p := range testParts {
		j.recs.owned[p] = true
		j.floors.parts[p] = partFloor{seq: floor, at: time.Now().UnixNano()}
	}
	var (
		mu      sync.Mutex
		results = map[string]error{}
		all     sync.WaitGroup
	)
	write := func(key string) {
		all.Add(1)
		j.UpdateAsync(key, []byte("x"), nil, 0, 5*time.Second, func(_ uint64, err error) {
			mu.Lock()
			results[key] = err
			mu.Unlock()
			all.Done()
		})
	}
	// A check is out: the writes wait for the next batch.
	j.checks.mu.Lock()
	j.checks.running = true
	j.checks.mu.Unlock()
	keys := []string{"p.new.k=exists", "p.new.k=gone"}
	for i := range 100 {
		keys = append(keys, fmt.Sprintf("p.new.k=%d", i))
	}
	for _, k := range keys {
		write(k)
	}
	j.checks.next()
	all.Wait()
	if n := j.checkReads.Load(); n != 1 {
		t.Fatalf("%d reads for %d new keys, want 1", n, len(keys))
	}
	for _, k := range keys {
		err := results[k]
		switch {
		case k == "p.new.k=exists" && !errors.Is(err, kvstate.ErrConflict):
			t.Fatalf("key with a record: %v, want ErrConflict", err)
		case k != "p.new.k=exists" && err != nil:
			t.Fatalf("new key %s: %v", k, err)
		}
	}
	for _, k := range keys[1:] {
		e := j.recs.entries[k]
		if e == nil || !e.kvKnown || (k == "p.new.k=gone") != (e.kvRev != 0) || e.kvRev >= floor {
			t.Fatalf("%s journalled expecting revision %+v", k, e)
		}
	}
	// A batch read that fails: key by key.
	for p := range testParts {
		j.floors.parts[p].seq = floor + 1000
	}
	j.checks.mu.Lock()
	j.checks.running = true
	j.checks.mu.Unlock()
	write("p.new.k=a")
	write("p.new.k=b")
	j.checks.next()
	all.Wait()
	if n := j.checkReads.Load(); n != 1+checkTries {
		t.Fatalf("%d batched reads, want 1 + %d tries of the stale one", n, checkTries)
	}
	if n := j.checkOne.Load(); n != 2 {
		t.Fatalf("%d key reads, want 2", n)
	}
	if results["p.new.k=a"] != nil || results["p.new.k=b"] != nil {
		t.Fatalf("key by key: %v %v", results["p.new.k=a"], results["p.new.k=b"])
	}
}
