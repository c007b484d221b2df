package journal

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/ownership"
	"github.com/limitmesh/limitmesh/mesh/internal/rt"
	"github.com/nats-io/nats.go/jetstream"
)

// The open-reservation index (J17): a key whose record its old owner
// checkpointed, with a reservation still open, and that no call touches
// again, must be known to its next owner, which sweeps it.

// told records what OnReservations is told.
type told struct {
	mu   sync.Mutex
	keys map[string]int64 // key: first expiry
	ch   chan struct{}
}

func newTold() *told { return &told{keys: map[string]int64{}, ch: make(chan struct{}, 64)} }

func (c *told) note(policy, key string, open int, next int64) {
	c.mu.Lock()
	c.keys[key] = next
	c.mu.Unlock()
	c.ch <- struct{}{}
}

// await waits (bounded) until key was told.
func (c *told) await(t *testing.T, key string) int64 {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		c.mu.Lock()
		next, ok := c.keys[key]
		c.mu.Unlock()
		if ok {
			return next
		}
		select {
		case <-c.ch:
		case <-deadline:
			t.Fatalf("%s was never told to have open reservations", key)
		}
	}
}

// peer returns the journal of node self on js's server (prefix rl, the
// state bucket and journal stream testJournal made), wrapping its bucket
// with wrap (nil: none).
func peer(t *testing.T, js jetstream.JetStream, self string, onRes func(string, string, int, int64), wrap func(Bucket) Bucket) *Journal {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := kvstate.NewJetStreamStore(ctx, js, "rl_state")
	if err != nil {
		t.Fatal(err)
	}
	s, err := js.Stream(ctx, StreamName("rl"))
	if err != nil {
		t.Fatal(err)
	}
	var b Bucket = NewJetStreamBucket(st, "rl_state")
	if wrap != nil {
		b = wrap(b)
	}
	j := New(Config{Self: self, Prefix: "rl", Parts: testParts,
		Stream: NewJetStreamStream(context.Background(), s, st, 5*time.Second, nil),
		Bucket: b, View: views{}, Runtime: rt.Real,
		Timeout: time.Second, CheckpointInterval: time.Hour, ReadCache: time.Minute, Floors: true,
		OnReservations: onRes})
	t.Cleanup(j.Stop)
	return j
}

// reserved returns a key record of version v with one reservation open
// until expires, or ended.
func reserved(v uint64, expires int64, ended bool) []byte {
	r := keyrec.Record{Policy: "t", Revision: 1, Version: v, ResSeq: 1,
		Reservations: []keyrec.Reservation{{Seq: 1, Nonce: 7, Units: kvstate.Unit, Revision: 1, At: expires - int64(time.Second), Expires: expires}}}
	if ended {
		r.Reservations[0].Outcome, r.Reservations[0].Settled, r.Reservations[0].EndedAt = keyrec.Expired, kvstate.Unit, expires
	}
	return keyrec.Append(nil, &r)
}

// ownAndCheckpoint has j adopt p (no sources), write key's record val and
// checkpoint it: the record is in the state bucket and j's mark past it.
func ownAndCheckpoint(t *testing.T, j *Journal, p int, key string, val []byte) {
	t.Helper()
	if err := wait(t, func(done func(error)) { j.Adopt(p, nil, 3, 10*time.Second, done) }); err != nil {
		t.Fatal(err)
	}
	j.Renewed(p) // its records no longer pinned (J4)
	if _, err := update(t, j, key, val, 0); err != nil {
		t.Fatal(err)
	}
	if err := wait(t, func(done func(error)) { j.ck.run(-1, nil, done) }); err != nil {
		t.Fatal(err)
	}
	if m, last := j.ck.ownMark(), j.w.lastSeq(); m != last {
		t.Fatalf("mark %d, want the journal's end %d: the record is only in the state bucket", m, last)
	}
}

// TestOpenIndexAfterFailover (J17): node a checkpoints a key with an open
// reservation (its mark passes the record, which is then only in the state
// bucket) and fails; b, adopting the partition from a's journal, finds
// nothing of the key there, and learns it from the partition's index.
func TestOpenIndexAfterFailover(t *testing.T) {
	const p = 9
	key := keyIn(p, "")
	a, _, js := testJournal(t)
	expires := time.Now().Add(time.Minute).UnixNano()
	ownAndCheckpoint(t, a, p, key, reserved(1, expires, false))
	a.Stop() // a crashes

	c := newTold()
	b := peer(t, js, "b", c.note, nil)
	var adopted []string
	b.cfg.OnAdopted = func(k string, _ []byte) { adopted = append(adopted, k) }
	if err := wait(t, func(done func(error)) { b.Adopt(p, []string{a.cfg.Self}, 11, 10*time.Second, done) }); err != nil {
		t.Fatal(err)
	}
	if len(adopted) != 0 {
		t.Fatalf("adopted %v from a's journal: its mark passed them, the scenario needs none", adopted)
	}
	if next := c.await(t, key); next != expires {
		t.Fatalf("told first expiry %d, want %d", next, expires)
	}
}

// TestOpenIndexAfterHandoff (J17): a releases the partition (its records
// checkpointed, its entry deleted); b claims it with no source and learns
// the key from the index the release wrote.
func TestOpenIndexAfterHandoff(t *testing.T) {
	const p = 12
	key := keyIn(p, "")
	a, _, js := testJournal(t)
	expires := time.Now().Add(time.Minute).UnixNano()
	if err := wait(t, func(done func(error)) { a.Adopt(p, nil, 3, 10*time.Second, done) }); err != nil {
		t.Fatal(err)
	}
	if _, err := update(t, a, key, reserved(1, expires, false), 0); err != nil {
		t.Fatal(err)
	}
	if err := wait(t, func(done func(error)) { a.Release(p, time.Now().Add(time.Minute), 10*time.Second, done) }); err != nil {
		t.Fatal(err)
	}
	c := newTold()
	b := peer(t, js, "b", c.note, nil)
	if err := wait(t, func(done func(error)) { b.Adopt(p, nil, 11, 10*time.Second, done) }); err != nil {
		t.Fatal(err)
	}
	if next := c.await(t, key); next != expires {
		t.Fatalf("told first expiry %d, want %d", next, expires)
	}
}

// TestOpenIndexForgetsEndedKeys (J17): an index that names a key whose
// reservations have ended (its sweep finds nothing due and writes
// nothing) drops it once the key's record is loaded, and the next
// checkpoint writes it without the key; a key whose record ends its
// reservations is dropped by the checkpoint that writes it.
func TestOpenIndexForgetsEndedKeys(t *testing.T) {
	const p = 21
	k1 := keyIn(p, "")
	k2 := keyIn(p, k1)
	a, kv, js := testJournal(t)
	expires := time.Now().Add(time.Minute).UnixNano()
	if err := wait(t, func(done func(error)) { a.Adopt(p, nil, 3, 10*time.Second, done) }); err != nil {
		t.Fatal(err)
	}
	a.Renewed(p)
	for _, k := range []string{k1, k2} {
		if _, err := update(t, a, k, reserved(1, expires, false), 0); err != nil {
			t.Fatal(err)
		}
	}
	if err := wait(t, func(done func(error)) { a.ck.run(-1, nil, done) }); err != nil {
		t.Fatal(err)
	}
	a.Stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	stored := func() map[string]openEntry {
		t.Helper()
		e, err := kv.Get(ctx, openKey(p))
		if err != nil {
			t.Fatal(err)
		}
		m, err := decodeOpen(e.Value())
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	if m := stored(); len(m) != 2 {
		t.Fatalf("index %v, want %s and %s", m, k1, k2)
	}
	// k1's reservation ended in a record the index never saw (as after an
	// index write that a deposed owner's older one replaced).
	if _, err := kv.Put(ctx, k1, reserved(2, expires, true)); err != nil {
		t.Fatal(err)
	}
	c := newTold()
	b := peer(t, js, "b", c.note, nil)
	if err := wait(t, func(done func(error)) { b.Adopt(p, []string{a.cfg.Self}, 11, 10*time.Second, done) }); err != nil {
		t.Fatal(err)
	}
	c.await(t, k1) // the index names it: the sweep loads it
	if _, _, err := get(t, b, k1, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	// k2's reservation ends in a record b writes.
	_, rev, err := get(t, b, k2, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := update(t, b, k2, reserved(2, expires, true), rev); err != nil {
		t.Fatal(err)
	}
	if err := wait(t, func(done func(error)) { b.ck.run(-1, nil, done) }); err != nil {
		t.Fatal(err)
	}
	if m := stored(); len(m) != 0 {
		t.Fatalf("index %v after both keys' reservations ended, want none", m)
	}
}

// failIndex is a Bucket whose writes of open-reservation indexes fail
// while fail is set.
type failIndex struct {
	Bucket
	mu   sync.Mutex
	fail bool
}

func (b *failIndex) UpdateAsync(key string, val []byte, rev uint64, ttl, timeout time.Duration, done func(uint64, error)) {
	b.mu.Lock()
	f := b.fail
	b.mu.Unlock()
	if f && strings.HasPrefix(key, openPrefix) {
		go done(0, errors.New("no index write"))
		return
	}
	b.Bucket.UpdateAsync(key, val, rev, ttl, timeout, done)
}

// TestMarkWaitsForTheOpenIndex (J17, J3): a checkpoint whose index write
// fails leaves the records it wrote dirty, so the mark does not pass them
// (a node that fails then hands its next owner the records in its
// journal); once the index is written, the mark moves.
func TestMarkWaitsForTheOpenIndex(t *testing.T) {
	const p = 30
	key := keyIn(p, "")
	_, _, js := testJournal(t)
	fb := &failIndex{fail: true}
	a := peer(t, js, "a", nil, func(b Bucket) Bucket { fb.Bucket = b; return fb })
	if err := wait(t, func(done func(error)) { a.Adopt(p, nil, 3, 10*time.Second, done) }); err != nil {
		t.Fatal(err)
	}
	a.Renewed(p)
	if _, err := update(t, a, key, reserved(1, time.Now().Add(time.Minute).UnixNano(), false), 0); err != nil {
		t.Fatal(err)
	}
	last := a.w.lastSeq()
	if err := wait(t, func(done func(error)) { a.ck.run(-1, nil, done) }); err == nil {
		t.Fatal("checkpoint without its index: no error")
	}
	if m := a.ck.ownMark(); m >= last {
		t.Fatalf("mark %d passed the record at %d whose index is not written", m, last)
	}
	if _, _, _, hit, _ := a.recs.lookup(key, p, 0); !hit {
		t.Fatal("the record is not in the journal's memory any more")
	}
	fb.mu.Lock()
	fb.fail = false
	fb.mu.Unlock()
	if err := wait(t, func(done func(error)) { a.ck.run(-1, nil, done) }); err != nil {
		t.Fatal(err)
	}
	if m := a.ck.ownMark(); m < last {
		t.Fatalf("mark %d still below the record at %d once the index is written", m, last)
	}
}

// TestOpenIndexCodec: an index decodes to what was encoded; a damaged one
// is refused.
func TestOpenIndexCodec(t *testing.T) {
	keys := map[string]openEntry{
		"p.a.k=1": {policy: "a", open: 2, next: 5},
		"p.a.k=2": {policy: "a", open: 1, next: -3},
		"p.b":     {policy: "b", open: 1024, next: 1 << 60},
	}
	b, dropped := encodeOpen(keys)
	if dropped != 0 {
		t.Fatalf("dropped %d", dropped)
	}
	got, err := decodeOpen(b)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(keys) {
		t.Fatalf("decoded %v, want %v", got, keys)
	}
	for k, e := range keys {
		if !got[k].same(e) {
			t.Fatalf("%s: decoded %+v, want %+v", k, got[k], e)
		}
	}
	for i := range b {
		if _, err := decodeOpen(b[:i]); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("truncated to %d bytes: %v, want ErrCorrupt", i, err)
		}
	}
	if m, err := decodeOpen(nil); err != nil || m != nil {
		t.Fatalf("no index: %v %v", m, err)
	}
	// Over its size: the keys that expire first are kept.
	big := map[string]openEntry{}
	for i := range 20000 {
		big[keyIn(0, "")+strings.Repeat("x", 20)+string(rune('a'+i%26))+time.Duration(i).String()] = openEntry{policy: "a", open: 1, next: int64(i)}
	}
	b, dropped = encodeOpen(big)
	if dropped == 0 || len(b) > maxOpenBytes {
		t.Fatalf("%d bytes, %d dropped", len(b), dropped)
	}
	got, err = decodeOpen(b)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range got {
		if e.next >= int64(len(big)-dropped) {
			t.Fatalf("kept a key expiring at %d, after one left out", e.next)
		}
	}
}

// TestTellReservationsAfterALapse (J17): a node whose lease of a partition
// ran out (its sweeps forgot the partition's keys) and that serves it
// again without an adoption is told every key it knows to have open
// reservations: those only in the state bucket (the index) and those
// journalled since the last checkpoint; not a key whose latest record
// ended them.
func TestTellReservationsAfterALapse(t *testing.T) {
	const p = 17
	k1 := keyIn(p, "")
	k2 := keyIn(p, k1)
	k3 := k2
	for i := 0; k3 == k1 || k3 == k2; i++ {
		k3 = keyIn(p, k2) + strconv.Itoa(i)
		if ownership.PartitionOf(k3, testParts) != p {
			k3 = k2
		}
	}
	_, _, js := testJournal(t)
	c := newTold()
	a := peer(t, js, "a", c.note, nil)
	expires := time.Now().Add(time.Minute).UnixNano()
	ownAndCheckpoint(t, a, p, k1, reserved(1, expires, false))
	if _, err := update(t, a, k3, reserved(1, expires, false), 0); err != nil {
		t.Fatal(err)
	}
	if err := wait(t, func(done func(error)) { a.ck.run(-1, nil, done) }); err != nil {
		t.Fatal(err)
	}
	if _, err := update(t, a, k2, reserved(1, expires+1, false), 0); err != nil {
		t.Fatal(err)
	}
	_, rev := lookupRev(t, a, k3)
	if _, err := update(t, a, k3, reserved(2, expires, true), rev); err != nil {
		t.Fatal(err)
	}
	a.TellReservations(p)
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.keys) != 2 || c.keys[k1] != expires || c.keys[k2] != expires+1 {
		t.Fatalf("told %v, want %s and %s", c.keys, k1, k2)
	}
}
