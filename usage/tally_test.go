package usage

import (
	"testing"
	"time"

	"github.com/cockroachdb/apd/v3"
	"github.com/limitmesh/limitmesh/internal/wire"
)

// TestTally: a tally counts a journalled record once, whichever message
// brings it and however often (the ledger's watermark rule), and an
// ordinary record once per stream message.
func TestTally(t *testing.T) {
	at := time.Date(2026, 12, 5, 10, 0, 0, 0, time.UTC).UnixMicro()
	rec := func(id string, cost int64) Record {
		return Record{ID: id, TimeUs: at, Key: "p.x.k=1", Descriptor: desc(t, "k", "1"), Revision: 1, Allowed: true, Cost: cost}
	}
	j := func(jseq uint64, idx uint32) string { return JournalID("n1", "b1", jseq, idx) }
	msg := func(batch string, recs ...Record) *Batch {
		b, err := DecodeBatch(EncodeGrouped("n1", "x", batch, recs))
		if err != nil {
			t.Fatal(err)
		}
		return &b
	}
	tl := NewTally()
	steps := []struct {
		b              *Batch
		counted, dup   int
		allowed, units int64
	}{
		{msg("a", rec(j(5, 0), 1e6), rec(j(5, 1), 2e6)), 2, 0, 2, 3e6},
		// Published again by the next owner, with one new record.
		{msg("b", rec(j(5, 1), 2e6), rec(j(6, 0), 1e6)), 1, 1, 3, 4e6},
		// An older position after a newer one counted: skipped.
		{msg("c", rec(j(4, 9), 5e6)), 0, 1, 3, 4e6},
		// Ordinary records count once per message.
		{msg("d", rec("n1.b1.x.7.0", 1e6)), 1, 0, 4, 5e6},
	}
	for i, s := range steps {
		counted, dup := tl.Apply(uint64(i+1), s.b)
		if counted != s.counted || dup != s.dup {
			t.Fatalf("step %d: counted %d, dup %d; want %d, %d", i, counted, dup, s.counted, s.dup)
		}
		for _, per := range []string{"2026-12", "2026-12-05"} {
			tot, ok := tl.Totals("x", per, "p.x.k=1")
			if !ok || tot.Allowed != s.allowed || tot.AllowedUnits.Cmp(apd.New(s.units, -6)) != 0 {
				t.Fatalf("step %d, %s: %+v (%v); want allowed %d, units %s", i, per, tot, ok, s.allowed, wire.FormatUnits(s.units))
			}
		}
	}
	if _, ok := tl.Totals("x", "2026-11", "p.x.k=1"); ok {
		t.Fatal("a period no record counted in has totals")
	}
}
