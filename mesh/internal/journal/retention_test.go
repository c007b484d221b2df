package journal

import (
	"context"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/rt"
	"github.com/nats-io/nats.go/jetstream"
)

// retentionJournal is testJournal with streams that allow message TTLs
// and a journal that writes them (ret); it holds every partition.
func retentionJournal(t *testing.T, ret keyrec.Retention) (*Journal, jetstream.JetStream) {
	t.Helper()
	j, _, js := testJournal(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, name := range []string{"KV_rl_state", StreamName("rl")} {
		if _, err := kvstate.EnsureTTLStream(ctx, js, name, ret.Horizon); err != nil {
			t.Fatal(err)
		}
	}
	j.cfg.Retention = ret
	for p := range testParts {
		j.recs.owned[p] = true
	}
	return j, js
}

// ttlOf returns the Nats-TTL header of stream's message at seq.
func ttlOf(t *testing.T, js jetstream.JetStream, stream string, seq uint64) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatal(err)
	}
	m, err := s.GetMsg(ctx, seq)
	if err != nil {
		t.Fatal(err)
	}
	return m.Header.Get(jetstream.MsgTTLHeader)
}

// secondsIn reports whether header value v is a number of seconds in
// [lo, hi].
func secondsIn(v string, lo, hi time.Duration) bool {
	d, err := time.ParseDuration(v + "s")
	return err == nil && d >= lo && d <= hi
}

// TestJournalRetention: each journal message is kept until the records in
// it, and in every message before it, come to rest (at least the state
// TTL); a checkpointed record is kept in the bucket until it comes to rest
// (at least the state TTL), by its own rest time; the mark as long as the
// messages it covers; a fence of another node's journal the state TTL.
func TestJournalRetention(t *testing.T) {
	const day = 24 * time.Hour
	ret := keyrec.Retention{Floor: 3 * time.Second, Horizon: 366 * day}
	j, js := retentionJournal(t, ret)
	now := time.Now()
	record := func(rest time.Time) []byte {
		return keyrec.Append(nil, &keyrec.Record{Policy: "p", Revision: 1, Version: 1, RestAt: rest.UnixNano()})
	}
	put := func(key string, val []byte) uint64 {
		t.Helper()
		var seq uint64
		if err := wait(t, func(done func(error)) {
			j.UpdateAsync(key, val, nil, 0, 5*time.Second, func(rev uint64, err error) {
				seq = rev & revSeqMask
				done(err)
			})
		}); err != nil {
			t.Fatalf("journalling %s: %v", key, err)
		}
		return seq
	}
	// A record at rest in a day, then one at rest now: the second message
	// is kept as long as the first.
	long := put("p.t.k=long", record(now.Add(day)))
	short := put("p.t.k=short", record(now))
	lo, hi := day, day+keyrec.RetentionMargin
	if v := ttlOf(t, js, StreamName("rl"), long); !secondsIn(v, lo-10*time.Second, hi) {
		t.Fatalf("the first message's Nats-TTL %q, want about a day", v)
	}
	if v := ttlOf(t, js, StreamName("rl"), short); !secondsIn(v, lo-10*time.Second, hi) {
		t.Fatalf("the second message's Nats-TTL %q, want the first's (about a day)", v)
	}
	if err := wait(t, func(done func(error)) { j.ck.run(-1, nil, done) }); err != nil {
		t.Fatalf("checkpoint: %v", err)
	}
	st, err := kvstate.NewJetStreamStore(context.Background(), js, "rl_state")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, c := range []struct {
		key    string
		lo, hi time.Duration
	}{
		{"p.t.k=long", lo - 10*time.Second, hi},
		{"p.t.k=short", ret.Floor, ret.Floor},
		{markPrefix + "me", lo - 10*time.Second, hi},
	} {
		_, rev, err := st.Get(ctx, c.key)
		if err != nil {
			t.Fatalf("%s: %v", c.key, err)
		}
		if v := ttlOf(t, js, "KV_rl_state", rev); !secondsIn(v, c.lo, c.hi) {
			t.Fatalf("%s in the bucket: Nats-TTL %q, want [%v, %v]", c.key, v, c.lo, c.hi)
		}
	}
	// A fence appended to another node's journal: the state TTL.
	seq := make(chan uint64, 1)
	j.cfg.Stream.Publish(Subjects("rl")+"other", appendFence(nil, fence{part: 1, epoch: 2, node: "me"}), j.floorTTL(), time.Second,
		func(s uint64, err error) {
			if err != nil {
				t.Error(err)
			}
			seq <- s
		})
	if v := ttlOf(t, js, StreamName("rl"), <-seq); v != "3" {
		t.Fatalf("fence: Nats-TTL %q, want the state TTL", v)
	}
}

// TestJournalRetentionOff: without retention no message carries a TTL.
func TestJournalRetentionOff(t *testing.T) {
	j, _, js := testJournal(t)
	for p := range testParts {
		j.recs.owned[p] = true
	}
	var seq uint64
	val := keyrec.Append(nil, &keyrec.Record{Policy: "p", Revision: 1, Version: 1, RestAt: time.Now().Add(time.Hour).UnixNano()})
	if err := wait(t, func(done func(error)) {
		j.UpdateAsync("p.t.k=1", val, nil, 0, 5*time.Second, func(rev uint64, err error) {
			seq = rev & revSeqMask
			done(err)
		})
	}); err != nil {
		t.Fatal(err)
	}
	if v := ttlOf(t, js, StreamName("rl"), seq); v != "" {
		t.Fatalf("Nats-TTL %q with retention off", v)
	}
}

// TestJournalInheritedKeep: a journal whose subject holds an earlier
// incarnation's messages keeps its marks for the retention horizon.
func TestJournalInheritedKeep(t *testing.T) {
	ret := keyrec.Retention{Floor: time.Second, Horizon: 366 * 24 * time.Hour}
	j := New(Config{Self: "me", Prefix: "rl", Parts: 4, Runtime: rt.Real, Last: 7, Mark: 3, Retention: ret})
	if ttl := ret.TTLAt(j.w.keepUntil(), time.Now().UnixNano()); ttl < ret.Horizon-time.Minute {
		t.Fatalf("inherited messages: marks kept %v, want the horizon", ttl)
	}
	j = New(Config{Self: "me", Prefix: "rl", Parts: 4, Runtime: rt.Real, Retention: ret})
	if ttl := ret.TTLAt(j.w.keepUntil(), time.Now().UnixNano()); ttl != ret.Floor {
		t.Fatalf("a new subject: marks kept %v, want the floor", ttl)
	}
}
