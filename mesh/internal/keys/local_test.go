package keys

import (
	"errors"
	"testing"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/fail"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
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
			if c.Err != nil {
				t.Fatalf("call %d: %v", i, c.Err)
			}
			if c.Out.Allowed {
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
	if !c.Out.Allowed || nodeA.len() != 2 {
		t.Fatalf("second key: %+v, %d keys", c.Out, nodeA.len())
	}
	// Full: a third key is refused while the others are not at rest (the
	// bucket refills from empty in 0.4 s).
	c = newCall(p, 1, now+sec)
	nodeA.decide(env, "k3", c, now+sec/10)
	if !errors.Is(c.Err, fail.ErrUnavailable) {
		t.Fatalf("full table: %v, want fail.ErrUnavailable", c.Err)
	}
	// Sweeping before rest keeps them; at rest they go.
	nodeA.sweep(now + restSpan(p) - 1)
	if nodeA.len() != 2 {
		t.Fatalf("swept keys not at rest: %d left", nodeA.len())
	}
	c = newCall(p, 1, now+3*sec)
	nodeA.decide(env, "k3", c, now+restSpan(p)+sec)
	if c.Err != nil || !c.Out.Allowed || nodeA.len() != 1 {
		t.Fatalf("after the forced sweep: %v %+v, %d keys", c.Err, c.Out, nodeA.len())
	}
	// A remembered request_id keeps a key until keyrec.DedupeWindow.
	d := withID(newCall(p, 1, now+sec), "r1")
	nodeB.decide(env, "k", d, now+sec)
	again := withID(newCall(p, 1, now+sec), "r1")
	nodeB.decide(env, "k", again, now+sec)
	if !again.Deduped || again.Out != d.Out {
		t.Fatalf("retry not deduped: %+v", again)
	}
	nodeB.sweep(now + sec + restSpan(p))
	if nodeB.len() != 1 {
		t.Fatal("a key with a live request_id was evicted")
	}
	nodeB.sweep(now + sec + keyrec.DedupeWindow)
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
	// 1/h is exact (one unit per hour), so 2 units take 2 h.
	if got := restSpan(w); got != 2*3600*kvstate.Second {
		t.Fatalf("restSpan = %d, want 2 h", got)
	}
	q := mustParse(t, `{"match":{},"limits":[{"algorithm":"quota","limit":5,"period":"day"}]}`)
	if got := restSpan(q); got < 24*3600*kvstate.Second {
		t.Fatalf("restSpan of a daily quota = %d, want at least a day", got)
	}
}
