// Package bugs holds switches that plant known bugs in the mesh's
// protocol code, for tests only. A test plants one and checks that the
// deterministic simulation (mesh/internal/sim) reports a violation: the
// mechanism the bug disables is then shown to be checked, not only
// believed. Production code reads the switches (one guard each, at the
// mechanism it disables) and never plants one; reading one is a load of a
// global array element.
//
// Not safe for concurrent use with a running mesh: a test plants a bug
// before its runs start and undoes it after they end, and no two tests
// that plant bugs run at once. Imports nothing.
package bugs

// Bug names a mechanism a planted bug disables.
type Bug int

const (
	// SelfFence: an owner serves a partition long after its lease
	// lapsed (ownership, O1: it stops 2/3 of a lease after its last
	// renewal's send).
	SelfFence Bug = iota
	// JournalFence: a claimer reads another node's journal up to its last
	// message as a read reports it, without appending a fence, so the old
	// owner's later appends still commit (journal, J1).
	JournalFence
	// AdoptBeforeServe: a claimer serves a partition at once and adopts
	// its sources' records meanwhile (journal, J1: it serves only once
	// they are adopted).
	AdoptBeforeServe
	// ExpectedRecord: a write expecting a record that a commit it did not
	// see replaced is not a conflict (journal, J14).
	ExpectedRecord
	// LedgerWatermark: the ledger counts a journalled record at or below
	// its origin's watermark (usage.ledgerCore's rule, I6: a record
	// published again is skipped).
	LedgerWatermark
	// StaleEpochReport: an owner applies a report or return of a grant
	// made in an epoch older than its own (lease, L2: it refuses it).
	StaleEpochReport
	// RefundSpent: a return refunds a grant's whole units, the spent ones
	// too (lease, L2: it refunds units − spent).
	RefundSpent

	count
)

// planted holds the switches; all false outside tests.
var planted [count]bool

// Planted reports whether b is planted.
func Planted(b Bug) bool { return planted[b] }

// Plant plants b until undo is called. For tests only.
func Plant(b Bug) (undo func()) {
	planted[b] = true
	return func() { planted[b] = false }
}

// Parse returns the bug String names name.
func Parse(name string) (Bug, bool) {
	for b := range count {
		if b.String() == name {
			return b, true
		}
	}
	return 0, false
}

// String names b.
func (b Bug) String() string {
	switch b {
	case SelfFence:
		return "SelfFence"
	case JournalFence:
		return "JournalFence"
	case AdoptBeforeServe:
		return "AdoptBeforeServe"
	case ExpectedRecord:
		return "ExpectedRecord"
	case LedgerWatermark:
		return "LedgerWatermark"
	case StaleEpochReport:
		return "StaleEpochReport"
	case RefundSpent:
		return "RefundSpent"
	}
	return "Bug(?)"
}
