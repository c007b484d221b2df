package shadow

import (
	"cmp"
	"slices"
	"strings"
)

// TopN is the most keys a [Summary]'s TopDenied lists.
const TopN = 20

// DefaultTopTracked is the default number of keys whose would-be denials a
// candidate counts for its TopDenied ranking (Options.TopTracked).
const DefaultTopTracked = 1000

// topSet ranks the keys a candidate would deny. It holds exact would-deny
// counts for at most max keys, in a min-heap by count with an index by
// key. A key enters on a denial while the set has room, or by replacing the
// tracked key with the smallest count when its own count (the denials its
// limiter state has seen, kept with the state) is larger. So the tracked
// keys are, at every moment, the keys with the most denials as far as the
// candidate still knows them: a tracked key's count is exact since it
// entered the set, and it entered with the exact count of its state. A key
// whose state was dropped at rest (see [Replay]) while it was not tracked
// starts counting again from 0; with fewer than max distinct denied keys,
// or while the candidate holds fewer than MaxKeys keys, every count is
// exact.
type topSet struct {
	max   int
	heap  []*topEntry // min-heap by (count, then key descending)
	index map[string]*topEntry
}

type topEntry struct {
	key   string
	count uint64
	pos   int
}

func newTopSet(max int) *topSet {
	return &topSet{max: max, index: map[string]*topEntry{}}
}

// less orders the heap: the smallest count first, and among equal counts
// the larger key, so that the one replaced is the one ranked last.
func (t *topSet) less(i, j int) bool {
	a, b := t.heap[i], t.heap[j]
	if a.count != b.count {
		return a.count < b.count
	}
	return a.key > b.key
}

func (t *topSet) swap(i, j int) {
	t.heap[i], t.heap[j] = t.heap[j], t.heap[i]
	t.heap[i].pos, t.heap[j].pos = i, j
}

func (t *topSet) up(i int) {
	for i > 0 {
		p := (i - 1) / 2
		if !t.less(i, p) {
			return
		}
		t.swap(i, p)
		i = p
	}
}

func (t *topSet) down(i int) {
	n := len(t.heap)
	for {
		l := 2*i + 1
		if l >= n {
			return
		}
		m := l
		if r := l + 1; r < n && t.less(r, l) {
			m = r
		}
		if !t.less(m, i) {
			return
		}
		t.swap(i, m)
		i = m
	}
}

// denied records one would-be denial of key, whose limiter state has now
// seen count denials (count >= 1).
func (t *topSet) denied(key string, count uint64) {
	if e := t.index[key]; e != nil {
		e.count++
		t.down(e.pos)
		return
	}
	if t.max <= 0 {
		return
	}
	if len(t.heap) < t.max {
		e := &topEntry{key: key, count: count, pos: len(t.heap)}
		t.heap = append(t.heap, e)
		t.index[key] = e
		t.up(e.pos)
		return
	}
	min := t.heap[0]
	if count < min.count || count == min.count && key > min.key {
		return
	}
	delete(t.index, min.key)
	min.key, min.count = key, count
	t.index[key] = min
	t.down(0)
}

// top returns the n keys with the most denials, most first (ties by key).
func (t *topSet) top(n int) []TopKey {
	out := make([]TopKey, 0, len(t.heap))
	for _, e := range t.heap {
		out = append(out, TopKey{Key: e.key, WouldDeny: e.count})
	}
	slices.SortFunc(out, func(a, b TopKey) int {
		if c := cmp.Compare(b.WouldDeny, a.WouldDeny); c != 0 {
			return c
		}
		return strings.Compare(a.Key, b.Key)
	})
	if len(out) > n {
		out = out[:n]
	}
	return out
}

// entries returns every tracked key and count (for a checkpoint), in no
// particular order.
func (t *topSet) entries() []TopKey {
	out := make([]TopKey, 0, len(t.heap))
	for _, e := range t.heap {
		out = append(out, TopKey{Key: e.key, WouldDeny: e.count})
	}
	return out
}

// set puts key with count into the set as restored from a checkpoint.
func (t *topSet) set(key string, count uint64) {
	if t.index[key] != nil || len(t.heap) >= t.max {
		return
	}
	e := &topEntry{key: key, count: count, pos: len(t.heap)}
	t.heap = append(t.heap, e)
	t.index[key] = e
	t.up(e.pos)
}
