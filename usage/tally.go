package usage

// Tally applies usage messages to ledger totals by the reconciler's own
// rule (ledgerCore: exactly once per journalled record by its origin's
// watermark, once per stream message otherwise), in memory and without a
// store: every entry and watermark starts empty. The deterministic
// simulation (mesh/internal/sim) counts its usage stream with it, so the
// rule it checks is the ledger's, not a model of it.
type Tally struct{ c *ledgerCore }

// NewTally returns an empty tally.
func NewTally() *Tally { return &Tally{c: newLedgerCore()} }

// Apply applies stream message seq (greater than every earlier one's),
// holding b, and returns how many of its records counted and how many
// were skipped as counted before.
func (t *Tally) Apply(seq uint64, b *Batch) (counted, dup int) {
	t.c.missing(b, func(id entryID) {
		if t.c.entries[id] == nil {
			t.c.hold(id, 0, Totals{})
		}
	}, func(origin string) {
		if t.c.origins[origin] == nil {
			t.c.holdOrigin(origin, 0, nil)
		}
	})
	counted, dup = t.c.apply(seq, b)
	t.c.written()
	return counted, dup
}

// Totals returns policy's totals of key in period (a UTC month, 2006-01,
// or day, 2006-01-02), and whether any record counted there.
func (t *Tally) Totals(policy, period, key string) (Totals, bool) {
	e := t.c.entries[entryID{policy, period, key}]
	if e == nil {
		return Totals{}, false
	}
	e.settle()
	return e.t, true
}

// Allowed returns the admissions counted for policy's key, over every
// month.
func (t *Tally) Allowed(policy, key string) int64 {
	var n int64
	for id, e := range t.c.entries {
		if id.policy == policy && id.key == key && len(id.period) == len(monthFormat) {
			n += e.t.Allowed
		}
	}
	return n
}
