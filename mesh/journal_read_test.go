package mesh

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/nats-io/nats.go/jetstream"
)

// journalReadStream starts an embedded server with a journal-like stream
// holding, interleaved with another subject's, msgs messages on j.a
// ("a1", "a2", ...); it returns the stream and the sequence of the last
// j.a message.
func journalReadStream(t *testing.T, msgs int) (jetstream.Stream, uint64) {
	return journalReadStreamWith(t, msgs, jetstream.StreamConfig{Name: "J", Subjects: []string{"j.*"}})
}

func journalReadStreamWith(t *testing.T, msgs int, cfg jetstream.StreamConfig) (jetstream.Stream, uint64) {
	t.Helper()
	js := embeddedJS(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := js.CreateStream(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	var last uint64
	for i := 1; i <= msgs; i++ {
		ack, err := js.Publish(ctx, "j.a", fmt.Appendf(nil, "a%d", i))
		if err != nil {
			t.Fatal(err)
		}
		last = ack.Sequence
		if i%3 == 0 {
			if _, err := js.Publish(ctx, "j.b", []byte("b")); err != nil {
				t.Fatal(err)
			}
		}
	}
	return s, last
}

// readAll reads j.a from sequence 1 to upto with j and checks that it got
// every message, in order, once.
func readAll(t *testing.T, j *journalStore, msgs int, upto uint64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var got []string
	var prev uint64
	err := j.readRange(ctx, "j.a", 1, upto, func(seq uint64, data []byte) error {
		if seq <= prev {
			return fmt.Errorf("sequence %d after %d", seq, prev)
		}
		prev = seq
		got = append(got, string(data))
		return nil
	})
	if err != nil {
		t.Fatalf("readRange: %v", err)
	}
	if len(got) != msgs {
		t.Fatalf("read %d messages, want %d (last %q)", len(got), msgs, got[len(got)-1])
	}
	for i, g := range got {
		if want := fmt.Sprintf("a%d", i+1); g != want {
			t.Fatalf("message %d is %q, want %q", i, g, want)
		}
	}
}

// TestReadRangeConsumer: a range longer than the leader reads goes
// through an ordered consumer and ends on upto.
func TestReadRangeConsumer(t *testing.T) {
	const msgs = 3 * readRangeDirect
	s, upto := journalReadStream(t, msgs)
	readAll(t, &journalStore{stream: s, timeout: 5 * time.Second}, msgs, upto)
}

// TestReadRangeLaggingReplica: the server may place the ordered consumer
// on a follower that lags (after a partition healed, one reported nothing
// pending well before the fence, and the adoption missed the latest
// records of a hot key: a strict overshoot). readRange finishes with
// leader reads, so it still reads up to upto.
func TestReadRangeLaggingReplica(t *testing.T) {
	const msgs = 4 * readRangeDirect
	s, upto := journalReadStream(t, msgs)
	for _, lagged := range []int{0, 1, 17, readRangeDirect} {
		t.Run(fmt.Sprintf("replica behind by all but %d", lagged), func(t *testing.T) {
			j := &journalStore{stream: s, timeout: 5 * time.Second}
			j.consumerRead = func(ctx context.Context, subj string, seq, upto uint64, f func(uint64, []byte) error) (uint64, bool, error) {
				// A replica that holds only lagged more messages of
				// subj: it delivers them and reports nothing pending.
				next, _, err := j.readRangeLeader(ctx, subj, seq, upto, lagged, f)
				return next, false, err
			}
			readAll(t, j, msgs, upto)
		})
	}
}

// TestReadRangeStaleLeader: a stream leader cut off from the others keeps
// answering reads, after the partition heals too, until it learns it was
// replaced, with the messages it had then. A read of a range whose end
// (a fence or barrier just appended through the current leader) such a
// replica lacks fails rather than end early: before, it ended "done" and
// an adoption forgot a hot key's latest records. Here the stream stands in
// for the stale leader: it lacks the last messages up to upto.
func TestReadRangeStaleLeader(t *testing.T) {
	for _, msgs := range []int{0, 5, 3 * readRangeDirect} {
		for _, missing := range []uint64{1, 40} {
			t.Run(fmt.Sprintf("%d messages, %d missing", msgs, missing), func(t *testing.T) {
				s, last := journalReadStream(t, msgs)
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				j := &journalStore{n: &Node{log: slog.New(slog.DiscardHandler)}, stream: s, timeout: 2 * time.Second}
				read := 0
				err := j.readRange(ctx, "j.a", 1, last+missing, func(uint64, []byte) error {
					read++
					return nil
				})
				if !errors.Is(err, errReadIncomplete) {
					t.Fatalf("readRange to %d on a stream ending at %d: %v after %d messages, want errReadIncomplete",
						last+missing, last, err, read)
				}
				if read != msgs {
					t.Fatalf("read %d messages before failing, want the %d there", read, msgs)
				}
			})
		}
	}
}

// TestReadRangeConsumerFails: when no consumer can be made (here the
// stream's consumer limit is reached; in a cluster, no leader or a replica
// cut off), readRange reads on from the leader: the read still completes
// (before, the read failed and so did the adoption), and it never waits on
// a consumer beyond its context (nats.go's ordered consumer, used before,
// retries its re-creation on every Fetch without end: an adoption's read
// held the journal read lock for minutes in TestFaultPartition).
func TestReadRangeConsumerFails(t *testing.T) {
	const msgs = 3 * readRangeDirect
	s, upto := journalReadStreamWith(t, msgs, jetstream.StreamConfig{Name: "J", Subjects: []string{"j.*"}, MaxConsumers: 1})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := s.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: "taken", AckPolicy: jetstream.AckNonePolicy}); err != nil {
		t.Fatal(err)
	}
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		readAll(t, &journalStore{n: &Node{log: slog.New(slog.DiscardHandler)}, stream: s, timeout: 2 * time.Second}, msgs, upto)
	}()
	select {
	case <-finished:
	case <-time.After(30 * time.Second):
		t.Fatal("readRange did not return within 30s with no consumer to be had")
	}
}

// TestReadJournalTenureMarker: a node's tenure marker of a partition (a
// fence naming the node itself, appended when it claims the partition)
// drops that partition's earlier records of its journal from what an
// adoption reads; another node's fence does not, nor does a marker of
// another partition.
func TestReadJournalTenureMarker(t *testing.T) {
	const parts = 64
	keyIn := func(p int, not string) string {
		for i := 0; ; i++ {
			if k := fmt.Sprintf("p.t.k=%d", i); partitionOf(k, parts) == p && k != not {
				return k
			}
		}
	}
	k1 := keyIn(5, "")
	k2 := keyIn(5, k1)
	other := keyIn(9, "")

	js := embeddedJS(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "J", Subjects: []string{"j.*"}})
	if err != nil {
		t.Fatal(err)
	}
	var last uint64
	appendMsg := func(data []byte) {
		t.Helper()
		ack, err := js.Publish(ctx, "j.me", data)
		if err != nil {
			t.Fatal(err)
		}
		last = ack.Sequence
	}
	batch := func(kv ...string) []byte {
		var items []journalItem
		for i := 0; i < len(kv); i += 2 {
			items = append(items, journalItem{key: kv[i], val: []byte(kv[i+1])})
		}
		return appendJournalBatch(nil, 1, items)
	}
	read := func() map[string]string {
		t.Helper()
		j := &journalStore{n: &Node{cfg: NodeConfig{Partitions: parts}, log: slog.New(slog.DiscardHandler)},
			stream: s, timeout: 5 * time.Second, self: "me", subjPre: "j.", subj: "j.me",
			readLock: make(chan struct{}, 1), reads: make(map[string]*journalRead)}
		states, err := j.readJournal(ctx, "me", last)
		if err != nil {
			t.Fatal(err)
		}
		got := make(map[string]string)
		for k, st := range states {
			got[k] = string(st.val)
		}
		return got
	}
	check := func(what string, want map[string]string) {
		t.Helper()
		got := read()
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("%s: read %v, want %v", what, got, want)
		}
	}

	appendMsg(batch(k1, "a1", other, "o1"))
	appendMsg(batch(k2, "b1"))
	check("first tenure", map[string]string{k1: "a1", k2: "b1", other: "o1"})
	appendMsg(appendJournalFence(nil, journalFence{part: 5, epoch: 7, node: "someone"}))
	check("another node's fence", map[string]string{k1: "a1", k2: "b1", other: "o1"})
	appendMsg(appendJournalFence(nil, journalFence{part: 9, epoch: 8, node: "me"}))
	check("a marker of another partition", map[string]string{k1: "a1", k2: "b1"})
	appendMsg(appendJournalFence(nil, journalFence{part: 5, epoch: 9, node: "me"}))
	check("second tenure, nothing written yet", map[string]string{})
	appendMsg(batch(k1, "a2"))
	check("second tenure", map[string]string{k1: "a2"})
}

// TestJournalFloorRead: after a claim (claimFloor) a partition's keys are
// read from the state bucket by a replica at least as current as the
// claim's floor; a replica behind it (here: a floor above the stream's
// end, as a cut-off stream leader would be) is asked again until the
// call's deadline and then the load is unavailable (a 503, never a
// decision on an old record). A claim that could not write its floor has
// its first load write it. Past floorWindow, reads are leader reads. Once
// the partition is lost, its keys are neither loaded nor written.
func TestJournalFloorRead(t *testing.T) {
	j, kv := floorJournal(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	key := "p.floor.k=1"
	p := partitionOf(key, floorParts)
	j.owned[p] = true
	rev, err := kv.Put(ctx, key, []byte("rec"))
	if err != nil {
		t.Fatal(err)
	}
	if err := j.claimFloor(ctx, p); err != nil {
		t.Fatal(err)
	}
	if j.floors[p].seq <= rev {
		t.Fatalf("floor %d, not above the key's revision %d", j.floors[p].seq, rev)
	}
	get := func(timeout time.Duration) ([]byte, uint64, error) {
		type res struct {
			val []byte
			rev uint64
			err error
		}
		ch := make(chan res, 1)
		j.GetAsync(key, timeout, func(v []byte, r uint64, err error) { ch <- res{v, r, err} })
		r := <-ch
		return r.val, r.rev, r.err
	}
	if val, r, err := get(time.Second); err != nil || string(val) != "rec" || r&revSeqMask != rev {
		t.Fatalf("floor read: %q rev %d err %v, want rec rev %d", val, r&revSeqMask, err, rev)
	}
	j.floors[p].seq += 1000 // the replica answering is behind the floor
	start := time.Now()
	if val, _, err := get(300 * time.Millisecond); !errors.Is(err, ErrUnavailable) || !errors.Is(err, kvstate.ErrStale) || val != nil {
		t.Fatalf("floor read on a replica behind the floor: %q %v, want ErrUnavailable wrapping ErrStale", val, err)
	}
	if d := time.Since(start); d < 50*time.Millisecond {
		t.Fatalf("gave up after %v: want retries until the call's deadline", d)
	}
	// A claim that could not write its floor (no state stream leader
	// yet): the first load writes it, then reads.
	j.floors[p] = partFloor{at: time.Now().UnixNano()}
	if val, _, err := get(time.Second); err != nil || string(val) != "rec" {
		t.Fatalf("read with the floor unset: %q %v", val, err)
	}
	j.mu.Lock()
	written := j.floors[p].seq
	j.mu.Unlock()
	if written <= rev {
		t.Fatalf("floor %d after the load, want it written (above %d)", written, rev)
	}
	j.floors[p].at -= int64(floorWindow) // the claim is old: a leader read
	if val, _, err := get(time.Second); err != nil || string(val) != "rec" {
		t.Fatalf("read after the floor window: %q %v", val, err)
	}
	// Lost: a key runner still busy can neither reload the key nor
	// journal a decision of it.
	j.lose(p)
	if _, _, err := get(time.Second); !errors.Is(err, errFenced) {
		t.Fatalf("load of a lost partition's key: %v, want errFenced", err)
	}
	werr := make(chan error, 1)
	j.UpdateAsync(key, []byte("x"), 0, time.Second, func(_ uint64, err error) { werr <- err })
	if err := <-werr; !errors.Is(err, errFenced) {
		t.Fatalf("write of a lost partition's key: %v, want errFenced", err)
	}
}

// TestJournalPinHoldsMark: while this node's claim of a partition is not
// renewed, its records of that partition stay above the mark even when
// checkpointed (the next claimer reads the claim's sources too, oldest
// first, and a source's older record would win over one hidden below the
// mark); a loss or a release keeps them (as orphans) until another node
// renews the partition or its entry is seen deleted, and the renewal
// releases them.
func TestJournalPinHoldsMark(t *testing.T) {
	js, kv, _ := jsStateStore(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "J", Subjects: []string{"j.*"}})
	if err != nil {
		t.Fatal(err)
	}
	const parts = 64
	inPart := func(p int) string {
		for i := 0; ; i++ {
			if k := fmt.Sprintf("p.pin.k=%d", i); partitionOf(k, parts) == p {
				return k
			}
		}
	}
	j := &journalStore{n: &Node{cfg: NodeConfig{Partitions: parts}, log: slog.New(slog.DiscardHandler)},
		kv: kv, stream: s, subj: "j.me", self: "me", timeout: time.Second, interval: time.Hour,
		entries: make(map[string]*journalEntry), gen: make([]uint64, parts), unrenewed: make([]bool, parts),
		owned: make([]bool, parts)}
	// Checkpointed records: of partition 3 (claimed, not renewed) in
	// batch 10, of partition 5 in batch 15; the journal ends at 20.
	j.unrenewed[3] = true
	j.entries[inPart(3)] = &journalEntry{part: 3, jseq: 10, pin: true, touched: time.Now().UnixNano()}
	j.entries[inPart(5)] = &journalEntry{part: 5, jseq: 15, touched: time.Now().UnixNano()}
	j.last = 20
	j.advanceMark(ctx)
	if j.mark != 9 {
		t.Fatalf("mark %d with a pinned record in batch 10, want 9", j.mark)
	}
	j.lose(3)
	if e := j.entries[inPart(3)]; e == nil || !e.orphan {
		t.Fatalf("a lost partition's pinned record was forgotten: %+v", e)
	}
	j.advanceMark(ctx)
	if j.mark != 9 {
		t.Fatalf("mark %d after the loss, want 9 still", j.mark)
	}
	j.dropOrphans(3) // another node renewed the partition: it adopted them
	j.unrenewed[4] = true
	j.entries[inPart(4)] = &journalEntry{part: 4, jseq: 12, pin: true, touched: time.Now().UnixNano()}
	j.advanceMark(ctx)
	if j.mark != 11 {
		t.Fatalf("mark %d with a pinned record in batch 12, want 11", j.mark)
	}
	j.renewed(4)
	j.advanceMark(ctx)
	if j.mark != 20 {
		t.Fatalf("mark %d after the renewal, want 20", j.mark)
	}
	// A release of a claim not renewed keeps its checkpointed records in
	// view (its entry's delete may fail, and then the next claimer reads
	// the claim's sources) until the entry is seen deleted.
	j.unrenewed[6] = true
	j.owned = make([]bool, parts)
	j.owned[6] = true
	j.entries[inPart(6)] = &journalEntry{part: 6, jseq: 21, pin: true, touched: time.Now().UnixNano()}
	j.last = 25
	if err := j.release(ctx, 6); err != nil {
		t.Fatal(err)
	}
	j.advanceMark(ctx)
	if e := j.entries[inPart(6)]; e == nil || !e.orphan || j.mark != 20 {
		t.Fatalf("after releasing a claim not renewed: entry %+v, mark %d; want it kept, mark 20", e, j.mark)
	}
	j.ownedElsewhere(6) // the entry was seen deleted
	j.advanceMark(ctx)
	if j.mark != 25 {
		t.Fatalf("mark %d once the release was seen, want 25", j.mark)
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
	j, kv := floorJournal(t)
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
	floor, err := kv.Put(ctx, j.floorKey, nil)
	if err != nil {
		t.Fatal(err)
	}
	for p := range floorParts {
		j.owned[p] = true
		j.floors[p] = partFloor{seq: floor, at: time.Now().UnixNano()}
	}

	var mu sync.Mutex
	results := map[string]error{}
	write := func(key string) {
		j.UpdateAsync(key, []byte("x"), 0, 5*time.Second, func(_ uint64, err error) {
			mu.Lock()
			results[key] = err
			mu.Unlock()
		})
	}
	// A check is out: the writes wait for the next batch.
	j.mu.Lock()
	j.checking = true
	j.mu.Unlock()
	keys := []string{"p.new.k=exists", "p.new.k=gone"}
	for i := range 100 {
		keys = append(keys, fmt.Sprintf("p.new.k=%d", i))
	}
	for _, k := range keys {
		write(k)
	}
	j.checkAbsent()
	pending := waitPending(t, j, len(keys)-1)
	if n := j.checkReads.Load(); n != 1 {
		t.Fatalf("%d reads for %d new keys, want 1", n, len(keys))
	}
	mu.Lock()
	if err := results["p.new.k=exists"]; !errors.Is(err, kvstate.ErrConflict) || len(results) != 1 {
		t.Fatalf("key with a record: %v (%d results), want ErrConflict alone", err, len(results))
	}
	mu.Unlock()
	for _, w := range pending {
		if !w.kvKnown || (w.key == "p.new.k=gone") != (w.kvRev != 0) || w.kvRev >= floor {
			t.Fatalf("%s journalled expecting revision %d (known %v)", w.key, w.kvRev, w.kvKnown)
		}
	}

	// A batch read that fails: key by key.
	j.mu.Lock()
	j.pending = nil
	for p := range floorParts {
		j.floors[p].seq = floor + 1000
	}
	j.checking = true
	j.mu.Unlock()
	write("p.new.k=a")
	write("p.new.k=b")
	j.checkAbsent()
	waitPending(t, j, 2)
	if n := j.checkReads.Load(); n != 1+checkTries {
		t.Fatalf("%d batched reads, want 1 + %d tries of the stale one", n, checkTries)
	}
}

// floorJournal returns a journal store of floorParts partitions (none
// owned) over a fresh state bucket that allows floor reads, and the bucket.
func floorJournal(t *testing.T) (*journalStore, jetstream.KeyValue) {
	t.Helper()
	_, kv, st := jsStateStore(t)
	j := &journalStore{n: &Node{cfg: NodeConfig{Partitions: floorParts}, log: slog.New(slog.DiscardHandler)},
		under: st, kv: kv, timeout: time.Second, entries: make(map[string]*journalEntry),
		gen: make([]uint64, floorParts), floors: make([]partFloor, floorParts), floorKey: journalFloorPrefix + "me",
		owned: make([]bool, floorParts)}
	return j, kv
}

const floorParts = 64

// waitPending waits (bounded) until j has n writes pending and no check
// out, and returns them.
func waitPending(t *testing.T, j *journalStore, n int) []*journalWrite {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		j.mu.Lock()
		got, checking := slices.Clone(j.pending), j.checking
		j.mu.Unlock()
		if len(got) == n && !checking {
			return got
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d writes pending (checking %v), want %d", len(got), checking, n)
		}
		time.Sleep(time.Millisecond)
	}
}
