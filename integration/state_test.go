package integration

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/mesh"
	"github.com/nats-io/nats.go/jetstream"
)

// TestIdleStateExpires: a key with no traffic for the state TTL is removed
// from the bucket and starts full again; denied traffic keeps it alive.
func TestIdleStateExpires(t *testing.T) {
	e := server(t, t.TempDir())
	tn := startNode(t, e, mesh.NodeConfig{StateTTL: time.Second})
	rev := putPolicy(t, tn.nc, "rl_policies", "slow", slowPolicy)
	waitRevision(t, tn.nc, map[string]string{"tenant": "probe"}, rev)
	js, _ := jetstream.New(tn.nc)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	kv, err := js.KeyValue(ctx, "rl_state")
	if err != nil {
		t.Fatal(err)
	}

	// Denied traffic for three TTLs keeps the state (no fresh burst).
	alive := map[string]string{"tenant": "alive"}
	if r := decide(t, tn.nc, "rl.v1.decide", req(alive, `"cost":40`)); !r.Allowed {
		t.Fatalf("burst: %+v", r)
	}
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for end := time.Now().Add(3 * time.Second); time.Now().Before(end); <-tick.C {
		if r := decide(t, tn.nc, "rl.v1.decide", req(alive, "")); r.Allowed {
			t.Fatalf("a denied-only key got a fresh burst: %+v", r)
		}
	}

	// An idle key disappears from the bucket and starts full.
	idle := map[string]string{"tenant": "idle"}
	if r := decide(t, tn.nc, "rl.v1.decide", req(idle, `"cost":40`)); !r.Allowed {
		t.Fatalf("burst: %+v", r)
	}
	keys := func() int {
		lister, err := kv.ListKeys(ctx)
		if err != nil {
			if errors.Is(err, jetstream.ErrNoKeysFound) {
				return 0
			}
			t.Fatal(err)
		}
		n := 0
		for k := range lister.Keys() {
			if k == "p.slow.tenant=idle" {
				n++
			}
		}
		return n
	}
	// The record reaches the bucket (journalled first, checkpointed within
	// a quarter of the TTL), then expires from it.
	waitFor(t, "idle key checkpointed to the bucket", func() bool { return keys() == 1 })
	waitFor(t, "idle key expired from the bucket", func() bool { return keys() == 0 })
	if r := decide(t, tn.nc, "rl.v1.decide", req(idle, "")); !r.Allowed || r.Remaining < 39 || r.Remaining >= 39.01 {
		t.Fatalf("after expiry: %+v, want a fresh key (39 left)", r)
	}
}

// TestTransitionFromHistory: a policy changed while no node ran; the
// restarted node finds the old version in the bucket history and maps the
// stored state by limit name (§28), not by position.
func TestTransitionFromHistory(t *testing.T) {
	e := server(t, t.TempDir())
	admin := connect(t, e)
	nc, err := e.Connect()
	if err != nil {
		t.Fatal(err)
	}
	n := startOwnNode(t, nc)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	v1 := putPolicy(t, admin, "rl_policies", "tr", `{"match":{"tenant":"*"},"limits":[
		{"name":"a","algorithm":"token_bucket","rate":"1/h","burst":40}]}`)
	d := map[string]string{"tenant": "t"}
	waitRevision(t, nc, d, v1)
	if r := decide(t, nc, "rl.v1.decide", req(d, `"cost":30`)); !r.Allowed {
		t.Fatalf("spend 30: %+v", r)
	}
	if err := n.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	nc.Close()
	v2 := putPolicy(t, admin, "rl_policies", "tr", `{"match":{"tenant":"*"},"limits":[
		{"name":"b","algorithm":"fixed_window","limit":100,"window":"1h"},
		{"name":"a","algorithm":"token_bucket","rate":"1/h","burst":40}]}`)

	tn := startNode(t, e, mesh.NodeConfig{})
	r := decide(t, tn.nc, "rl.v1.decide", req(d, ""))
	// By name: "a" keeps its 10 left, then spends 1. (By position the
	// token-bucket state would not fit "b" and both would start fresh.)
	if !r.Allowed || r.Revision != v2 || r.Remaining < 9 || r.Remaining >= 9.01 {
		t.Fatalf("after the change: %+v, want allowed at rev %d with 9 left", r, v2)
	}
}
