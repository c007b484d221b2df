package policies

import (
	"maps"
	"slices"
	"strings"
)

// Snapshot is an immutable set of policies with an index for matching. It is
// built once ([NewSnapshot]) and never changes: [Snapshot.With] and
// [Snapshot.Without] return new snapshots, so a node can swap the snapshot
// it serves atomically and many goroutines can use one concurrently. A nil
// *Snapshot is an empty one.
//
// Matching (CONTRACT.md §3): a policy matches a descriptor when every one of
// its match dimensions is present and equal (or the match value is "*").
// Among the matching policies the one with the most exact (non-"*") entries
// wins, then the one with the most entries, then the lexically smallest
// name.
//
// The index groups the policies by pattern: the sorted set of match
// dimension names (the shape) together with which of them are exact. All
// policies of a pattern have the same precedence, and within a pattern they
// are found by one map lookup on their exact values. Match checks the
// patterns from the highest precedence down and stops at the first
// precedence level that has a match, so its cost grows with the number of
// distinct patterns (small in practice), not with the number of policies.
type Snapshot struct {
	sorted []*Policy          // by name
	byName map[string]*Policy //
	layers []*layerIndex      // by layer name ("" first)
}

// layerIndex indexes the policies of one layer (CONTRACT.md §11): matching
// picks the best policy within each layer.
type layerIndex struct {
	name     string
	patterns []*pattern // by precedence, highest first
}

// pattern is one (shape, exact positions) combination.
type pattern struct {
	names  []string // the match dimension names, sorted
	exact  []bool   // exact[i]: names[i] is matched by value (not "*")
	nExact int
	// byValues maps the exact values, each followed by a 0 byte, to the
	// policy with the smallest name among those with these values. Values
	// never hold a 0 byte (no control characters), so the encoding is
	// unambiguous.
	byValues map[string]*Policy
}

// NewSnapshot builds a snapshot of ps. Policies must be valid (from [Parse]
// or checked with [Policy.Validate]) and are shared, not copied: never
// modify them afterwards. Of several policies with one name the last wins.
func NewSnapshot(ps []*Policy) *Snapshot {
	byName := make(map[string]*Policy, len(ps))
	for _, p := range ps {
		if p != nil {
			byName[p.Name] = p
		}
	}
	return build(byName)
}

func build(byName map[string]*Policy) *Snapshot {
	s := &Snapshot{byName: byName, sorted: make([]*Policy, 0, len(byName))}
	for _, p := range byName {
		s.sorted = append(s.sorted, p)
	}
	slices.SortFunc(s.sorted, func(a, b *Policy) int { return strings.Compare(a.Name, b.Name) })
	byLayer := map[string][]*Policy{}
	for _, p := range s.sorted {
		byLayer[p.Layer] = append(byLayer[p.Layer], p)
	}
	for _, name := range slices.Sorted(maps.Keys(byLayer)) {
		s.layers = append(s.layers, &layerIndex{name: name, patterns: buildPatterns(byLayer[name])})
	}
	return s
}

// buildPatterns indexes policies (sorted by name) by pattern, highest
// precedence first.
func buildPatterns(sorted []*Policy) []*pattern {
	var patterns []*pattern
	index := map[string]*pattern{}
	var id, vals []byte
	for _, p := range sorted {
		id, vals = id[:0], vals[:0]
		nExact := 0
		for _, m := range p.Match {
			id = append(id, m.Name...)
			if m.Value == AnyValue {
				id = append(id, '*')
			} else {
				id = append(id, '=')
				vals = append(vals, m.Value...)
				vals = append(vals, 0)
				nExact++
			}
			id = append(id, 0)
		}
		pt := index[string(id)]
		if pt == nil {
			pt = &pattern{
				names:    make([]string, len(p.Match)),
				exact:    make([]bool, len(p.Match)),
				nExact:   nExact,
				byValues: map[string]*Policy{},
			}
			for i, m := range p.Match {
				pt.names[i] = m.Name
				pt.exact[i] = m.Value != AnyValue
			}
			index[string(id)] = pt
			patterns = append(patterns, pt)
		}
		if _, taken := pt.byValues[string(vals)]; !taken { // sorted is by name: first is smallest
			pt.byValues[string(vals)] = p
		}
	}
	slices.SortFunc(patterns, func(a, b *pattern) int {
		if a.nExact != b.nExact {
			return b.nExact - a.nExact
		}
		return len(b.names) - len(a.names)
	})
	return patterns
}

// Match returns the policy governing d (the most specific matching one)
// in the first layer (by name, "" first) where one matches, or nil when
// none matches. With one layer (every policy without a "layer", the
// usual case) that is the policy that decides d; with several, a request
// is decided by every layer's ([Snapshot.MatchLayers]). d must be a
// valid Descriptor (sorted by name). It does not allocate for descriptors
// whose exact values total under 512 bytes.
func (s *Snapshot) Match(d Descriptor) *Policy {
	if s == nil {
		return nil
	}
	for _, l := range s.layers {
		if p := l.match(d); p != nil {
			return p
		}
	}
	return nil
}

// MatchLayers appends to dst the policy governing d in each layer where
// one matches, in layer order (CONTRACT.md §11), and returns it.
func (s *Snapshot) MatchLayers(d Descriptor, dst []*Policy) []*Policy {
	if s == nil {
		return dst
	}
	for _, l := range s.layers {
		if p := l.match(d); p != nil {
			dst = append(dst, p)
		}
	}
	return dst
}

// Layered reports whether the snapshot has policies in more than one
// layer: only then may a request meet several policies.
func (s *Snapshot) Layered() bool { return s != nil && len(s.layers) > 1 }

// match returns the best policy of the layer for d, or nil.
func (l *layerIndex) match(d Descriptor) *Policy {
	var buf [512]byte
	var best *Policy
	level := -1 // precedence level of best: nExact<<8 | entries
	for _, pt := range l.patterns {
		lv := pt.nExact<<8 | len(pt.names)
		if best != nil && lv < level {
			break // lower precedence than the match found
		}
		if len(pt.names) > len(d) {
			continue
		}
		key, ok := pt.lookupKey(buf[:0], d)
		if !ok {
			continue
		}
		p := pt.byValues[string(key)]
		if p != nil && (best == nil || p.Name < best.Name) {
			best, level = p, lv
		}
	}
	return best
}

// lookupKey appends the values d has for pt's exact dimensions (each
// followed by a 0 byte), or reports false if d lacks one of pt's dimensions.
func (pt *pattern) lookupKey(dst []byte, d Descriptor) ([]byte, bool) {
	j := 0
	for i, name := range pt.names {
		for j < len(d) && d[j].Name < name {
			j++
		}
		if j == len(d) || d[j].Name != name {
			return nil, false
		}
		if pt.exact[i] {
			dst = append(dst, d[j].Value...)
			dst = append(dst, 0)
		}
		j++
	}
	return dst, true
}

// Get returns the policy named name, or nil.
func (s *Snapshot) Get(name string) *Policy {
	if s == nil {
		return nil
	}
	return s.byName[name]
}

// Len returns the number of policies.
func (s *Snapshot) Len() int {
	if s == nil {
		return 0
	}
	return len(s.sorted)
}

// Policies returns the policies sorted by name. The slice is a copy; the
// policies are shared.
func (s *Snapshot) Policies() []*Policy {
	if s == nil {
		return nil
	}
	return slices.Clone(s.sorted)
}

// With returns a new snapshot holding s's policies with p added, or
// replacing the policy of the same name (p must not be nil). s is
// unchanged. It rebuilds the index, O(number of policies): about 5 ms for
// 10,000 policies, so a watcher should build its first snapshot with one
// [NewSnapshot] call over the initial values and use With and Without only
// for the changes that follow.
func (s *Snapshot) With(p *Policy) *Snapshot {
	byName := make(map[string]*Policy, s.Len()+1)
	if s != nil {
		for n, q := range s.byName {
			byName[n] = q
		}
	}
	byName[p.Name] = p
	return build(byName)
}

// Without returns a new snapshot holding s's policies except the one named
// name (s itself if there is none). s is unchanged.
func (s *Snapshot) Without(name string) *Snapshot {
	if s.Get(name) == nil {
		if s == nil {
			return build(map[string]*Policy{})
		}
		return s
	}
	byName := make(map[string]*Policy, len(s.byName))
	for n, q := range s.byName {
		if n != name {
			byName[n] = q
		}
	}
	return build(byName)
}
