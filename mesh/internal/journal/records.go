package journal

import (
	"slices"
	"strings"
	"sync"

	"github.com/limitmesh/limitmesh/internal/bugs"
)

// The records: the latest journalled record of every key that is not in
// the state bucket yet (or is pinned, or an orphan), and each partition's
// generation on this node.
//
// Generations. Across nodes the fence does the work a per-key
// compare-and-swap would do. Within the node, a key's owner core may hold
// a record from before its partition was lost or handed over and taken
// back: every revision the journal returns carries the partition's
// generation (bumped whenever the partition is adopted, lost or released),
// and a write expecting a revision of an older generation is a conflict,
// so the core reloads (invariant J6 of docs/protocol.md).

// entry is the latest journalled record of a key.
type entry struct {
	val        []byte
	jseq       uint64 // the batch holding val
	firstDirty uint64 // the first batch not checkpointed (0: checkpointed)
	kvRev      uint64 // the key's revision in the state bucket, if kvKnown
	kvKnown    bool
	part       int
	// orphan: of a partition this node lost (or is adopting again); kept
	// in view for the partition's next owner until it is seen to own it.
	orphan bool
	// pin keeps the record above the mark (in view of a reader of this
	// journal) while its partition's claim is not renewed (renewed).
	pin bool
	// unseen: the write of val was answered as failed (its outcome was
	// unknown to its owner) and landed all the same. Its owner may have
	// read the key again before the landing and hold an older revision:
	// J14 refuses a write over val only while the entry is in view, so it
	// is not forgotten when idle as others are (checkpoint.go,
	// advanceMark), until a later write of the key commits.
	unseen  bool
	touched int64 // unix ns of the last write or read
}

// records holds the entries and the partitions' states. Its methods are
// safe for concurrent use.
type records struct {
	mu      sync.Mutex
	entries map[string]*entry
	gen     []uint64 // per partition
	// owned[p]: this node adopted p and has not lost or released it
	// since. Loads and writes of p's keys fail otherwise (invariant J5): a
	// key's runner still busy when p was lost would reload the key and
	// journal decisions of a partition another node owns.
	owned []bool
	// epoch[p]: the epoch of the claim p's latest adoption served (the
	// claim's revision, O2); a fence of p in a later epoch ends the
	// tenure (fenced).
	epoch []uint64
	// unrenewed[p]: this node claimed p and has not renewed the claim yet.
	unrenewed []bool
	// inherited[p]: this node's journal may hold records of p from an
	// earlier incarnation of the node (above the mark it started with,
	// inheritedMark), which this incarnation has not adopted and no other
	// node is known to own since. The mark stays at or below
	// inheritedMark while any is (invariant J3).
	inherited     []bool
	inheritedMark uint64
}

func newRecords(parts int) *records {
	return &records{entries: make(map[string]*entry), gen: make([]uint64, parts),
		owned: make([]bool, parts), epoch: make([]uint64, parts), unrenewed: make([]bool, parts), inherited: make([]bool, parts)}
}

// inherit marks every partition's records as possibly in this node's
// journal above mark, from an earlier incarnation (a restart with the same
// id): none of them is checkpointed by this incarnation, which never read
// them, so the mark holds until each partition is adopted or owned
// elsewhere.
func (r *records) inherit(mark uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.inheritedMark = mark
	for p := range r.inherited {
		r.inherited[p] = true
	}
}

// settled reports that partition p's inherited records are another
// node's or this incarnation's now.
func (r *records) settled(p int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.inherited[p] = false
}

// lookup returns the journalled record of key (in partition p) when it is
// not checkpointed yet, the partition's generation, and whether p is held.
func (r *records) lookup(key string, p int, now int64) (val []byte, jseq, gen uint64, hit, owned bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.owned[p] {
		return nil, 0, 0, false, false
	}
	gen = r.gen[p]
	if e := r.entries[key]; e != nil && !e.orphan && e.firstDirty != 0 {
		e.touched = now
		return e.val, e.jseq, gen, true, true
	}
	return nil, 0, gen, false, true
}

// prepare checks a write of key (partition p) expecting revision rev: it
// returns the partition's generation, whether the key has a journalled
// record here, and whether p is held.
func (r *records) prepare(key string, p int) (gen uint64, known, owned bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.owned[p] {
		return 0, false, false
	}
	e := r.entries[key]
	return r.gen[p], e != nil && !e.orphan, true
}

// superseded reports whether a write of key expecting revision expect
// (tagged, not 0) would replace a record the writer did not see: a later
// batch than the one expect names holds key (a write whose outcome was
// unknown to its owner, and that landed after the owner read the key
// again), or, for a bucket revision, the key has a journalled record not
// checkpointed yet, or one checkpointed at a later bucket revision than
// expect (either way the owner read the bucket before that record was
// journalled: a checkpoint that ran meanwhile does not make the owner's
// read any newer). An entry this node does not hold cannot tell: false
// (invariant J14).
func (r *records) superseded(key string, expect uint64) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.supersededLocked(key, expect)
}

// stale reports whether write x is a conflict when its batch is taken: of
// an older generation of its partition (J6), or expecting a record a later
// commit of its key replaced (J14). One lock for both checks.
func (r *records) stale(x *write) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return x.gen != r.gen[x.part] || x.expect != 0 && r.supersededLocked(x.key, x.expect)
}

// supersededLocked is superseded with r.mu held.
func (r *records) supersededLocked(key string, expect uint64) bool {
	e := r.entries[key]
	if e == nil || e.orphan || bugs.Planted(bugs.ExpectedRecord) {
		return false
	}
	if expect&journalRevBit != 0 {
		return e.jseq > expect&revSeqMask
	}
	return e.firstDirty != 0 || e.kvKnown && expect&revSeqMask < e.kvRev
}

// genOf returns partition p's generation.
func (r *records) genOf(p int) uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.gen[p]
}

// commit records the writes of a batch committed at seq.
func (r *records) commit(batch []*write, seq uint64, now int64) (n int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, w := range batch {
		if w.fence != nil || w.barrier {
			continue
		}
		n++
		e := r.entries[w.key]
		if e == nil || e.orphan {
			e = &entry{part: w.part, kvRev: w.kvRev, kvKnown: w.kvKnown}
			r.entries[w.key] = e
		}
		e.val, e.jseq, e.touched = w.val, seq, now
		e.unseen = w.failed
		if e.firstDirty == 0 {
			e.firstDirty = seq
		}
		if r.unrenewed[w.part] {
			e.pin = true
		}
		// A write that was in flight while its partition changed hands:
		// committed, but the partition's next owner has it (or will, from
		// the journal); keep it for the mark only.
		e.orphan = w.gen != r.gen[w.part]
	}
	return n
}

// dirty lists the records to checkpoint: of partition part, or (part < 0)
// of every partition served (serving).
func (r *records) dirty(part int, serving func(int) bool) []todo {
	r.mu.Lock()
	defer r.mu.Unlock()
	var list []todo
	for k, e := range r.entries {
		if e.firstDirty == 0 || e.orphan || (part >= 0 && e.part != part) || (part < 0 && !serving(e.part)) {
			continue
		}
		list = append(list, todo{k, e, e.val, e.jseq, e.kvRev, e.kvKnown, r.gen[e.part]})
	}
	// In key order: the writes go out in an order that does not depend on
	// the map's (a schedule of the simulation replays exactly).
	slices.SortFunc(list, func(a, b todo) int { return strings.Compare(a.key, b.key) })
	return list
}

// todo is a record to checkpoint.
type todo struct {
	key   string
	e     *entry
	val   []byte
	jseq  uint64
	rev   uint64
	known bool
	gen   uint64 // its partition's generation
}

// checkpointed records the outcome of t's write to the bucket (at rev);
// keep: the record stays dirty all the same (its partition's
// open-reservation index, as of it, is not written: J17).
func (r *records) checkpointed(t todo, rev uint64, err error, keep bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err != nil {
		t.e.kvKnown = false
		return
	}
	t.e.kvRev, t.e.kvKnown = rev, true
	switch {
	case keep:
	case t.e.jseq == t.jseq:
		t.e.firstDirty = 0
	default:
		t.e.firstDirty = t.jseq + 1
	}
}

// markLimit returns how far this node's journal may be marked checkpointed
// (at most last): below every record not checkpointed and every pinned
// one (invariant J3). It also forgets checkpointed records untouched since
// idle (unix ns), and those whose owner has not seen them (unseen, J14)
// untouched since idleUnseen.
func (r *records) markLimit(last uint64, idle, idleUnseen int64) uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	m := last
	if slices.Contains(r.inherited, true) {
		m = min(m, r.inheritedMark)
	}
	for k, e := range r.entries {
		switch {
		case e.firstDirty != 0:
			m = min(m, e.firstDirty-1)
		case e.pin:
			m = min(m, e.jseq-1)
		case e.touched < idle && (!e.unseen || e.touched < idleUnseen):
			delete(r.entries, k)
		}
	}
	return m
}

// releasing stops p's loads and writes before its release (drained and
// flushed already) and counts its orphans.
func (r *records) releasing(p int) (orphans int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.owned[p] = false
	for _, e := range r.entries {
		if e.part == p && e.orphan {
			orphans++
		}
	}
	return orphans
}

// released ends p's tenure after its release's checkpoint (failed: err).
// A record that could not be checkpointed, or that is pinned, stays in view
// as an orphan: if the entry's delete fails, the entry still names the
// claim's sources, and the next claimer reads them.
func (r *records) released(p int, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.gen[p]++
	r.unrenewed[p] = false
	for k, e := range r.entries {
		if e.part != p {
			continue
		}
		if err == nil && e.firstDirty == 0 && !e.pin {
			delete(r.entries, k)
		} else {
			e.orphan = true
		}
	}
}

// lose keeps p's records as orphans: the next owner reads them from the
// journal, and the mark does not pass them until then.
func (r *records) lose(p int) (kept, dropped int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.gen[p]++
	r.owned[p] = false
	for k, e := range r.entries {
		if e.part != p {
			continue
		}
		if e.firstDirty == 0 && !e.pin {
			delete(r.entries, k)
			dropped++
		} else {
			e.orphan = true
			kept++
		}
	}
	return kept, dropped
}

// fenced ends p's tenure at once when this node's writer read a fence of
// p in an epoch above the tenure's (another node claimed p since): a new
// generation, so the writes of p still queued behind the append whose
// resync read the fence are conflicts when their batch is taken, and p is
// no longer held, so no later write or load of its keys is accepted
// (J5, J6). Those writes would otherwise go out in the next batch,
// expecting the fence's sequence or a later one, and commit after the
// fence, unseen by the new owner, which read this journal up to the fence
// (invariant J1). The loss (lose) still follows, from the ownership
// runner.
func (r *records) fenced(p int, epoch uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.owned[p] || epoch <= r.epoch[p] {
		return
	}
	r.gen[p]++
	r.owned[p] = false
}

// renewed unpins p's records: the claim is renewed (its adoption done, its
// entry no longer names the claim's sources), so the partition's next
// claimer reads this node's journal alone (invariant J4).
func (r *records) renewed(p int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.unrenewed[p] {
		return
	}
	r.unrenewed[p] = false
	for _, e := range r.entries {
		if e.part == p && !e.orphan {
			e.pin = false
		}
	}
}

// held returns the records of partition p this node holds in memory (not
// orphans), when it holds p.
func (r *records) held(p int) map[string][]byte {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make(map[string][]byte)
	if !r.owned[p] {
		return out
	}
	for k, e := range r.entries {
		if e.part == p && !e.orphan {
			out[k] = e.val
		}
	}
	return out
}

// dropOrphans forgets p's orphans.
func (r *records) dropOrphans(p int) (n int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for k, e := range r.entries {
		if e.part == p && e.orphan {
			delete(r.entries, k)
			n++
		}
	}
	return n
}

// adopting starts an adoption of p, claimed in epoch: a new generation,
// not served, claim not renewed; this node's own records of p become
// orphans, which hold the mark (so its journal is not purged under the
// adoption's reads) until the adopted records replace them.
func (r *records) adopting(p int, epoch uint64) (gen uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.gen[p]++
	r.epoch[p] = epoch
	r.unrenewed[p] = true
	r.owned[p] = false
	for _, e := range r.entries {
		if e.part == p {
			e.orphan = true
		}
	}
	return r.gen[p]
}

// adopted ends an adoption of p in generation gen: p is held unless its
// generation moved on meanwhile (lost again).
func (r *records) adopted(p int, gen uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.owned[p] = gen == r.gen[p]
	if r.owned[p] {
		r.inherited[p] = false
	}
}
