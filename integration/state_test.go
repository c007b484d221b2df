package integration

import (
	"context"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/mesh"
)

// TestDeniedKeyKeepsState: a key that sees only denied traffic for several
// state TTLs gets no fresh burst (its state is not at rest: it is kept;
// see retention_test.go for idle keys).
func TestDeniedKeyKeepsState(t *testing.T) {
	e := server(t, t.TempDir())
	tn := startNode(t, e, mesh.NodeConfig{StateTTL: time.Second})
	rev := putPolicy(t, tn.nc, "rl_policies", "slow", slowPolicy)
	waitRevision(t, tn.nc, map[string]string{"tenant": "probe"}, rev)
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
