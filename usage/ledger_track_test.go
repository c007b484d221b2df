package usage

import (
	"context"
	"fmt"
	"testing"
	"time"
	"unsafe"
)

// The keys the reconciler tracks for comparison (kept up to an hour) own
// their strings: a decoded message's keys share the whole message, which
// a tracked key must not keep alive. Two messages with the same keys,
// applied in one group, the second later: no tracked key shares the bytes
// of either message's records.
func TestTrackedKeysOwnTheirStrings(t *testing.T) {
	t0 := time.Date(2026, 12, 3, 10, 0, 0, 0, time.UTC).UnixMicro()
	var batches []Batch
	for m := range 2 {
		b := Batch{Node: "n1", Policy: "acme"}
		for k := range 3 {
			r := ledgerRecord(t, "acme", k, t0+int64(m*1000+k), 1, true)
			r.ID = fmt.Sprintf("n1.b%d.%d", m, k)
			b.Records = append(b.Records, r)
		}
		d, err := DecodeBatch(appendBatch(nil, &b))
		if err != nil {
			t.Fatal(err)
		}
		batches = append(batches, d)
	}
	c := newLedgerCore()
	for i := range batches {
		c.missing(&batches[i], func(id entryID) { c.hold(id, 0, Totals{}) }, func(o string) { c.holdOrigin(o, 0, nil) })
		c.apply(uint64(i+1), &batches[i])
	}
	r := &Reconciler{tracked: map[policyKey]*trackedKey{}, cfg: ReconcilerConfig{
		QuotaLimits: func(string) []QuotaLimit { return nil },
		QuotaState: func(context.Context, string, string, time.Time) (map[string]int64, bool, error) {
			return nil, false, nil
		},
	}}
	s := &session{r: r, core: c}
	s.track()
	if len(r.tracked) != 3 {
		t.Fatalf("%d keys tracked, want 3", len(r.tracked))
	}
	for pk := range r.tracked {
		for m, b := range batches {
			shares := unsafe.StringData(pk.policy) == unsafe.StringData(b.Policy)
			for _, rec := range b.Records {
				shares = shares || unsafe.StringData(pk.key) == unsafe.StringData(rec.Key)
			}
			if shares {
				t.Errorf("tracked key %s shares message %d's strings", pk.key, m+1)
			}
		}
	}
}
