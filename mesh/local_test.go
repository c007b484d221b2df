package mesh

import (
	"errors"
	"testing"

	"github.com/limitmesh/limitmesh/kvstate"
)

// TestLocalTable: local keys decide from memory alone, each key and each
// table (node) with the whole burst; keys are evicted only at rest; a full
// table answers 503 for a new key.
func TestLocalTable(t *testing.T) {
	p := tbPolicy(t, "p", 1, "10/s", 4, `,"mode":"local"`)
	env := newFakeEnv(p)
	nodeA, nodeB := newLocalTable(2), newLocalTable(2)
	now := int64(100 * sec)
	admitted := 0
	for i := range 10 {
		for _, tbl := range []*localTable{nodeA, nodeB} {
			c := newCall(p, 1, now+sec)
			tbl.decide(env, "k", c, now)
			if c.err != nil {
				t.Fatalf("call %d: %v", i, c.err)
			}
			if c.out.Allowed {
				admitted++
			}
		}
	}
	if admitted != 8 {
		t.Fatalf("two nodes admitted %d, want 2 × burst = 8", admitted)
	}
	// Another key has its own bucket.
	c := newCall(p, 1, now+sec)
	nodeA.decide(env, "k2", c, now)
	if !c.out.Allowed || nodeA.len() != 2 {
		t.Fatalf("second key: %+v, %d keys", c.out, nodeA.len())
	}
	// Full: a third key is refused while the others are not at rest (the
	// bucket refills from empty in 0.4 s).
	c = newCall(p, 1, now+sec)
	nodeA.decide(env, "k3", c, now+sec/10)
	if !errors.Is(c.err, ErrUnavailable) {
		t.Fatalf("full table: %v, want ErrUnavailable", c.err)
	}
	// Sweeping before rest keeps them; at rest they go.
	nodeA.sweep(now + restSpan(p) - 1)
	if nodeA.len() != 2 {
		t.Fatalf("swept keys not at rest: %d left", nodeA.len())
	}
	c = newCall(p, 1, now+3*sec)
	nodeA.decide(env, "k3", c, now+restSpan(p)+sec)
	if c.err != nil || !c.out.Allowed || nodeA.len() != 1 {
		t.Fatalf("after the forced sweep: %v %+v, %d keys", c.err, c.out, nodeA.len())
	}
	// A remembered request_id keeps a key until DedupeWindow.
	d := withID(newCall(p, 1, now+sec), "r1")
	nodeB.decide(env, "k", d, now+sec)
	again := withID(newCall(p, 1, now+sec), "r1")
	nodeB.decide(env, "k", again, now+sec)
	if !again.deduped || again.out != d.out {
		t.Fatalf("retry not deduped: %+v", again)
	}
	nodeB.sweep(now + sec + restSpan(p))
	if nodeB.len() != 1 {
		t.Fatal("a key with a live request_id was evicted")
	}
	nodeB.sweep(now + sec + DedupeWindow)
	if nodeB.len() != 0 {
		t.Fatal("a key at rest was kept")
	}
}

func TestRestSpan(t *testing.T) {
	p := tbPolicy(t, "p", 1, "3/s", 1, "")
	if got := restSpan(p); got != 333_333_334 {
		t.Fatalf("restSpan(burst 1, 3/s) = %d ns, want 333333334 (rounded up)", got)
	}
	w := mustParse(t, `{"match":{},"limits":[{"algorithm":"token_bucket","rate":"1/h","burst":2},{"algorithm":"sliding_window","limit":5,"window":"1m"}]}`)
	// 1/h is 277 micro-units/s in fixed point (rounded down), so 2 units
	// take a little over 2 h.
	if got := restSpan(w); got < 2*3600*kvstate.Second || got > 2*3600*kvstate.Second+30*kvstate.Second {
		t.Fatalf("restSpan = %d, want just over 2 h", got)
	}
	if got := ceilDiv(1<<62, 1, 1<<62); got != 1<<63-1 {
		t.Fatalf("ceilDiv does not saturate: %d", got)
	}
}
