package integration

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"math"
	"net/http/httptest"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// startKillableNode is startNode for a node the test may kill by closing
// its connection: it returns the node and kill; after kill, cleanup
// tolerates Stop's errors (the node's I/O fails from then on).
func startKillableNode(t *testing.T, e *mesh.Embedded, cfg mesh.NodeConfig) (*testNode, func()) {
	t.Helper()
	nc, err := nats.Connect(e.ClientURL())
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(nc.Close)
	n, err := mesh.NewNode(nc, cfg)
	if err != nil {
		t.Fatalf("NewNode: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	if err := n.Start(ctx); err != nil {
		t.Fatalf("Start: %v", err)
	}
	killed := false
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
		defer cancel()
		if err := n.Stop(ctx); err != nil && !killed {
			t.Errorf("Stop: %v", err)
		}
	})
	hs := httptest.NewServer(n.HTTPHandler())
	t.Cleanup(hs.Close)
	return &testNode{node: n, id: cfg.NodeID, nc: nc, http: hs}, func() {
		killed = true
		nc.Close()
	}
}

// journalStream opens the journal stream and the state bucket.
func journalStream(t *testing.T, nc *nats.Conn) (jetstream.JetStream, jetstream.Stream, jetstream.KeyValue) {
	t.Helper()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	stream, err := js.Stream(ctx, "RL_JOURNAL")
	if err != nil {
		t.Fatal(err)
	}
	return js, stream, stateKV(t, nc)
}

// inBucket reports whether the state bucket holds key.
func inBucket(t *testing.T, kv jetstream.KeyValue, key string) bool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	_, err := kv.Get(ctx, key)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return false
	}
	if err != nil {
		t.Fatal(err)
	}
	return true
}

// whole is the whole units remaining after a decision (slowPolicy refills
// a few thousandths of a unit while a test runs).
func whole(r reply) int64 { return int64(math.Floor(r.Remaining)) }

// fenceMsg is a journal fence message written out from the format comment
// in mesh/journal_codec.go: 'F' 1 uvarint(partition) uvarint(epoch)
// uvarint(len) node.
func fenceMsg(part int, epoch uint64, node string) []byte {
	b := []byte{'F', 1}
	b = binary.AppendUvarint(b, uint64(part))
	b = binary.AppendUvarint(b, epoch)
	b = binary.AppendUvarint(b, uint64(len(node)))
	return append(b, node...)
}

// crashPair is two nodes (records checkpointed hourly, so they stay in the
// journal) and a key of slowPolicy whose partition n1 owns; kill closes
// n1's connection.
type crashPair struct {
	n0, n1 *testNode
	kill   func()
	key    string
	p      int
	desc   map[string]string
}

func startCrashPair(t *testing.T) crashPair {
	t.Helper()
	e := server(t, t.TempDir())
	cfg := func(id string) mesh.NodeConfig {
		return mesh.NodeConfig{NodeID: id, LeaseTime: ownershipLease, CheckpointInterval: time.Hour}
	}
	n0 := startNode(t, e, cfg("n0"))
	n1, kill := startKillableNode(t, e, cfg("n1"))
	nodes := []*testNode{n0, n1}
	rev := putPolicy(t, n0.nc, "rl_policies", "slow", slowPolicy)
	waitApplied(t, "slow", rev, nodes...)
	waitExclusive(t, nodes)
	tenant := tenantOwnedBy(t, nodes, 1)
	key := slowKey(tenant)
	return crashPair{n0: n0, n1: n1, kill: kill, key: key, p: partitionOf(key),
		desc: map[string]string{"tenant": tenant}}
}

// TestJournalCrashAdoption: an owner whose records are only in its journal
// (long checkpoint interval) dies without handing its partitions over; the
// survivor claims its partition, adopts the records from the dead node's
// journal and decides against them: nothing admitted before is forgotten.
func TestJournalCrashAdoption(t *testing.T) {
	c := startCrashPair(t)
	n0, n1, kill, key, p, desc := c.n0, c.n1, c.kill, c.key, c.p, c.desc
	r := decide(t, n1.nc, "rl.v1.decide", req(desc, `"cost":15`))
	if !r.Allowed || whole(r) != 25 {
		t.Fatalf("spend through the owner: %+v", r)
	}
	_, _, kv := journalStream(t, n0.nc)
	if got := storedUnits(t, n0.nc, key); got != 25 {
		t.Fatalf("journalled record holds %d units, want 25", got)
	}
	if inBucket(t, kv, key) {
		t.Fatal("the record is in the state bucket already: the test needs it in the journal only")
	}
	epoch := epochOf(t, n1, p)

	requireOwner(t, r, p, n1)
	kill()
	waitFor(t, "the survivor owns the dead node's partition", func() bool { return serves(t, n0, p) })
	if e2 := epochOf(t, n0, p); e2 <= epoch {
		t.Fatalf("partition %d taken over in epoch %d, not above %d", p, e2, epoch)
	}
	spendRest(t, n0.nc, desc, "after the crash")
	if got := storedUnits(t, n0.nc, key); got != 0 {
		t.Fatalf("durable record after the takeover holds %d units, want 0", got)
	}
}

// TestJournalFence: a would-be new owner claims a partition and fences
// the owner's journal. The owner then commits no record of that partition
// (its decision for the partition's key is a 503, not an admission against
// its old state) and stops serving it; its other partitions' records still
// commit after the fence. When the claimer never renews, the node takes
// the partition back and adopts the records from its own journal.
func TestJournalFence(t *testing.T) {
	e := server(t, t.TempDir())
	const lease = 2 * time.Second // the 503 below must come before the claim expires
	tn := startNode(t, e, mesh.NodeConfig{NodeID: "n0", LeaseTime: lease, CheckpointInterval: time.Hour})
	rev := putPolicy(t, tn.nc, "rl_policies", "slow", slowPolicy)
	waitRevision(t, tn.nc, map[string]string{"tenant": "probe"}, rev)

	desc := map[string]string{"tenant": "fenced"}
	key := slowKey("fenced")
	p := partitionOf(key)
	other := ""
	for i := 0; other == ""; i++ {
		if partitionOf(slowKey("other"+strconv.Itoa(i))) != p {
			other = "other" + strconv.Itoa(i)
		}
	}
	otherDesc := map[string]string{"tenant": other}
	waitFor(t, "the node owns every partition", func() bool {
		return serves(t, tn, p) && serves(t, tn, partitionOf(slowKey(other)))
	})
	if r := decide(t, tn.nc, "rl.v1.decide", req(desc, `"cost":10`)); !r.Allowed || whole(r) != 30 {
		t.Fatalf("first spend: %+v", r)
	}
	if r := decide(t, tn.nc, "rl.v1.decide", req(otherDesc, `"cost":1`)); !r.Allowed || whole(r) != 39 {
		t.Fatalf("first spend of %s: %+v", other, r)
	}
	epoch := epochOf(t, tn, p)
	lostBefore := metricValue(t, tn, `limitmesh_ownership_changes_total{change="lost"}`)

	js, stream, _ := journalStream(t, tn.nc)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	shards, err := js.KeyValue(ctx, "rl_shards")
	if err != nil {
		t.Fatal(err)
	}
	// The claim a new owner writes: over the node's entry, adopting from
	// its journal; retried over the node's renewals.
	partKey := "part." + strconv.Itoa(p)
	var claim uint64
	waitFor(t, "intruder claim", func() bool {
		cur, err := shards.Get(ctx, partKey)
		if err != nil {
			return false
		}
		claim, err = shards.Update(ctx, partKey, []byte(`{"node":"intruder","from":["n0"]}`), cur.Revision())
		return err == nil
	})
	if claim <= epoch {
		t.Fatalf("claim revision %d not above the epoch %d", claim, epoch)
	}
	subj := "rl.v1.journal." + tn.id
	ack, err := js.Publish(ctx, subj, fenceMsg(p, claim, "intruder"))
	if err != nil {
		t.Fatal(err)
	}

	// Another partition's record commits after the fence (the node's next
	// append expects the sequence before the fence, reads the fence, and
	// appends again).
	if r := decide(t, tn.nc, "rl.v1.decide", req(otherDesc, `"cost":1`)); !r.Allowed || whole(r) != 38 {
		t.Fatalf("spend of %s after the fence: %+v", other, r)
	}
	last, err := stream.GetLastMsgForSubject(ctx, subj)
	if err != nil {
		t.Fatal(err)
	}
	if last.Sequence <= ack.Sequence {
		t.Fatalf("last journal message %d not after the fence %d", last.Sequence, ack.Sequence)
	}
	if got := storedUnits(t, tn.nc, slowKey(other)); got != 38 {
		t.Fatalf("record of %s after the fence holds %d units, want 38", other, got)
	}

	// The fenced partition: no decision against the old state.
	if r := decide(t, tn.nc, "rl.v1.decide", req(desc, `"cost":1`)); r.Code != "503" {
		t.Fatalf("fenced owner answered %+v, want 503", r)
	}
	// The node counts the partition lost as it stops serving it.
	waitMetric(t, tn, `limitmesh_ownership_changes_total{change="lost"}`, lostBefore+1)
	if got := storedUnits(t, tn.nc, key); got != 30 {
		t.Fatalf("record of the fenced key holds %d units, want 30 (nothing committed after the fence)", got)
	}

	// The intruder never renews: the node claims the partition back over
	// the intruder's claim, adopting from its own journal (and the
	// intruder's, which holds no record).
	waitFor(t, "partition reclaimed", func() bool { return serves(t, tn, p) })
	if e2 := epochOf(t, tn, p); e2 <= claim {
		t.Fatalf("reclaimed in epoch %d, not above the claim %d", e2, claim)
	}
	if r := decide(t, tn.nc, "rl.v1.decide", req(desc, `"cost":1`)); !r.Allowed || whole(r) != 29 {
		t.Fatalf("after the reclaim: %+v, want admitted with 29 left (10 of 40 spent before the fence)", r)
	}
	if r := decide(t, tn.nc, "rl.v1.decide", req(desc, `"cost":30`)); r.Code != "" || r.Allowed {
		t.Fatalf("after the reclaim: spending 30 of the 29 left: %+v, want a denial", r)
	}
}

// TestJournalCheckpoint: journalled records reach the state bucket within
// the checkpoint interval; the node then records its mark and purges its
// journal subject up to it, keeping the message at the mark.
func TestJournalCheckpoint(t *testing.T) {
	e := server(t, t.TempDir())
	tn := startNode(t, e, mesh.NodeConfig{NodeID: "n0", CheckpointInterval: 200 * time.Millisecond})
	rev := putPolicy(t, tn.nc, "rl_policies", "slow", slowPolicy)
	waitRevision(t, tn.nc, map[string]string{"tenant": "probe"}, rev)
	desc := map[string]string{"tenant": "ck"}
	key := slowKey("ck")
	// Three batches on the node's subject.
	for i, want := range []int64{35, 30, 25} {
		if r := decide(t, tn.nc, "rl.v1.decide", req(desc, `"cost":5`)); !r.Allowed || whole(r) != want {
			t.Fatalf("spend %d: %+v", i, r)
		}
	}
	js, stream, kv := journalStream(t, tn.nc)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	subj := "rl.v1.journal." + tn.id
	last, err := stream.GetLastMsgForSubject(ctx, subj)
	if err != nil {
		t.Fatal(err)
	}
	if last.Sequence < 3 {
		t.Fatalf("last journal message at %d, want at least three batches", last.Sequence)
	}

	waitFor(t, "the record in the state bucket", func() bool { return inBucket(t, kv, key) })
	var mark uint64
	waitFor(t, "the journal mark at the last batch", func() bool {
		e, err := kv.Get(ctx, "_journal."+tn.id)
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			return false
		}
		if err != nil {
			t.Fatal(err)
		}
		if mark, err = strconv.ParseUint(string(e.Value()), 10, 64); err != nil {
			t.Fatalf("mark %q: %v", e.Value(), err)
		}
		return mark >= last.Sequence
	})
	if mark != last.Sequence {
		t.Fatalf("mark %d beyond the last journal message %d", mark, last.Sequence)
	}
	// Past the mark the journal holds nothing of the key: the durable
	// record is the bucket's, with the units spent.
	if got := storedUnits(t, tn.nc, key); got != 25 {
		t.Fatalf("checkpointed record holds %d units, want 25", got)
	}
	entry, err := kv.Get(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	durable, err := mesh.ReadStateRecord(ctx, js, "rl", key)
	if err != nil || !bytes.Equal(durable, entry.Value()) {
		t.Fatalf("ReadStateRecord %x, %v; the bucket holds %x", durable, err, entry.Value())
	}

	waitFor(t, "the journal purged up to the mark", func() bool {
		info, err := stream.Info(ctx, jetstream.WithSubjectFilter(subj))
		if err != nil {
			t.Fatal(err)
		}
		return info.State.Subjects[subj] <= 1
	})
	first, err := stream.GetMsg(ctx, 1, jetstream.WithGetMsgSubject(subj))
	if err != nil {
		t.Fatal(err)
	}
	if first.Sequence != mark {
		t.Fatalf("first message of %s at %d, want the one at the mark %d", subj, first.Sequence, mark)
	}

	// The journal goes on after the purge (the next append expects the
	// message at the mark).
	if r := decide(t, tn.nc, "rl.v1.decide", req(desc, `"cost":5`)); !r.Allowed || whole(r) != 20 {
		t.Fatalf("spend after the purge: %+v", r)
	}
	if got := storedUnits(t, tn.nc, key); got != 20 {
		t.Fatalf("record after the purge holds %d units, want 20", got)
	}
}

// TestReadStateRecord: ReadStateRecord returns a record only journalled,
// one only in the state bucket, and an error wrapping kvstate.ErrNotFound
// for a key never used; after a graceful stop the record is in the bucket.
func TestReadStateRecord(t *testing.T) {
	e := server(t, t.TempDir())
	tn := startNode(t, e, mesh.NodeConfig{NodeID: "n0", CheckpointInterval: time.Hour})
	rev := putPolicy(t, tn.nc, "rl_policies", "slow", slowPolicy)
	waitRevision(t, tn.nc, map[string]string{"tenant": "probe"}, rev)
	js, _, kv := journalStream(t, tn.nc)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()

	desc := map[string]string{"tenant": "read"}
	key := slowKey("read")
	if r := decide(t, tn.nc, "rl.v1.decide", req(desc, `"cost":7`)); !r.Allowed || whole(r) != 33 {
		t.Fatalf("spend: %+v", r)
	}
	journalled, err := mesh.ReadStateRecord(ctx, js, "rl", key)
	if err != nil {
		t.Fatalf("ReadStateRecord of a journalled record: %v", err)
	}
	if inBucket(t, kv, key) {
		t.Fatal("the record is in the state bucket already: the test needs it in the journal only")
	}
	if got := storedUnits(t, tn.nc, key); got != 33 {
		t.Fatalf("journalled record holds %d units, want 33", got)
	}

	if _, err := mesh.ReadStateRecord(ctx, js, "rl", slowKey("never-used")); !errors.Is(err, kvstate.ErrNotFound) {
		t.Fatalf("ReadStateRecord of a key never used: %v, want kvstate.ErrNotFound", err)
	}

	byHand := slowKey("by-hand")
	if _, err := kv.Put(ctx, byHand, []byte("bucket value")); err != nil {
		t.Fatal(err)
	}
	if got, err := mesh.ReadStateRecord(ctx, js, "rl", byHand); err != nil || string(got) != "bucket value" {
		t.Fatalf("ReadStateRecord of a bucket-only record: %q, %v", got, err)
	}

	// A graceful stop checkpoints before it hands the partitions over.
	if err := tn.node.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	entry, err := kv.Get(ctx, key)
	if err != nil {
		t.Fatalf("record after a graceful stop: %v", err)
	}
	if !bytes.Equal(entry.Value(), journalled) {
		t.Fatalf("bucket holds %x after the stop, the journal held %x", entry.Value(), journalled)
	}
	if got, err := mesh.ReadStateRecord(ctx, js, "rl", key); err != nil || !bytes.Equal(got, journalled) {
		t.Fatalf("ReadStateRecord after the stop: %x, %v", got, err)
	}
}

// TestJournalStaleFence: fences that do not take a partition from the
// node (one from an epoch before the node's, one naming the node itself)
// are read and passed over: the node's next append, which they made fail,
// is retried and commits, and the node keeps serving the partition.
func TestJournalStaleFence(t *testing.T) {
	e := server(t, t.TempDir())
	tn := startNode(t, e, mesh.NodeConfig{NodeID: "n0", CheckpointInterval: time.Hour})
	rev := putPolicy(t, tn.nc, "rl_policies", "slow", slowPolicy)
	waitRevision(t, tn.nc, map[string]string{"tenant": "probe"}, rev)
	desc := map[string]string{"tenant": "stale"}
	key := slowKey("stale")
	p := partitionOf(key)
	if r := decide(t, tn.nc, "rl.v1.decide", req(desc, `"cost":10`)); !r.Allowed || whole(r) != 30 {
		t.Fatalf("first spend: %+v", r)
	}
	epoch := epochOf(t, tn, p)
	if epoch < 2 {
		t.Fatalf("epoch %d: no older epoch to fence with", epoch)
	}
	js, stream, _ := journalStream(t, tn.nc)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	subj := "rl.v1.journal." + tn.id
	want := int64(30)
	for _, f := range []struct {
		what  string
		epoch uint64
		node  string
	}{
		{"an older epoch", epoch - 1, "intruder"},
		{"the node itself", epoch + 1000, tn.id},
	} {
		ack, err := js.Publish(ctx, subj, fenceMsg(p, f.epoch, f.node))
		if err != nil {
			t.Fatal(err)
		}
		want--
		r := decide(t, tn.nc, "rl.v1.decide", req(desc, `"cost":1`))
		if !r.Allowed || whole(r) != want {
			t.Fatalf("after a fence of %s: %+v, want admitted with %d left", f.what, r, want)
		}
		last, err := stream.GetLastMsgForSubject(ctx, subj)
		if err != nil {
			t.Fatal(err)
		}
		if last.Sequence <= ack.Sequence {
			t.Fatalf("after a fence of %s: last journal message %d not after the fence %d", f.what, last.Sequence, ack.Sequence)
		}
		if got := storedUnits(t, tn.nc, key); got != want {
			t.Fatalf("after a fence of %s: record holds %d units, want %d", f.what, got, want)
		}
		// Kept in its epoch: never lost (a loss and a claim back would
		// be a new epoch).
		if e := readShard(t, tn.nc, p); e.Node != tn.id || e.Epoch != epoch {
			t.Fatalf("after a fence of %s: the entry %+v, want %s in epoch %d", f.what, e, tn.id, epoch)
		}
		if v := metricValue(t, tn, `limitmesh_ownership_changes_total{change="lost"}`); v != 0 {
			t.Fatalf("after a fence of %s: lost changes %v, want 0", f.what, v)
		}
	}
	if v := metricValue(t, tn, `limitmesh_ownership_changes_total{change="lost"}`); v != 0 {
		t.Fatalf("lost changes %v, want 0", v)
	}
}

// TestJournalCrashAdoptionLong: as TestJournalCrashAdoption, with the dead
// node's records spread over 150 journal messages (one per sequential
// decision), more than the survivor reads one request at a time: the rest
// comes through a consumer, and the last record of the key wins.
func TestJournalCrashAdoptionLong(t *testing.T) {
	c := startCrashPair(t)
	n0, n1, kill, key, p, desc := c.n0, c.n1, c.kill, c.key, c.p, c.desc
	var r reply
	for i := range 150 {
		if r = decide(t, n1.nc, "rl.v1.decide", req(desc, `"cost":"0.2"`)); !r.Allowed {
			t.Fatalf("spend %d through the owner: %+v", i, r)
		}
	}
	_, _, kv := journalStream(t, n0.nc)
	if inBucket(t, kv, key) {
		t.Fatal("the record is in the state bucket already: the test needs it in the journal only")
	}
	requireOwner(t, r, p, n1)
	kill()
	waitFor(t, "the survivor owns the dead node's partition", func() bool { return serves(t, n0, p) })
	r = decide(t, n0.nc, "rl.v1.decide", req(desc, `"cost":1`))
	if r.Code != "" || !r.Allowed || whole(r) != 9 {
		t.Fatalf("after the crash: %+v, want admitted with 9 left (30 of 40 spent before)", r)
	}
	if r := decide(t, n0.nc, "rl.v1.decide", req(desc, `"cost":10`)); r.Code != "" || r.Allowed {
		t.Fatalf("after the crash: spending 10 of the 9 left: %+v, want a denial", r)
	}
}

// TestJournalClaimerKilled: the owner dies with its records only in its
// journal, and the node that claims its partition is killed the moment its
// claim appears (as a rule while it fences and reads the dead node's
// journal, before it serves). The last node takes the partition over from
// both and decides against what was spent before the first crash.
func TestJournalClaimerKilled(t *testing.T) {
	e := server(t, t.TempDir())
	nodes := make([]*testNode, 3)
	kills := make([]func(), 3)
	for i := range nodes {
		nodes[i], kills[i] = startKillableNode(t, e, mesh.NodeConfig{NodeID: "n" + strconv.Itoa(i),
			LeaseTime: ownershipLease, CheckpointInterval: time.Hour})
	}
	rev := putPolicy(t, nodes[0].nc, "rl_policies", "slow", slowPolicy)
	waitApplied(t, "slow", rev, nodes...)
	waitExclusive(t, nodes)
	tenant := tenantOwnedBy(t, nodes, 1)
	desc := map[string]string{"tenant": tenant}
	p := partitionOf(slowKey(tenant))
	first := decide(t, nodes[1].nc, "rl.v1.decide", req(desc, `"cost":15`))
	if !first.Allowed || whole(first) != 25 {
		t.Fatalf("spend through the owner: %+v", first)
	}

	// ctx also bounds the wait for a claim below.
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	js, err := jetstream.New(nodes[0].nc)
	if err != nil {
		t.Fatal(err)
	}
	shards, err := js.KeyValue(ctx, "rl_shards")
	if err != nil {
		t.Fatal(err)
	}
	w, err := shards.Watch(ctx, "part."+strconv.Itoa(p), jetstream.UpdatesOnly())
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()

	requireOwner(t, first, p, nodes[1])
	kills[1]()
	claimer := -1
	var claim struct {
		Node string   `json:"node"`
		From []string `json:"from"`
	}
	for claimer < 0 {
		select {
		case en := <-w.Updates():
			if en == nil || en.Operation() != jetstream.KeyValuePut || json.Unmarshal(en.Value(), &claim) != nil {
				continue
			}
			switch claim.Node {
			case "n0":
				claimer = 0
			case "n2":
				claimer = 2
			}
		case <-ctx.Done():
			t.Fatal("no node claimed the dead owner's partition")
		}
	}
	kills[claimer]()
	t.Logf("claimer n%d killed; its claim adopts from %v", claimer, claim.From)
	if !slices.Contains(claim.From, "n1") {
		t.Fatalf("the claim after n1's crash adopts from %v, not from n1", claim.From)
	}

	last := nodes[2-claimer]
	waitFor(t, "the last node owns the partition", func() bool { return serves(t, last, p) })
	spendRest(t, last.nc, desc, "after both crashes")
}

// spendRest spends the rest of a slowPolicy key of which 15 of 40 units
// were spent before a takeover: 1 is admitted with 24 left, 25 is denied,
// the last 24 are admitted.
func spendRest(t *testing.T, nc *nats.Conn, desc map[string]string, when string) {
	t.Helper()
	r := decide(t, nc, "rl.v1.decide", req(desc, `"cost":1`))
	if r.Code != "" || !r.Allowed || whole(r) != 24 {
		t.Fatalf("%s: %+v, want admitted with 24 left (15 of 40 spent before)", when, r)
	}
	if r := decide(t, nc, "rl.v1.decide", req(desc, `"cost":25`)); r.Allowed {
		t.Fatalf("%s: spending 25 of the 24 left was admitted: %+v", when, r)
	}
	if r := decide(t, nc, "rl.v1.decide", req(desc, `"cost":24`)); !r.Allowed || whole(r) != 0 {
		t.Fatalf("%s: spending the 24 left: %+v", when, r)
	}
}

// TestNoJournal: with NodeConfig.NoJournal (serve --journal=false) every
// strict decision's record is a compare-and-swap write of its key: it is
// in the state bucket when the reply comes, and no journal stream exists.
func TestNoJournal(t *testing.T) {
	e := server(t, t.TempDir())
	tn := startNode(t, e, mesh.NodeConfig{NoJournal: true})
	rev := putPolicy(t, tn.nc, "rl_policies", "slow", slowPolicy)
	waitRevision(t, tn.nc, map[string]string{"tenant": "probe"}, rev)
	desc := map[string]string{"tenant": "nj"}
	for range 10 {
		if r := decide(t, tn.nc, "rl.v1.decide", req(desc, "")); !r.Allowed {
			t.Fatalf("spend: %+v", r)
		}
	}
	kv := stateKV(t, tn.nc)
	if !inBucket(t, kv, slowKey("nj")) {
		t.Fatal("the record is not in the state bucket after the replies")
	}
	if got := storedUnits(t, tn.nc, slowKey("nj")); got != 30 {
		t.Fatalf("stored %d units, want 30", got)
	}
	js, err := jetstream.New(tn.nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	if _, err := js.Stream(ctx, "RL_JOURNAL"); !errors.Is(err, jetstream.ErrStreamNotFound) {
		t.Fatalf("journal stream with NoJournal: %v, want not found", err)
	}
}
