package integration

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/mesh"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// State retention (CONTRACT §3): a key's state is kept while it can still
// change a decision, however short --state-ttl; the TTL bounds only how
// long a state at rest is kept. These tests run nodes with a 2 s state TTL
// against refills, windows and periods of an hour to a month, and use a
// witness key (at rest right after its decision) to see the TTL pass: its
// record shows up in the state bucket and then goes away.

// retentionTTL is the state TTL of these tests.
const retentionTTL = 2 * time.Second

// retentionWait bounds each wait of these tests (the witness's expiry
// takes the TTL, a checkpoint and the server's expiry timer).
const retentionWait = 60 * time.Second

// longLimit is a policy whose state takes far longer than the state TTL
// to come to rest, what one decision spends, and the remaining a dry run
// (cost 1) must report after idleness.
type longLimit struct {
	name   string // policy name and the value of its "algo" dimension
	limit  string
	spend  int
	check  func(r reply, spent time.Time) error
	period func(time.Time) time.Time // the window or period start, for windows that may roll over meanwhile
}

// remainingIn checks that a dry run's remaining is in [lo, hi).
func remainingIn(lo, hi float64) func(reply, time.Time) error {
	return func(r reply, _ time.Time) error {
		if r.Remaining < lo || r.Remaining >= hi {
			return fmt.Errorf("remaining %v, want [%v, %v)", r.Remaining, lo, hi)
		}
		return nil
	}
}

func hourOf(t time.Time) time.Time { return t.UTC().Truncate(time.Hour) }
func monthOf(t time.Time) time.Time {
	u := t.UTC()
	return time.Date(u.Year(), u.Month(), 1, 0, 0, 0, 0, time.UTC)
}

var longLimits = []longLimit{
	// 1000/d: 600 spent take 14.4 h to refill; a few seconds refill
	// well under half a unit.
	{name: "daily", limit: `{"algorithm":"token_bucket","rate":"1000/d","burst":1000}`, spend: 600, check: remainingIn(399, 399.5)},
	{name: "gcra", limit: `{"algorithm":"gcra","rate":"1000/d","burst":1000}`, spend: 600, check: remainingIn(399, 399.5)},
	{name: "hourly", limit: `{"algorithm":"fixed_window","limit":10,"window":"1h"}`, spend: 7, check: remainingIn(2, 2.001), period: hourOf},
	{name: "sliding", limit: `{"algorithm":"sliding_window","limit":10,"window":"1h"}`, spend: 3, check: remainingIn(6, 6.001), period: hourOf},
	{name: "log", limit: `{"algorithm":"sliding_log","limit":5,"window":"1h"}`, spend: 3, check: remainingIn(1, 1.001)},
	{name: "monthly", limit: `{"algorithm":"quota","limit":100,"period":"month"}`, spend: 60, check: remainingIn(39, 39.001), period: monthOf},
}

// The witness: 100/s, burst 1, at rest 10 ms after a decision.
const witnessLimit = `{"algorithm":"token_bucket","rate":"100/s","burst":1}`

func algoDesc(name string) map[string]string { return map[string]string{"algo": name} }
func algoKey(name string) string             { return "p." + name + ".algo=" + name }

// putRetentionPolicies puts one policy per long limit and the witness's,
// and waits until nc's node applies them.
func putRetentionPolicies(t *testing.T, nc *nats.Conn) {
	t.Helper()
	put := func(name, limit string) {
		doc := fmt.Sprintf(`{"match":{"algo":%q},"limits":[%s]}`, name, limit)
		waitRevision(t, nc, algoDesc(name), putPolicy(t, nc, "rl_policies", name, doc))
	}
	for _, l := range longLimits {
		put(l.name, l.limit)
	}
	put("witness", witnessLimit)
}

// spendLong spends each long limit's share once and returns when.
func spendLong(t *testing.T, nc *nats.Conn) time.Time {
	t.Helper()
	at := time.Now()
	for _, l := range longLimits {
		if r := decide(t, nc, "rl.v1.decide", req(algoDesc(l.name), fmt.Sprintf(`"cost":%d`, l.spend))); !r.Allowed || r.Code != "" {
			t.Fatalf("%s: spending %d: %+v", l.name, l.spend, r)
		}
	}
	return at
}

// decideServed decides like decide, again while the reply is a 503 (a
// node just restarted takes the partitions of the one before it over once
// their leases lapse).
func decideServed(t *testing.T, nc *nats.Conn, desc map[string]string, extra string) reply {
	t.Helper()
	var r reply
	waitWithin(t, retentionWait, "a decision from the key's owner", func() bool {
		r = decide(t, nc, "rl.v1.decide", req(desc, extra))
		return r.Code != "503"
	})
	return r
}

// witnessTTL spends the witness key and waits until its record reached
// the state bucket and then expired from it: a state at rest goes after
// the state TTL, and every record written before the witness has been
// idle at least that long.
func witnessTTL(t *testing.T, nc *nats.Conn, kv jetstream.KeyValue) {
	t.Helper()
	if r := decideServed(t, nc, algoDesc("witness"), ""); !r.Allowed {
		t.Fatalf("witness: %+v", r)
	}
	key := algoKey("witness")
	waitWithin(t, retentionWait, "the witness's record in the state bucket", func() bool { return inBucket(t, kv, key) })
	waitWithin(t, retentionWait, "the witness's record (at rest) expired from the state bucket", func() bool { return !inBucket(t, kv, key) })
}

// checkLong checks that every long limit's record is still in the state
// bucket and that its state is the one spent at spent (a window or period
// that rolled over since is not checked).
func checkLong(t *testing.T, nc *nats.Conn, kv jetstream.KeyValue, spent time.Time) {
	t.Helper()
	for _, l := range longLimits {
		if !inBucket(t, kv, algoKey(l.name)) {
			t.Errorf("%s: record dropped from the state bucket after %v idle, before it is at rest", l.name, time.Since(spent).Round(time.Second))
		}
		r := decideServed(t, nc, algoDesc(l.name), `"dry_run":true`)
		if l.period != nil && !l.period(spent).Equal(l.period(time.Now())) {
			t.Logf("%s: its window rolled over during the test; state not checked", l.name)
			continue
		}
		if err := l.check(r, spent); err != nil {
			t.Errorf("%s after %v idle (state TTL %v): %v (%+v)", l.name, time.Since(spent).Round(time.Second), retentionTTL, err, r)
		}
	}
}

// TestRetentionLongLimits: on one node, with and without the journal,
// states that are not at rest outlive the state TTL in the state bucket
// and keep deciding as spent once the node no longer caches them; a state
// at rest goes after the TTL.
func TestRetentionLongLimits(t *testing.T) {
	for _, noJournal := range []bool{false, true} {
		t.Run(fmt.Sprintf("journal=%v", !noJournal), func(t *testing.T) {
			e := server(t, t.TempDir())
			tn := startNode(t, e, mesh.NodeConfig{StateTTL: retentionTTL, NoJournal: noJournal, NoUsage: true})
			putRetentionPolicies(t, tn.nc)
			kv := stateKV(t, tn.nc)
			spent := spendLong(t, tn.nc)
			witnessTTL(t, tn.nc, kv)
			waitWithin(t, retentionWait, "idle keys dropped from the node's memory", func() bool {
				return metricValue(t, tn, "limitmesh_cached_keys") == 0
			})
			checkLong(t, tn.nc, kv, spent)
		})
	}
}

// TestRetentionAcrossRestart: the states outlive the state TTL across a
// restart of the server and the node: after a graceful stop (records
// checkpointed to the bucket), and after the node's connection was cut
// (records possibly only in its journal, adopted by the next node).
func TestRetentionAcrossRestart(t *testing.T) {
	for _, crash := range []bool{false, true} {
		t.Run(fmt.Sprintf("crash=%v", crash), func(t *testing.T) {
			dir := t.TempDir()
			e, err := mesh.StartEmbedded(mesh.EmbeddedConfig{Listen: "127.0.0.1:-1", DataDir: dir})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Shutdown()
			nc, err := nats.Connect(e.ClientURL())
			if err != nil {
				t.Fatal(err)
			}
			defer nc.Close()
			n, err := mesh.NewNode(nc, mesh.NodeConfig{StateTTL: retentionTTL, NoUsage: true, NodeID: "first"})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
			defer cancel()
			if err := n.Start(ctx); err != nil {
				t.Fatal(err)
			}
			putRetentionPolicies(t, nc)
			spent := spendLong(t, nc)
			if crash {
				nc.Close()
				sctx, scancel := context.WithTimeout(context.Background(), 2*time.Second)
				_ = n.Stop(sctx)
				scancel()
			} else if err := n.Stop(ctx); err != nil {
				t.Fatal(err)
			}
			nc.Close()
			e.Shutdown()

			e2 := server(t, dir)
			tn := startNode(t, e2, mesh.NodeConfig{StateTTL: retentionTTL, NoUsage: true, NodeID: "second"})
			kv := stateKV(t, tn.nc)
			witnessTTL(t, tn.nc, kv)
			checkLong(t, tn.nc, kv, spent)
		})
	}
}

// TestRetentionMigratesOldBuckets: a state bucket and a journal made by an
// older node (an age limit of the state TTL, no message TTLs) are widened
// to the retention horizon and allow message TTLs; states then outlive the
// TTL as on new buckets. Nothing else of their configuration changes.
func TestRetentionMigratesOldBuckets(t *testing.T) {
	e := server(t, t.TempDir())
	admin := connect(t, e)
	js, _ := jetstream.New(admin)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	if _, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "rl_state", History: 1, TTL: retentionTTL,
		Storage: jetstream.FileStorage}); err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "RL_JOURNAL", Subjects: []string{"rl.v1.journal.*"},
		Storage: jetstream.FileStorage, MaxAge: retentionTTL, Discard: jetstream.DiscardOld}); err != nil {
		t.Fatal(err)
	}
	// A record an older node wrote: no TTL of its own; kept for the
	// widened age limit now.
	kv := stateKV(t, admin)
	if _, err := kv.Put(ctx, "p.gone.tenant=old", []byte{2, 1, 'x', 1, 1, 0, 0}); err != nil {
		t.Fatal(err)
	}
	tn := startNode(t, e, mesh.NodeConfig{StateTTL: retentionTTL, NoUsage: true})
	for _, name := range []string{"KV_rl_state", "RL_JOURNAL"} {
		s, err := js.Stream(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		c := s.CachedInfo().Config
		if !c.AllowMsgTTL || c.MaxAge != mesh.RetentionHorizon || c.Storage != jetstream.FileStorage {
			t.Fatalf("%s after the start: allow TTL %v, max age %v, storage %v; want widened to %v",
				name, c.AllowMsgTTL, c.MaxAge, c.Storage, mesh.RetentionHorizon)
		}
	}
	putRetentionPolicies(t, tn.nc)
	spent := spendLong(t, tn.nc)
	witnessTTL(t, tn.nc, kv)
	checkLong(t, tn.nc, kv, spent)
	if !inBucket(t, kv, "p.gone.tenant=old") {
		t.Fatal("a record written before the migration expired by the old age limit")
	}
}
