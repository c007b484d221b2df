package shadow

import (
	"errors"
	"testing"
)

func isCorrupt(err error) bool { return errors.Is(err, ErrCorrupt) }

// FuzzRestore: Restore never panics; it restores or fails with ErrCorrupt,
// and what it restores encodes and restores again to the same summaries.
func FuzzRestore(f *testing.F) {
	p := mustPolicy(f, "a", 1, acmeV2)
	r := NewReplay(Options{})
	r.SetCandidates([]*policyT{p})
	for i := int64(0); i < 6; i++ {
		x := rec(desc(f, "tenant", "acme", "operation", "search"), i*300_000, 1, i%2 == 0)
		r.Apply(&x)
	}
	f.Add(appendCheckpoint(nil, 3, r))
	f.Add([]byte("LMSC\x01\x00\x00"))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		n := NewReplay(Options{})
		n.SetCandidates([]*policyT{p})
		if _, err := n.Restore(b); err != nil {
			if !isCorrupt(err) {
				t.Fatalf("error %v does not match ErrCorrupt", err)
			}
			return
		}
		m := NewReplay(Options{})
		m.SetCandidates([]*policyT{p})
		if _, err := m.Restore(appendCheckpoint(nil, 1, n)); err != nil {
			t.Fatalf("re-encoded checkpoint: %v", err)
		}
		x := rec(desc(t, "tenant", "acme", "operation", "search"), 0, 1, true)
		n.Apply(&x)
		m.Apply(&x)
		a, _ := n.Summary("a")
		c, _ := m.Summary("a")
		if a.Evaluated != c.Evaluated || a.WouldDeny != c.WouldDeny {
			t.Fatalf("restored twice: %+v vs %+v", a, c)
		}
	})
}
