package kvstate

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

func TestTTLValue(t *testing.T) {
	for _, c := range []struct {
		ttl  time.Duration
		want string
	}{
		{0, ""},
		{time.Nanosecond, "1"},
		{time.Second, "1"},
		{time.Second + 1, "2"},
		{90 * time.Minute, "5400"},
		{MaxTTL, "3153600000"},
		{MaxTTL + 1, "never"},
		{NoExpiry, "never"},
		{-time.Hour, "never"},
	} {
		if got := TTLValue(c.ttl); got != c.want {
			t.Errorf("TTLValue(%v) = %q, want %q", c.ttl, got, c.want)
		}
	}
}

// TestEnsureTTLStream: a stream is widened to allow message TTLs and to an
// age limit at least the one asked for; it is never narrowed, and one that
// needs nothing is not updated.
func TestEnsureTTLStream(t *testing.T) {
	js, _ := jsBucket(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	mk := func(name string, age time.Duration) {
		t.Helper()
		if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{name + ".>"}, MaxAge: age}); err != nil {
			t.Fatal(err)
		}
	}
	mk("OLD", time.Hour)         // a limit below the one asked for: raised
	mk("LONGER", 1000*time.Hour) // a longer limit: kept
	mk("NONE", 0)                // no limit: kept
	for _, c := range []struct {
		name string
		ask  time.Duration
		want time.Duration
	}{
		{"OLD", 24 * time.Hour, 24 * time.Hour},
		{"LONGER", 24 * time.Hour, 1000 * time.Hour},
		{"NONE", 24 * time.Hour, 0},
		{"OLD", time.Hour, 24 * time.Hour}, // again, asking less: unchanged
		{"LONGER", 0, 0},                   // asking for no limit: widened to none
	} {
		cfg, err := EnsureTTLStream(ctx, js, c.name, c.ask)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		st, err := js.Stream(ctx, c.name)
		if err != nil {
			t.Fatal(err)
		}
		got := st.CachedInfo().Config
		if !cfg.AllowMsgTTL || !got.AllowMsgTTL || cfg.MaxAge != c.want || got.MaxAge != c.want {
			t.Fatalf("%s asking %v: returned allow %v age %v, stored allow %v age %v; want age %v",
				c.name, c.ask, cfg.AllowMsgTTL, cfg.MaxAge, got.AllowMsgTTL, got.MaxAge, c.want)
		}
	}
	if _, err := EnsureTTLStream(ctx, js, "MISSING", time.Hour); !errors.Is(err, jetstream.ErrStreamNotFound) {
		t.Fatalf("missing stream: %v", err)
	}
}

// TestUpdateAsyncTTL: a write's TTL is its message's Nats-TTL header; a
// value whose TTL passed reads as absent (no message, or a marker when the
// bucket keeps markers), and a create then succeeds over it.
func TestUpdateAsyncTTL(t *testing.T) {
	js, _ := jsBucket(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for _, markers := range []bool{false, true} {
		bucket := "ttl"
		kvc := jetstream.KeyValueConfig{Bucket: bucket, TTL: time.Hour}
		if markers {
			bucket = "ttlm"
			kvc = jetstream.KeyValueConfig{Bucket: bucket, TTL: time.Hour, LimitMarkerTTL: time.Second}
		}
		if _, err := js.CreateKeyValue(ctx, kvc); err != nil {
			t.Fatal(err)
		}
		if _, err := EnsureTTLStream(ctx, js, "KV_"+bucket, 2*time.Hour); err != nil {
			t.Fatal(err)
		}
		s, err := NewJetStreamStore(ctx, js, bucket)
		if err != nil {
			t.Fatal(err)
		}
		update := func(key string, rev uint64, ttl time.Duration) uint64 {
			t.Helper()
			ch := make(chan uint64, 1)
			s.UpdateAsyncTTL(key, []byte("v"), rev, ttl, 5*time.Second, func(r uint64, err error) {
				if err != nil {
					t.Errorf("update %s: %v", key, err)
				}
				ch <- r
			})
			return answered(t, ch, "update")
		}
		stream, err := js.Stream(ctx, "KV_"+bucket)
		if err != nil {
			t.Fatal(err)
		}
		header := func(rev uint64) string {
			t.Helper()
			m, err := stream.GetMsg(ctx, rev)
			if err != nil {
				t.Fatal(err)
			}
			return m.Header.Get(jetstream.MsgTTLHeader)
		}
		for _, c := range []struct {
			key  string
			ttl  time.Duration
			want string
		}{{"day", 24 * time.Hour, "86400"}, {"never", NoExpiry, "never"}, {"none", 0, ""}, {"short", 1500 * time.Millisecond, "2"}} {
			if got := header(update(c.key, 0, c.ttl)); got != c.want {
				t.Fatalf("markers %v, %s: Nats-TTL %q, want %q", markers, c.key, got, c.want)
			}
		}
		// "short" expires: read as absent, created again over it.
		deadline := time.Now().Add(15 * time.Second)
		for {
			_, rev, err := s.Get(ctx, "short")
			if errors.Is(err, ErrNotFound) {
				if markers != (rev != 0) {
					t.Fatalf("markers %v: expired key read with revision %d", markers, rev)
				}
				update("short", rev, time.Hour)
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			if time.Now().After(deadline) {
				t.Fatalf("markers %v: a 2 s TTL did not expire within 15 s", markers)
			}
			time.Sleep(50 * time.Millisecond)
		}
		// A floor read of several keys sees it absent too, until the
		// create above: do it again on a key that expires.
		update("short2", 0, time.Second)
		for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			ch := make(chan []KeyRecord, 1)
			s.GetManyAsyncFloor([]string{"short2", "day"}, "day", 1, 5*time.Second, func(recs []KeyRecord, err error) {
				if err != nil {
					t.Errorf("floor read: %v", err)
				}
				ch <- recs
			})
			recs := answered(t, ch, "floor read")
			if len(recs) == 2 && !recs[0].Live {
				if !recs[1].Live || markers != (recs[0].Rev != 0) {
					t.Fatalf("markers %v: floor read after expiry: %+v", markers, recs)
				}
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("markers %v: a 1 s TTL did not expire within 15 s", markers)
			}
		}
		for _, k := range []string{"day", "never", "none", "short"} {
			if _, _, err := s.Get(ctx, k); err != nil {
				t.Fatalf("markers %v: %s: %v", markers, k, err)
			}
		}
	}
}
