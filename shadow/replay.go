package shadow

import (
	"math"
	"slices"
	"strings"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/policies"
	"github.com/limitmesh/limitmesh/usage"
)

// DefaultMaxKeys is the default number of limit keys one candidate keeps
// state for (Options.MaxKeys). With one bucket limit a key costs about 250
// bytes, so a candidate at the cap holds about 25 MB.
const DefaultMaxKeys = 100_000

// Options are the bounds of a [Replay]. The zero value takes the defaults.
type Options struct {
	// MaxKeys is the most limit keys one candidate keeps state for;
	// default DefaultMaxKeys. When a record of a new key finds the
	// candidate full, the keys whose state is at rest (decides exactly as
	// a never-seen key would) are dropped, at most once per second of
	// record time; if the candidate is still full, the record is decided
	// against the candidate's one shared overflow state (key
	// OverflowKey(name)) and counted in Summary.Overflow.
	MaxKeys int
	// TopTracked is the most keys whose would-be denials a candidate
	// counts for its TopDenied ranking; default DefaultTopTracked.
	TopTracked int
}

func (o Options) withDefaults() Options {
	if o.MaxKeys <= 0 {
		o.MaxKeys = DefaultMaxKeys
	}
	if o.TopTracked <= 0 {
		o.TopTracked = DefaultTopTracked
	}
	return o
}

// OverflowKey is the limit key of the state a candidate decides the
// records of its overflowing keys against: "p.<name>._overflow". No
// canonical limit key has that form (their tokens after the name start
// with a dimension name, or "_h" for a digest).
func OverflowKey(name string) string { return "p." + name + "._overflow" }

// Replay is the pure core of shadow evaluation. It replays usage records,
// in stream order, through a set of candidate policies, each with limiter
// state of its own, and counts per candidate what [Summary] holds.
//
// Every candidate is evaluated on its own, whatever the live policies are:
// a record is evaluated by each candidate whose match covers its descriptor
// (CONTRACT.md §3 match rule, applied to the candidate alone), so the
// records no live policy matched (policy "") count as much as the others.
// The candidate's limit key is its own (Policy.LimitKey of the descriptor);
// a descriptor lacking a key dimension is skipped and counted. The
// decision is kvstate.DecideAll over the candidate's limits at the
// record's t_us (in ns) with the record's cost, against the key's state.
//
// A Replay is not safe for concurrent use; it reads no clock and does no
// I/O. Its memory is bounded by Options.
type Replay struct {
	opt    Options
	cands  []*candidate // by name
	keyBuf []byte
	// groups are the distinct key-dimension lists of the candidates: a
	// record's key suffix is computed once per group (see keyIndex).
	groups []keyGroup
}

// keyGroup is one key-dimension list and, during Apply, the key suffix of
// the record under it.
//
// index finds a key's states for every member at once: one map lookup
// per record and group instead of one per candidate (with ten candidates
// on the same dimensions, most of a record's cost was those lookups). It
// holds the keys in the literal form (keyIndex) that at least one member
// keeps state for; each member's keys map remains the record of what the
// candidate holds (sweeps, checkpoints, Summary.Keys), and index only
// points into it.
type keyGroup struct {
	dims    []string
	members int // candidates keyed on dims; each has its slot in a groupKey
	index   map[string]*groupKey
	state   suffixState
	suffix  []byte
	// cur is the record's groupKey once looked up (looked), nil when
	// no member keeps state for the key.
	cur    *groupKey
	looked bool
}

// groupKey is one literal key of a keyGroup: the state each member keeps
// for it (nil where it keeps none), by the member's slot.
type groupKey struct {
	states []*keyState
}

// suffixState says what a keyGroup's suffix holds for the record being
// applied.
type suffixState uint8

const (
	suffixUnknown suffixState = iota // not computed yet
	suffixOK                         // the literal key after "p.<name>"
	suffixMissing                    // the descriptor lacks a key dimension
	suffixLong                       // the literal key is long: each candidate computes its own
)

// candidate is one candidate revision under evaluation.
type candidate struct {
	p       *policies.Policy
	grp     *keyGroup // its key-dimension list's group in Replay.groups
	slot    int       // its place among the group's members (groupKey.states)
	limits  []kvstate.Limit
	sum     Summary // counts; TopDenied, Series and Keys are filled on output
	keys    map[string]*keyState
	over    keyState // the shared overflow state
	top     *topSet
	series  series
	sweepAt int64 // record time (ns) before which the keys are not swept again
	scratch []kvstate.State
	next    kvstate.State // a single limit's new state, before it is kept
}

// keyState is one limit key's state under a candidate and the would-be
// denials it has seen since it was created.
type keyState struct {
	key    string // the limit key, in full
	states []kvstate.State
	denied uint64
	// one holds the state of a candidate with one limit (states points
	// into it): no allocation of its own, and no pointer to chase.
	one [1]kvstate.State
}

// NewReplay returns a Replay with no candidates.
func NewReplay(opt Options) *Replay {
	return &Replay{opt: opt.withDefaults()}
}

// SetCandidates makes ps (non-nil, valid policies with distinct names) the
// candidates. A candidate already under evaluation with the same name and
// revision keeps its counts and state; any other starts at 0 with fresh
// state (a new revision restarts its counts); candidates not in ps are
// dropped. The Replay evaluates every policy it is given: filtering on
// Policy.Shadow is the caller's business.
func (r *Replay) SetCandidates(ps []*policies.Policy) {
	old := r.cands
	r.cands = make([]*candidate, 0, len(ps))
	for _, p := range ps {
		if c := findCandidate(old, p.Name); c != nil && c.p.Revision == p.Revision {
			c.p = p
			r.cands = append(r.cands, c)
			continue
		}
		r.cands = append(r.cands, r.newCandidate(p))
	}
	slices.SortFunc(r.cands, func(a, b *candidate) int { return strings.Compare(a.p.Name, b.p.Name) })
	r.groups = r.groups[:0]
	group := make([]int, len(r.cands)) // while r.groups grows
	for i, c := range r.cands {
		group[i] = slices.IndexFunc(r.groups, func(g keyGroup) bool { return slices.Equal(g.dims, c.p.Key) })
		if group[i] < 0 {
			group[i] = len(r.groups)
			r.groups = append(r.groups, keyGroup{dims: c.p.Key})
		}
		c.slot = r.groups[group[i]].members
		r.groups[group[i]].members++
	}
	for i, c := range r.cands {
		c.grp = &r.groups[group[i]]
	}
	r.reindex()
}

// reindex builds every group's index from its members' keys (after the
// candidates or their state changed wholesale).
func (r *Replay) reindex() {
	for i := range r.groups {
		r.groups[i].index = nil
		if r.groups[i].members > 1 {
			r.groups[i].index = map[string]*groupKey{}
		}
	}
	for _, c := range r.cands {
		if c.grp.index == nil {
			continue
		}
		for k, ks := range c.keys {
			if literalIndex(k) {
				c.grp.add(k, c.slot, ks)
			}
		}
	}
}

// literalIndex reports whether keys-map index k is in the literal form
// (see keyIndex), the form a group's index holds; the digest form is the
// candidate's own.
func literalIndex(k string) bool { return k == "" || k[0] == '.' }

// lookup returns the record's groupKey for literal key k (nil when no
// member keeps state for it), looking it up once per record.
func (g *keyGroup) lookup(k []byte) *groupKey {
	if !g.looked {
		g.cur, g.looked = g.index[string(k)], true
	}
	return g.cur
}

// add points member slot's state of literal key k at ks and returns k's
// groupKey.
func (g *keyGroup) add(k string, slot int, ks *keyState) *groupKey {
	gk := g.index[k]
	if gk == nil {
		gk = &groupKey{states: make([]*keyState, g.members)}
		g.index[k] = gk
	}
	gk.states[slot] = ks
	return gk
}

// keyIndex returns the index of a candidate's keys map under which the
// state of its limit key full is kept: the part after "p.<name>" when full
// is in the literal form (the same for every candidate keyed on the same
// dimensions, and unique within the candidate, since its keys all start
// with "p.<name>"), else (the digest form) full itself. The two never
// collide: a suffix is "" or starts with "." and a dimension name, a full
// key starts with "p.".
func keyIndex(name, full string) string {
	rest, ok := strings.CutPrefix(full, "p."+name)
	if !ok || strings.HasPrefix(rest, "._") {
		return full
	}
	return rest
}

func findCandidate(cs []*candidate, name string) *candidate {
	i, ok := slices.BinarySearchFunc(cs, name, func(c *candidate, n string) int { return strings.Compare(c.p.Name, n) })
	if !ok {
		return nil
	}
	return cs[i]
}

func (r *Replay) newCandidate(p *policies.Policy) *candidate {
	c := &candidate{
		p:      p,
		limits: make([]kvstate.Limit, len(p.Limits)),
		keys:   map[string]*keyState{},
		top:    newTopSet(r.opt.TopTracked),
		over:   keyState{key: OverflowKey(p.Name)},
	}
	for i, l := range p.Limits {
		c.limits[i] = l.Limit
	}
	c.sum.Policy, c.sum.Revision = p.Name, p.Revision
	return c
}

// Apply evaluates one record against every candidate that matches its
// descriptor. rec.Descriptor must be valid and sorted (as
// usage.DecodeBatch returns it) and rec.Cost >= 0. A reservation's end
// (CONTRACT.md §10) is evaluated as a request of its settled cost at its
// time; one that settled 0 (a release) spends nothing and is no request:
// it is not evaluated, counted or kept.
func (r *Replay) Apply(rec *usage.Record) {
	if rec.Cost == 0 {
		return
	}
	now := usToNs(rec.TimeUs)
	for i := range r.groups {
		g := &r.groups[i]
		g.state, g.cur, g.looked = suffixUnknown, nil, false
	}
	for _, c := range r.cands {
		if !matches(c.p, rec.Descriptor) {
			continue
		}
		g := c.grp
		if g.state == suffixUnknown {
			r.suffix(g, c.p, rec.Descriptor)
		}
		var idx []byte
		// A group of one finds keys in its candidate's map directly (the
		// index would only add a step).
		grouped := (*keyGroup)(nil)
		if g.members > 1 {
			grouped = g
		}
		switch {
		case g.state == suffixMissing:
			c.sum.Skipped++
			continue
		case g.state == suffixOK && 2+len(c.p.Name)+len(g.suffix) <= policies.MaxKeyLen:
			idx = g.suffix
		default: // a long key: the digest form for some candidates
			full, err := c.p.AppendLimitKey(r.keyBuf[:0], rec.Descriptor)
			if err != nil {
				c.sum.Skipped++
				continue
			}
			r.keyBuf, idx = full, full
			if rest := full[2+len(c.p.Name):]; len(rest) < 2 || rest[1] != '_' {
				idx = rest // the literal form, as keyIndex
			} else {
				grouped = nil
			}
		}
		c.apply(r.opt.MaxKeys, grouped, idx, rec, now)
	}
}

// suffix computes g's key suffix of d with p (one of its candidates).
func (r *Replay) suffix(g *keyGroup, p *policies.Policy, d policies.Descriptor) {
	full, err := p.AppendLimitKey(r.keyBuf[:0], d)
	if err != nil {
		g.state = suffixMissing
		return
	}
	r.keyBuf = full
	rest := full[2+len(p.Name):]
	if len(rest) >= 2 && rest[0] == '.' && rest[1] == '_' {
		g.state = suffixLong
		return
	}
	g.suffix, g.state = append(g.suffix[:0], rest...), suffixOK
}

// fullKey returns the limit key of the keys-map index idx (see keyIndex).
func (c *candidate) fullKey(idx []byte) string {
	if len(idx) > 0 && idx[0] != '.' {
		return string(idx)
	}
	return "p." + c.p.Name + string(idx)
}

// apply decides rec against the state of the key with index idx (see
// keyIndex) and counts the outcome. g is the candidate's group when idx is
// the group's literal suffix (its index finds the state), else nil.
func (c *candidate) apply(maxKeys int, g *keyGroup, idx []byte, rec *usage.Record, now int64) {
	var ks *keyState
	if g != nil {
		if gk := g.lookup(idx); gk != nil {
			ks = gk.states[c.slot]
		}
	} else {
		ks = c.keys[string(idx)]
	}
	overflow := false
	if ks == nil {
		if len(c.keys) >= maxKeys && now >= c.sweepAt {
			c.sweep(now)
			c.sweepAt = satAddNs(now, kvstate.Second)
		}
		if len(c.keys) < maxKeys {
			ks = &keyState{key: c.fullKey(idx)}
			k := string(idx)
			c.keys[k] = ks
			if g != nil {
				g.cur, g.looked = g.add(k, c.slot, ks), true
			}
		} else {
			ks, overflow = &c.over, true
		}
	}
	var d kvstate.Decision
	if len(c.limits) == 1 {
		// One limit: decide in place (DecideAll would copy the states).
		if len(ks.states) == 0 {
			ks.states = ks.one[:]
		}
		d = kvstate.DecideTo(&c.limits[0], &ks.states[0], now, rec.Cost, &c.next)
		if d.Allowed {
			ks.states[0] = c.next
		}
	} else {
		var out []kvstate.State
		d, out = kvstate.DecideAll(c.limits, ks.states, now, rec.Cost, c.scratch[:0])
		c.scratch = out
		if d.Allowed {
			ks.states = append(ks.states[:0], out...)
		}
	}

	s := &c.sum
	if s.Evaluated == 0 {
		s.SinceUs = rec.TimeUs
	}
	s.Evaluated++
	s.LastUs = rec.TimeUs
	if overflow {
		s.Overflow++
	}
	live := !rec.Allowed
	if live {
		s.LiveDenied++
	}
	switch {
	case d.Allowed:
		s.WouldAllow++
		if live {
			s.OnlyLiveDenied++
		}
	default:
		s.WouldDeny++
		s.WouldDenyUnits = Units(satAddNs(int64(s.WouldDenyUnits), rec.Cost))
		if live {
			s.BothDenied++
		} else {
			s.OnlyCandidateDenied++
		}
		ks.denied++
		c.top.denied(ks.key, ks.denied)
	}
	c.series.add(rec.TimeUs, !d.Allowed, live)
}

// sweep drops the keys whose state is at rest at now: it decides every
// request from now on exactly as a never-seen key's would. The group's
// key of the record being applied is looked up again afterwards (the sweep
// may have dropped it from the index).
func (c *candidate) sweep(now int64) {
	for k, ks := range c.keys {
		if atRest(c.limits, ks.states, now) {
			delete(c.keys, k)
			c.unindex(k)
		}
	}
	c.grp.cur, c.grp.looked = nil, false
}

// unindex removes the candidate's state of key k (dropped from its keys)
// from its group's index.
func (c *candidate) unindex(k string) {
	g := c.grp
	if g.index == nil || !literalIndex(k) {
		return
	}
	gk := g.index[k]
	if gk == nil {
		return
	}
	gk.states[c.slot] = nil
	for _, ks := range gk.states {
		if ks != nil {
			return
		}
	}
	delete(g.index, k)
}

// atRest reports whether states, advanced to now, equal a never-seen
// key's states advanced to now.
func atRest(limits []kvstate.Limit, states []kvstate.State, now int64) bool {
	for i, l := range limits {
		var s kvstate.State
		if i < len(states) {
			s = states[i]
		}
		if !sameState(kvstate.Advance(l, s, now), kvstate.Advance(l, kvstate.State{}, now)) {
			return false
		}
	}
	return true
}

func sameState(a, b kvstate.State) bool {
	return a.Algorithm == b.Algorithm && a.Tokens == b.Tokens && a.Frac == b.Frac && a.Last == b.Last &&
		a.TAT == b.TAT && a.TATFrac == b.TATFrac && a.WindowStart == b.WindowStart &&
		a.Count == b.Count && a.Prev == b.Prev && slices.Equal(a.Log, b.Log) && slices.Equal(a.Holds, b.Holds)
}

// matches reports whether p's match covers d: every match dimension is in
// d with an equal value, or any value for "*". Both are sorted by name.
func matches(p *policies.Policy, d policies.Descriptor) bool {
	j := 0
	for _, m := range p.Match {
		for j < len(d) && d[j].Name < m.Name {
			j++
		}
		if j == len(d) || d[j].Name != m.Name {
			return false
		}
		if m.Value != policies.AnyValue && d[j].Value != m.Value {
			return false
		}
		j++
	}
	return true
}

// Summaries returns the summary of every candidate, by name.
func (r *Replay) Summaries() []Summary {
	out := make([]Summary, len(r.cands))
	for i, c := range r.cands {
		out[i] = c.summary()
	}
	return out
}

// Summary returns the summary of the candidate named name.
func (r *Replay) Summary(name string) (Summary, bool) {
	c := findCandidate(r.cands, name)
	if c == nil {
		return Summary{}, false
	}
	return c.summary(), true
}

func (c *candidate) summary() Summary {
	s := c.sum
	s.TopDenied = c.top.top(TopN)
	s.Series = slices.Clone(c.series.points)
	if s.Series == nil {
		s.Series = []Point{}
	}
	s.Keys = len(c.keys)
	return s
}

// usToNs converts Unix microseconds to nanoseconds, saturating.
func usToNs(us int64) int64 {
	switch {
	case us > math.MaxInt64/1000:
		return math.MaxInt64
	case us < math.MinInt64/1000:
		return math.MinInt64
	}
	return us * 1000
}

// satAddNs returns a+b (b >= 0) saturated at math.MaxInt64.
func satAddNs(a, b int64) int64 {
	if a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
}
