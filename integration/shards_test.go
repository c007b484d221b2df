package integration

import (
	"context"
	"encoding/json"
	"errors"
	"strconv"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/limitmesh/limitmesh/mesh"
)

// shardEntry is a partition's entry in the shards bucket as an operator
// reads it (`nats kv get rl_shards part.<n>`; docs/protocol.md, "The
// shards bucket"): {"node","from"} when claimed, {"node","epoch"} once
// renewed.
type shardEntry struct {
	// Node is the node the entry names; "" when there is no entry (or
	// it was deleted).
	Node string
	// Epoch is the epoch Node holds the partition in: the renewal's
	// "epoch", or the revision of the claim when it is not renewed yet.
	Epoch uint64
	// Renewed: the entry is a renewal, which a node writes only once it
	// adopted the partition and serves it.
	Renewed bool
}

// decodeShard reads one part.<n> entry; deleted entries name no node.
func decodeShard(t testing.TB, en jetstream.KeyValueEntry) shardEntry {
	t.Helper()
	if en.Operation() != jetstream.KeyValuePut {
		return shardEntry{}
	}
	var v struct {
		Node  string `json:"node"`
		Epoch uint64 `json:"epoch"`
	}
	if err := json.Unmarshal(en.Value(), &v); err != nil {
		t.Fatalf("%s holds %q: %v", en.Key(), en.Value(), err)
	}
	if v.Epoch != 0 {
		return shardEntry{Node: v.Node, Epoch: v.Epoch, Renewed: true}
	}
	return shardEntry{Node: v.Node, Epoch: en.Revision()}
}

// shardsBucket opens rl_shards on nc.
func shardsBucket(t testing.TB, ctx context.Context, nc *nats.Conn) jetstream.KeyValue {
	t.Helper()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	kv, err := js.KeyValue(ctx, "rl_shards")
	if err != nil {
		t.Fatalf("rl_shards: %v", err)
	}
	return kv
}

// readShard returns partition p's entry, read on nc.
func readShard(t testing.TB, nc *nats.Conn, p int) shardEntry {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	return getShard(t, ctx, shardsBucket(t, ctx, nc), p)
}

func getShard(t testing.TB, ctx context.Context, kv jetstream.KeyValue, p int) shardEntry {
	t.Helper()
	en, err := kv.Get(ctx, "part."+strconv.Itoa(p))
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return shardEntry{}
	}
	if err != nil {
		t.Fatalf("reading part.%d: %v", p, err)
	}
	return decodeShard(t, en)
}

// readShards returns the entries of partitions 0..mesh.DefaultPartitions-1,
// read on nc one by one: a watch would need a consumer, which JetStream
// cannot create while its meta leader is cut off (a region cut), when
// direct reads of the bucket still answer.
func readShards(t testing.TB, nc *nats.Conn) map[int]shardEntry {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	kv := shardsBucket(t, ctx, nc)
	out := make(map[int]shardEntry, mesh.DefaultPartitions)
	for p := range mesh.DefaultPartitions {
		out[p] = getShard(t, ctx, kv, p)
	}
	return out
}

// heldAll reports whether tn holds every partition shards names it for:
// its limitmesh_owned_partitions gauge (the partitions it adopted and
// holds) counts as many as the bucket names it for. A claim is written
// before its adoption, and a renewal may be an hour away (a test's long
// lease), so the entry alone does not say that its node serves.
func heldAll(t testing.TB, tn *testNode, shards map[int]shardEntry) bool {
	t.Helper()
	named := 0
	for _, e := range shards {
		if e.Node == tn.id {
			named++
		}
	}
	return int(metricValue(t, tn, "limitmesh_owned_partitions")) == named
}

// serves reports whether tn serves partition p as an operator sees it:
// the shards bucket names tn for p, and tn holds every partition the
// bucket names it for (heldAll).
func serves(t testing.TB, tn *testNode, p int) bool {
	t.Helper()
	shards := readShards(t, tn.nc)
	return shards[p].Node == tn.id && heldAll(t, tn, shards)
}

// epochOf returns the epoch partition p's entry says tn holds it in, 0
// when the entry names another node or none.
func epochOf(t testing.TB, tn *testNode, p int) uint64 {
	t.Helper()
	if e := readShard(t, tn.nc, p); e.Node == tn.id {
		return e.Epoch
	}
	return 0
}
