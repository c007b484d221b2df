package kvstate

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/jstest"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// jsBucket starts an in-process nats-server with JetStream and creates a KV
// bucket on it.
func jsBucket(t *testing.T) (jetstream.JetStream, jetstream.KeyValue) {
	t.Helper()
	js := jstest.StartJetStream(t)
	return js, jstest.KeyValue(t, js, jetstream.KeyValueConfig{Bucket: "st"})
}

// TestJetStreamStoreFloorRead: GetAsyncFloor reads what GetAsync reads
// (a value with its revision; a missing key; a delete marker with its
// revision) from a replica that holds the stream up to the floor, and
// fails with ErrStale when the replica answering is behind the floor.
// One server stands in for both: a floor above its last sequence is what
// a stale replica (a cut-off stream leader after a partition heals) looks
// like to the reader.
// answered returns the answer of the asynchronous call what from ch, or
// fails t when none comes within 10 s.
func answered[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(10 * time.Second):
		t.Fatalf("%s never answered", what)
		var zero T
		return zero
	}
}

// floorBucket returns a store over a fresh bucket holding k = "v1" (at
// revk), a deleted key "gone", j = "v2" (at revj) and then the floor key
// "_floor" (at floor).
func floorBucket(t *testing.T) (s *JetStreamStore, revk, revj, floor uint64) {
	t.Helper()
	js, kv := jsBucket(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := NewJetStreamStore(ctx, js, "st")
	if err != nil {
		t.Fatal(err)
	}
	put := func(key, val string) uint64 {
		rev, err := kv.Put(ctx, key, []byte(val))
		if err != nil {
			t.Fatal(err)
		}
		return rev
	}
	revk = put("k", "v1")
	put("gone", "x")
	if err := kv.Delete(ctx, "gone"); err != nil {
		t.Fatal(err)
	}
	revj = put("j", "v2")
	return s, revk, revj, put("_floor", "")
}

func TestJetStreamStoreFloorRead(t *testing.T) {
	s, rev, _, floor := floorBucket(t)
	type res struct {
		val []byte
		rev uint64
		err error
	}
	read := func(key string, floor uint64) res {
		t.Helper()
		ch := make(chan res, 1)
		s.GetAsyncFloor(key, "_floor", floor, 5*time.Second, func(v []byte, r uint64, err error) { ch <- res{v, r, err} })
		return answered(t, ch, "GetAsyncFloor("+key+")")
	}
	if r := read("k", floor); r.err != nil || string(r.val) != "v1" || r.rev != rev {
		t.Fatalf("floor read of k: %q rev %d err %v, want v1 rev %d", r.val, r.rev, r.err, rev)
	}
	if r := read("never", floor); !errors.Is(r.err, ErrNotFound) || r.rev != 0 {
		t.Fatalf("floor read of a missing key: rev %d err %v, want ErrNotFound rev 0", r.rev, r.err)
	}
	if r := read("gone", floor); !errors.Is(r.err, ErrNotFound) || r.rev == 0 || r.rev >= floor {
		t.Fatalf("floor read of a deleted key: rev %d err %v, want ErrNotFound with the marker's revision", r.rev, r.err)
	}
	for _, key := range []string{"k", "never"} {
		if r := read(key, floor+1); !errors.Is(r.err, ErrStale) || r.val != nil {
			t.Fatalf("floor read of %q above the stream's end: %q err %v, want ErrStale", key, r.val, r.err)
		}
	}
	// A replica without the floor key at all (written after it was cut
	// off) answers an empty batch: stale too.
	if r := read("never", 0); !errors.Is(r.err, ErrNotFound) {
		t.Fatalf("floor 0: %v", r.err)
	}
	ch := make(chan error, 1)
	s.GetAsyncFloor("never", "_no_such_floor", 1, 5*time.Second, func(_ []byte, _ uint64, err error) { ch <- err })
	if err := <-ch; !errors.Is(err, ErrStale) {
		t.Fatalf("floor read without the floor key: %v, want ErrStale", err)
	}
}

// TestJetStreamStoreManyFloorRead: one direct get reads many keys with a
// freshness floor: each key's record (live, deleted, absent) in the order
// asked; a floor above the stream's end is ErrStale for the whole read;
// more than MaxManyKeys keys, none, or a key twice are refused.
func TestJetStreamStoreManyFloorRead(t *testing.T) {
	s, revK, revJ, floor := floorBucket(t)
	type res struct {
		recs []KeyRecord
		err  error
	}
	read := func(keys []string, floor uint64) res {
		t.Helper()
		ch := make(chan res, 1)
		s.GetManyAsyncFloor(keys, "_floor", floor, 5*time.Second, func(r []KeyRecord, err error) { ch <- res{r, err} })
		return answered(t, ch, fmt.Sprintf("GetManyAsyncFloor(%d keys)", len(keys)))
	}
	r := read([]string{"never", "k", "gone", "j"}, floor)
	if r.err != nil || len(r.recs) != 4 {
		t.Fatalf("read: %d records, %v", len(r.recs), r.err)
	}
	if rec := r.recs[0]; rec.Live || rec.Rev != 0 || rec.Value != nil {
		t.Fatalf("absent key: %+v", rec)
	}
	if rec := r.recs[1]; !rec.Live || rec.Rev != revK || string(rec.Value) != "v1" {
		t.Fatalf("k: %+v, want v1 at %d", rec, revK)
	}
	if rec := r.recs[2]; rec.Live || rec.Rev == 0 || rec.Rev >= revJ || rec.Value != nil {
		t.Fatalf("deleted key: %+v, want its marker's revision", rec)
	}
	if rec := r.recs[3]; !rec.Live || rec.Rev != revJ || string(rec.Value) != "v2" {
		t.Fatalf("j: %+v, want v2 at %d", rec, revJ)
	}
	if r := read([]string{"k", "never"}, floor+1); !errors.Is(r.err, ErrStale) || r.recs != nil {
		t.Fatalf("floor above the stream's end: %v, want ErrStale", r.err)
	}
	many := make([]string, MaxManyKeys)
	for i := range many {
		many[i] = "m" + strconv.Itoa(i)
	}
	if r := read(many, floor); r.err != nil || len(r.recs) != MaxManyKeys || r.recs[MaxManyKeys-1].Live {
		t.Fatalf("%d absent keys: %d records, %v", MaxManyKeys, len(r.recs), r.err)
	}
	for _, keys := range [][]string{append(many, "k"), nil, {"k", "k"}} {
		if r := read(keys, floor); r.err == nil {
			t.Fatalf("%d keys (%v...): no error", len(keys), keys[:min(len(keys), 2)])
		}
	}
}

func TestJetStreamStoreAsyncFailures(t *testing.T) {
	js, _ := jsBucket(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := NewJetStreamStore(ctx, js, "st")
	if err != nil {
		t.Fatal(err)
	}
	if err := js.DeleteKeyValue(ctx, "st"); err != nil {
		t.Fatal(err)
	}
	// No stream: no responders, a store error (not a conflict).
	updated, got := make(chan error, 1), make(chan error, 1)
	s.UpdateAsync("k", []byte("x"), 0, 5*time.Second, func(_ uint64, err error) { updated <- err })
	if err := answered(t, updated, "UpdateAsync"); err == nil || errors.Is(err, ErrConflict) {
		t.Fatalf("Update with the bucket gone: %v, want a store error", err)
	}
	s.GetAsync("k", 5*time.Second, func(_ []byte, _ uint64, err error) { got <- err })
	if err := answered(t, got, "GetAsync"); err == nil || errors.Is(err, ErrNotFound) {
		t.Fatalf("Get with the bucket gone: %v, want a store error", err)
	}
	// A subscriber that never answers: the operations time out.
	silence(t, js.Conn(), "$KV.st.>")
	done := make(chan error, 2)
	s.UpdateAsync("k", []byte("x"), 0, 20*time.Millisecond, func(_ uint64, err error) { done <- err })
	s.UpdateAsync("j", []byte("x"), 3, 40*time.Millisecond, func(_ uint64, err error) { done <- err })
	for range 2 {
		if err := <-done; !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("unanswered write: %v, want DeadlineExceeded", err)
		}
	}
}

func TestFastAck(t *testing.T) {
	cases := []struct {
		in   string
		seq  uint64
		fast bool
	}{
		{`{"stream":"KV_st","seq":12}`, 12, true},
		{`{"stream":"KV_st","seq":9999999999999999999}`, 9999999999999999999, true},
		{`{"stream":"KV_st","seq":18446744073709551615}`, 0, false},
		{`{"stream":"KV_st","seq":0}`, 0, false},
		{`{"stream":"KV_st","seq":012}`, 0, false},
		{`{"stream":"KV_sx","seq":12}`, 0, false},
		{`{"stream":"KV_st","seq":12,"duplicate":true}`, 0, false},
		{`{"stream":"KV_st","domain":"d","seq":12}`, 0, false},
		{`{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 3"},"stream":"KV_st","seq":0}`, 0, false},
		{`{"stream":"KV_st","seq":1x}`, 0, false},
	}
	for _, c := range cases {
		seq, ok := fastAck([]byte(c.in), "KV_st")
		if ok != c.fast || seq != c.seq {
			t.Errorf("%s: %d %v, want %d %v", c.in, seq, ok, c.seq, c.fast)
		}
	}
}

// FuzzParseAck checks that the fast acknowledgement reader agrees with
// encoding/json whenever it accepts.
func FuzzParseAck(f *testing.F) {
	f.Add([]byte(`{"stream":"KV_st","seq":12}`))
	f.Add([]byte(`{"stream":"KV_st","seq":99999999999999999999}`))
	f.Add([]byte(`{"stream":"KV_st","seq":7,"duplicate":true}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		seq, ok := fastAck(b, "KV_st")
		if !ok {
			return
		}
		var a pubAck
		if err := json.Unmarshal(b, &a); err != nil || a.Seq != seq || a.Stream != "KV_st" || a.Error != nil {
			t.Fatalf("%q: fast %d, encoding/json %+v %v", b, seq, a, err)
		}
	})
}

func TestParseAckConflict(t *testing.T) {
	s := &JetStreamStore{stream: "KV_st"}
	_, err := parseAck("k", s.stream, []byte(`{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 3"},"stream":"KV_st","seq":0}`))
	if !errors.Is(err, ErrConflict) {
		t.Fatalf("wrong last sequence: %v, want ErrConflict", err)
	}
	_, err = parseAck("k", s.stream, []byte(`{"error":{"code":503,"err_code":10077,"description":"resource limits exceeded"}}`))
	if err == nil || errors.Is(err, ErrConflict) {
		t.Fatalf("other JetStream error: %v, want a store error", err)
	}
	if rev, err := parseAck("k", s.stream, []byte(`{"stream":"KV_st", "seq":5, "duplicate":false}`)); err != nil || rev != 5 {
		t.Fatalf("ack with spaces: %d %v", rev, err)
	}
}

// TestPublishAsync: a publish to another stream through the store's pipe
// returns the stored sequence; a failed expected-sequence check is a
// conflict; a subject no stream takes fails (no responders), and a stream
// that never answers times out.
func TestPublishAsync(t *testing.T) {
	js, _ := jsBucket(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "LOG", Subjects: []string{"log.>"}}); err != nil {
		t.Fatal(err)
	}
	s, err := NewJetStreamStore(ctx, js, "st")
	if err != nil {
		t.Fatal(err)
	}
	publish := func(subj string, expect string, timeout time.Duration) (uint64, error) {
		m := nats.NewMsg(subj)
		m.Data = []byte("x")
		if expect != "" {
			m.Header.Set("Nats-Expected-Last-Subject-Sequence", expect)
		}
		ch := make(chan error, 1)
		var seq uint64
		s.PublishAsync(m, "LOG", timeout, func(q uint64, err error) { seq = q; ch <- err })
		return seq, <-ch
	}
	first, err := publish("log.a", "0", time.Second)
	if err != nil || first == 0 {
		t.Fatalf("first publish: %d, %v", first, err)
	}
	second, err := publish("log.a", strconv.FormatUint(first, 10), time.Second)
	if err != nil || second <= first {
		t.Fatalf("second publish: %d, %v (first %d)", second, err, first)
	}
	if _, err := publish("log.a", strconv.FormatUint(first, 10), time.Second); !errors.Is(err, ErrConflict) {
		t.Fatalf("publish expecting a stale sequence: %v, want ErrConflict", err)
	}
	if _, err := publish("nolog.a", "", time.Second); err == nil || errors.Is(err, ErrConflict) {
		t.Fatalf("publish to no stream: %v, want a store error", err)
	}
	silence(t, js.Conn(), "quiet.>")
	if _, err := publish("quiet.a", "", 20*time.Millisecond); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("unanswered publish: %v, want DeadlineExceeded", err)
	}
}

// silence subscribes to subject on nc without ever answering (until the
// test ends), so requests there get no reply.
func silence(t *testing.T, nc *nats.Conn, subject string) {
	t.Helper()
	sub, err := nc.SubscribeSync(subject)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
}
