package journal

import (
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
)

// The open-reservation index (invariant J17 of docs/protocol.md). A node
// sweeps the keys it owns whose records hold open reservations (their
// expiries end them); it learns of them from the records it writes, loads
// and adopts. A key whose record its old owner checkpointed (so it is not
// in the journals the new owner adopts from) and that no call touches
// again would never be known to the new owner. So the owner of a partition
// keeps an index of the partition's keys with open reservations, with
// their policy, count and first expiry, in the state bucket (key
// _open.<partition>):
//
//   - It is rebuilt in memory from what the owner sees of the partition's
//     records: the index it read after adopting the partition, the records
//     it adopted, every record a checkpoint writes and every record it
//     loads of a key the index names (a sweep of a key whose reservations
//     all ended writes nothing, but it loads the record: the key is
//     dropped). A record's version orders what is seen of a key.
//   - A checkpoint writes it (a compare-and-swap on a revision read or
//     written while the partition's lease holds, as a record: J9) when it
//     changed, and only then are the records that changed it checkpointed:
//     they stay dirty, so the mark does not pass them, until it is written
//     (J3).
//   - An adoption reads it once the sources' journals are read, from a
//     replica at or past the revisions of their marks as the reads found
//     them (an index write precedes the mark it covers) and the claim's
//     floor (J7), and tells the node (Config.OnReservations) of every key
//     it names whose record the adoption has not seen. A partition's index
//     is not written before it is read (the records stay dirty meanwhile).
//
// A deposed owner's late write of the index lands only before the new
// owner's first write (compare-and-swap), which replaces it. An index
// naming a key whose reservations have ended is harmless: the sweep finds
// nothing due (and drops the key). Encoding:
//
//	'O' 1 uvarint(p) p × (uvarint(len) policy)
//	uvarint(n) n × (uvarint(len) key, uvarint(policy index), uvarint(open), varint(first expiry, ns))
//
// keys in byte order. An index over maxOpenBytes keeps the keys that
// expire first; the others are swept by this node, and by a later owner
// only once a call or an adoption shows them.

const (
	openPrefix   = "_open."
	openFormat   = 1
	maxOpenBytes = 256 << 10
)

// openKey is the state bucket key of partition p's index.
func openKey(p int) string { return openPrefix + strconv.Itoa(p) }

// openEntry is what the index says of a key with open reservations.
type openEntry struct {
	policy string
	open   int
	next   int64  // ns: the first expiry
	ver    uint64 // the version of the record it was seen in (memory only)
}

func (e openEntry) same(o openEntry) bool {
	return e.policy == o.policy && e.open == o.open && e.next == o.next
}

// partOpen is one partition's index on this node, for one tenure.
type partOpen struct {
	gen   uint64 // the tenure (records' generation); 0: not held
	ready bool   // adopted: floor is final
	floor uint64 // the stored index is read at or past this revision
	// Until the stored index is read (loaded), what this tenure saw of
	// keys (nil: no open reservations) goes to pending; it overrides the
	// stored index's entries. Then keys is the index.
	loaded  bool
	pending map[string]*openEntry
	keys    map[string]openEntry
	waiters []func(error) // of the read in flight (loading)
	loading bool
	// rev is the stored index's revision read or written in this tenure
	// (revKnown); saved: the stored index is keys as of change count
	// changes.
	rev      uint64
	revKnown bool
	saved    bool
	changes  uint64
}

type openIndex struct {
	j *Journal

	mu    sync.Mutex
	parts []partOpen
}

func newOpenIndex(j *Journal) *openIndex {
	return &openIndex{j: j, parts: make([]partOpen, j.cfg.Parts)}
}

// reset starts partition p's index for the adoption of tenure gen.
func (x *openIndex) reset(p int, gen uint64) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.fail(p)
	x.parts[p] = partOpen{gen: gen, pending: make(map[string]*openEntry)}
}

// drop forgets partition p's index: this node no longer holds p.
func (x *openIndex) drop(p int) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.fail(p)
	x.parts[p] = partOpen{}
}

// fail ends the waiters of p's read in flight (x.mu held): their tenure
// ended.
func (x *openIndex) fail(p int) {
	for _, w := range x.parts[p].waiters {
		x.j.rt.Go(func() { w(errIndexTenure) })
	}
	x.parts[p].waiters = nil
}

var errIndexTenure = errors.New("the partition's tenure ended")

// adopted ends the adoption of p in tenure gen: records (the latest of
// each key the sources' journals hold) are seen, and the stored index is
// to be read at or past floor.
func (x *openIndex) adopted(p int, gen, floor uint64, records map[string][]byte) {
	seen := make(map[string]*openEntry, len(records))
	for k, v := range records {
		seen[k] = peekOpen(v)
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	po := &x.parts[p]
	if po.gen != gen || gen == 0 {
		return
	}
	for k, e := range seen {
		po.seeLocked(k, e)
	}
	po.ready, po.floor = true, floor
}

// peekOpen returns what record val says of its open reservations (nil:
// none, or no record).
func peekOpen(val []byte) *openEntry {
	policy, ver, open, next, ok := keyrec.PeekReservations(val)
	if !ok || open == 0 {
		if ok {
			return &openEntry{ver: ver} // open 0: none, at this version
		}
		return nil
	}
	return &openEntry{policy: policy, open: open, next: next, ver: ver}
}

// seeLocked records what a record of key says (e: nil or open 0 for no
// open reservations), unless an entry from a later record is there.
func (po *partOpen) seeLocked(key string, e *openEntry) {
	if !po.loaded {
		if old := po.pending[key]; old == nil || e == nil || e.ver >= old.ver {
			po.pending[key] = e
		}
		return
	}
	old, had := po.keys[key]
	if had && e != nil && e.ver < old.ver {
		return
	}
	switch {
	case e == nil || e.open == 0:
		if !had {
			return
		}
		delete(po.keys, key)
	case had && old.same(*e):
		po.keys[key] = *e
		return
	default:
		po.keys[key] = *e
	}
	po.saved = false
	po.changes++
}

// wants reports whether a load of key of p in tenure gen must be seen:
// before the stored index is read, or when it names the key.
func (x *openIndex) wants(p int, gen uint64, key string) bool {
	x.mu.Lock()
	defer x.mu.Unlock()
	po := &x.parts[p]
	if po.gen != gen || gen == 0 {
		return false
	}
	_, named := po.keys[key]
	return !po.loaded || named
}

// see records what a record of key (partition p, tenure gen) loaded or
// written by this node says (val nil: the key has no record).
func (x *openIndex) see(p int, gen uint64, key string, val []byte) {
	e := peekOpen(val)
	x.mu.Lock()
	defer x.mu.Unlock()
	if po := &x.parts[p]; po.gen == gen && gen != 0 {
		po.seeLocked(key, e)
	}
}

// indexTask is a partition whose index a checkpoint writes, in tenure
// gen (0: this node holds no index of it).
type indexTask struct {
	part int
	gen  uint64
}

// checkpointing sees the records a checkpoint writes and returns the
// partitions whose index the checkpoint must write: those of the records,
// and (part < 0: of every partition served; else part alone) those whose
// index changed since it was written.
func (x *openIndex) checkpointing(list []todo, part int, serving func(int) bool) []indexTask {
	seen := make([]*openEntry, len(list))
	for i, t := range list {
		seen[i] = peekOpen(t.val)
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	var parts []int
	for i, t := range list {
		if po := &x.parts[t.e.part]; po.gen == t.gen && t.gen != 0 {
			po.seeLocked(t.key, seen[i])
		}
		parts = append(parts, t.e.part)
	}
	for p := range x.parts {
		if po := &x.parts[p]; po.gen != 0 && po.ready && !po.saved && (part < 0 && serving(p) || p == part) {
			parts = append(parts, p)
		}
	}
	slices.Sort(parts)
	tasks := make([]indexTask, 0, len(parts))
	for _, p := range slices.Compact(parts) {
		tasks = append(tasks, indexTask{p, x.parts[p].gen})
	}
	return tasks
}

// load reads p's stored index in tenure gen unless it is read: from a
// replica at or past the adoption's floor and the claim's (J7). The
// entries of keys this tenure has not seen are told to OnReservations.
func (x *openIndex) load(p int, gen uint64, timeout time.Duration, done func(error)) {
	j := x.j
	x.mu.Lock()
	po := &x.parts[p]
	switch {
	case po.gen != gen:
		x.mu.Unlock()
		j.rt.Go(func() { done(errIndexTenure) })
		return
	case !po.ready:
		x.mu.Unlock()
		j.rt.Go(func() { done(errors.New("the partition's adoption has not ended")) })
		return
	case po.loaded:
		x.mu.Unlock()
		j.rt.Go(func() { done(nil) })
		return
	}
	po.waiters = append(po.waiters, done)
	if po.loading {
		x.mu.Unlock()
		return
	}
	po.loading = true
	floor := po.floor
	x.mu.Unlock()
	j.floors.getFrom(openKey(p), p, floor, timeout, func(val []byte, rev uint64, err error) {
		if errors.Is(err, kvstate.ErrNotFound) {
			val, err = nil, nil
		}
		var stored map[string]openEntry
		if err == nil {
			var derr error
			if stored, derr = decodeOpen(val); derr != nil {
				// Nothing in it can be trusted: it is rewritten whole.
				j.log.Warn("corrupt open-reservation index replaced", "partition", p, "error", derr.Error())
				stored = nil
			}
		}
		x.mu.Lock()
		po := &x.parts[p]
		if po.gen != gen {
			x.mu.Unlock()
			return // its waiters were failed
		}
		waiters := po.waiters
		po.waiters, po.loading = nil, false
		var tell map[string]openEntry
		if err == nil {
			tell = x.merge(po, stored, rev)
		}
		x.mu.Unlock()
		if err != nil {
			err = fmt.Errorf("reading the open-reservation index of partition %d: %w", p, err)
		}
		if f := j.cfg.OnReservations; f != nil {
			for _, k := range slices.Sorted(maps.Keys(tell)) {
				e := tell[k]
				f(e.policy, k, e.open, e.next)
			}
		}
		for _, w := range waiters {
			w(err)
		}
	})
}

// merge makes the stored index (at rev) p's, with what this tenure saw
// over it (x.mu held), and returns its entries this tenure has not seen.
func (x *openIndex) merge(po *partOpen, stored map[string]openEntry, rev uint64) map[string]openEntry {
	tell := make(map[string]openEntry)
	po.keys = make(map[string]openEntry, len(stored))
	for k, e := range stored {
		po.keys[k] = e
		if _, seen := po.pending[k]; !seen {
			tell[k] = e
		}
	}
	po.loaded, po.saved, po.rev, po.revKnown = true, true, rev, true
	for k, e := range po.pending {
		po.seeLocked(k, e)
	}
	po.pending = nil
	return tell
}

// save writes p's index (tenure gen) unless it is written, reading it
// first when it is not read; held reports whether this node still holds
// p's lease (J9).
func (x *openIndex) save(p int, gen uint64, held func() bool, timeout time.Duration, done func(error)) {
	j := x.j
	if gen == 0 {
		// A partition held without an adoption (generation 0: only a test
		// holds one so) keeps no index.
		j.rt.Go(func() { done(nil) })
		return
	}
	x.load(p, gen, timeout, func(err error) {
		if err != nil {
			done(err)
			return
		}
		x.mu.Lock()
		po := &x.parts[p]
		if po.gen != gen {
			x.mu.Unlock()
			done(errIndexTenure)
			return
		}
		if po.saved {
			x.mu.Unlock()
			done(nil)
			return
		}
		val, dropped := encodeOpen(po.keys)
		n, rev, known, empty := po.changes, po.rev, po.revKnown, len(po.keys) == 0
		x.mu.Unlock()
		if dropped > 0 {
			j.log.Warn("open-reservation index over its size: the keys expiring last are left out",
				"partition", p, "keys", dropped)
		}
		now := j.now().UnixNano()
		until := j.cfg.Retention.KeepUntil(0, now) // empty: as a record at rest
		if !empty {
			until = keyrec.Forever // as long as the records it names
		}
		ttl := func() time.Duration { return j.cfg.Retention.TTLAt(until, j.now().UnixNano()) }
		j.ck.writeKey(openKey(p), val, ttl, rev, known, held, func(nrev uint64, err error) {
			x.mu.Lock()
			if po := &x.parts[p]; po.gen == gen {
				po.rev, po.revKnown = nrev, err == nil
				if err == nil && po.changes == n {
					po.saved = true
				}
			}
			x.mu.Unlock()
			if err != nil {
				done(fmt.Errorf("writing the open-reservation index of partition %d: %w", p, err))
				return
			}
			j.floors.raise(nrev)
			done(nil)
		})
	})
}

// encodeOpen encodes an index (at most maxOpenBytes: the keys that expire
// first) and returns how many keys it left out.
func encodeOpen(keys map[string]openEntry) ([]byte, int) {
	names := slices.Sorted(maps.Keys(keys))
	// An entry's size at most (its policy's name counted with every key).
	sizeOf := func(k string) int { return len(k) + len(keys[k].policy) + 2*binary.MaxVarintLen64 }
	size := 0
	for _, k := range names {
		size += sizeOf(k)
	}
	dropped := 0
	if size > maxOpenBytes {
		slices.SortFunc(names, func(a, b string) int { return cmp.Or(cmp.Compare(keys[a].next, keys[b].next), cmp.Compare(a, b)) })
		for size > maxOpenBytes {
			k := names[len(names)-1]
			size -= sizeOf(k)
			names = names[:len(names)-1]
			dropped++
		}
		slices.Sort(names)
	}
	var policies []string
	idx := make(map[string]int)
	for _, k := range names {
		if pol := keys[k].policy; idx[pol] == 0 {
			policies = append(policies, pol)
			idx[pol] = len(policies)
		}
	}
	dst := []byte{'O', openFormat}
	dst = binary.AppendUvarint(dst, uint64(len(policies)))
	for _, pol := range policies {
		dst = binary.AppendUvarint(dst, uint64(len(pol)))
		dst = append(dst, pol...)
	}
	dst = binary.AppendUvarint(dst, uint64(len(names)))
	for _, k := range names {
		e := keys[k]
		dst = binary.AppendUvarint(dst, uint64(len(k)))
		dst = append(dst, k...)
		dst = binary.AppendUvarint(dst, uint64(idx[e.policy]-1))
		dst = binary.AppendUvarint(dst, uint64(e.open))
		dst = binary.AppendVarint(dst, e.next)
	}
	return dst, dropped
}

// decodeOpen decodes a stored index (nil: none); errors wrap ErrCorrupt.
func decodeOpen(b []byte) (map[string]openEntry, error) {
	if b == nil {
		return nil, nil
	}
	if len(b) < 2 || b[0] != 'O' || b[1] != openFormat {
		return nil, fmt.Errorf("%w: no index header", ErrCorrupt)
	}
	d := decoder{b: b[2:]}
	np := d.uvarint()
	if d.err == nil && np > uint64(len(d.b)) {
		d.err = fmt.Errorf("%w: %d policies in %d bytes", ErrCorrupt, np, len(d.b))
	}
	var policies []string
	for i := uint64(0); i < np && d.err == nil; i++ {
		policies = append(policies, string(d.bytes()))
	}
	n := d.uvarint()
	// Every entry takes at least four bytes: bound n before allocating.
	if d.err == nil && n > uint64(len(d.b)/4) {
		d.err = fmt.Errorf("%w: %d keys in %d bytes", ErrCorrupt, n, len(d.b))
	}
	var keys map[string]openEntry
	if d.err == nil {
		keys = make(map[string]openEntry, n)
	}
	for i := uint64(0); i < n && d.err == nil; i++ {
		k := string(d.bytes())
		pi := d.uvarint()
		open := d.uvarint()
		next := d.varint()
		switch {
		case d.err != nil:
		case pi >= uint64(len(policies)):
			d.err = fmt.Errorf("%w: policy %d of %d", ErrCorrupt, pi, len(policies))
		case open == 0 || open > keyrec.MaxReservations:
			d.err = fmt.Errorf("%w: %d open reservations", ErrCorrupt, open)
		default:
			keys[k] = openEntry{policy: policies[pi], open: int(open), next: next}
		}
	}
	if d.err == nil && len(d.b) != 0 {
		d.err = fmt.Errorf("%w: %d trailing bytes", ErrCorrupt, len(d.b))
	}
	if d.err != nil {
		return nil, d.err
	}
	return keys, nil
}

// TellReservations tells Config.OnReservations of every key of partition
// p (held here) that this node knows to have open reservations: those its
// open-reservation index names, with what the records it holds in memory
// (journalled since they were last checkpointed) say over them. A node
// that stops serving a partition forgets its keys' sweeps; the member
// calls this when it serves the partition again without adopting it (a
// renewal that landed after the node's lease ran out), so the sweeps go
// on (J17).
func (j *Journal) TellReservations(p int) {
	f := j.cfg.OnReservations
	if f == nil {
		return
	}
	known := j.open.known(p)
	for k, v := range j.recs.held(p) {
		if e := peekOpen(v); e != nil && e.open > 0 {
			known[k] = *e
		} else {
			delete(known, k)
		}
	}
	for _, k := range slices.Sorted(maps.Keys(known)) {
		e := known[k]
		f(e.policy, k, e.open, e.next)
	}
}

// known returns the keys of p's index (what this tenure saw of them, when
// the stored index is not read yet).
func (x *openIndex) known(p int) map[string]openEntry {
	x.mu.Lock()
	defer x.mu.Unlock()
	po := &x.parts[p]
	out := make(map[string]openEntry)
	if !po.loaded {
		for k, e := range po.pending {
			if e != nil && e.open > 0 {
				out[k] = *e
			}
		}
		return out
	}
	maps.Copy(out, po.keys)
	return out
}
