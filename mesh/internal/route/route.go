// Package route is the node's routing table: which partitions of the key
// space this node serves now, in which epoch, and how many of their calls
// are in flight here. Every decide request reads it; the ownership runner
// (through the node's member) writes it.
//
// route imports rt only.
package route

import (
	"strconv"
	"sync/atomic"
	"time"

	"github.com/limitmesh/limitmesh/mesh/internal/rt"
)

// Slot is the routing state of one partition.
type Slot struct {
	until    atomic.Int64  // serving until this monotonic instant (ns); 0: not serving
	epoch    atomic.Uint64 // epoch while held
	Inflight atomic.Int64  // local calls of the partition not yet answered
}

// Table is a node's routing table. Its methods are safe for concurrent use.
type Table struct {
	parts    int
	base     time.Time
	rt       rt.Runtime
	slots    []Slot
	subjects []string // <prefix>.v1.shard.<n>
}

// New returns a table of parts partitions, none served; base is the
// origin of the monotonic clock shared with the ownership runner.
func New(prefix string, parts int, r rt.Runtime, base time.Time) *Table {
	t := &Table{parts: parts, base: base, rt: r, slots: make([]Slot, parts), subjects: make([]string, parts)}
	for n := range parts {
		t.subjects[n] = prefix + ".v1.shard." + strconv.Itoa(n)
	}
	return t
}

// Base returns the origin of the table's monotonic clock.
func (t *Table) Base() time.Time { return t.base }

// Parts returns the partition count.
func (t *Table) Parts() int { return t.parts }

// Mono is the table's monotonic clock (ns since base, > 0).
func (t *Table) Mono() int64 { return t.MonoAt(t.rt.Now()) }

// MonoAt is Mono at t0 (a reading of the same Runtime).
func (t *Table) MonoAt(t0 time.Time) int64 { return int64(t0.Sub(t.base)) + 1 }

// Serving reports whether this node decides partition p now.
func (t *Table) Serving(p int) bool { return t.Mono() < t.slots[p].until.Load() }

// ServingAt is Serving at the monotonic instant mono.
func (t *Table) ServingAt(p int, mono int64) bool { return mono < t.slots[p].until.Load() }

// Epoch returns the epoch in which p is held (0 when it is not served).
func (t *Table) Epoch(p int) uint64 {
	if !t.Serving(p) {
		return 0
	}
	return t.slots[p].epoch.Load()
}

// EpochOf returns the epoch p was last held in, served now or not.
func (t *Table) EpochOf(p int) uint64 { return t.slots[p].epoch.Load() }

// Slot returns partition p's slot.
func (t *Table) Slot(p int) *Slot { return &t.slots[p] }

// Subject returns <prefix>.v1.shard.<p>.
func (t *Table) Subject(p int) string { return t.subjects[p] }

// Set makes p served in epoch until the monotonic instant until.
func (t *Table) Set(p int, epoch uint64, until int64) {
	t.slots[p].epoch.Store(epoch)
	t.slots[p].until.Store(until)
}

// Clear stops serving p at once.
func (t *Table) Clear(p int) { t.slots[p].until.Store(0) }

// Owned counts the partitions served now.
func (t *Table) Owned() int {
	k := 0
	for p := range t.slots {
		if t.Serving(p) {
			k++
		}
	}
	return k
}
