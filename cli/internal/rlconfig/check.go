package rlconfig

import (
	"fmt"
	"slices"
	"strings"

	"github.com/limitmesh/limitmesh/policies"
)

// The check. envoyproxy/ratelimit looks a descriptor up level by level:
// at each entry it takes the child with the entry's key and value, else
// one with the key and a wildcard value, else one with the key alone, and
// never comes back to try another; the limit is the one of the node the
// last entry reaches. limitmesh takes the matching policy with the most
// exact values, then the most entries. The two agree on most
// configurations, not on all: a broader policy can match where
// envoyproxy/ratelimit's lookup stopped at a descriptor without a limit
// (an unlimited or shadow-mode one, or one whose children do not go on),
// and the two orders of precedence differ where exact values sit at
// different levels.
//
// So Convert replays requests through both. Only equality with a value in
// the configuration matters to either side, so for each key sequence the
// configuration has (every path from the top to a descriptor) the
// requests that take, at each entry, one of the values configured for its
// key or one value configured nowhere stand for all requests of that
// sequence. Where the two disagree, Convert adds a policy whose match is
// the request itself (its configured values exact, the others "*"): no
// policy outranks it for that request, and it carries envoyproxy/
// ratelimit's answer (the same limit, or none). It repeats until they
// agree on every request. Requests of other key sequences get no limit
// from envoyproxy/ratelimit; a limitmesh policy may still match them
// (descriptors are sets, a policy ignores entries it does not name): that
// difference is documented, not checked.

// entry is one entry of a request.
type entry struct{ key, value string }

// lookup returns the node whose limit envoyproxy/ratelimit applies to a
// descriptor of cfg with entries es, or nil when none applies (no node,
// a node without rate_limit, unlimited, or shadow mode: the answer is OK).
func lookup(cfg *Config, es []entry) *Node {
	level := cfg.Descriptors
	var found *Node
	for i, e := range es {
		var next *Node
		for _, pass := range []func(n *Node) bool{
			func(n *Node) bool { return n.Value == e.value },
			func(n *Node) bool { return n.Value == policies.AnyValue },
			func(n *Node) bool { return n.Value == "" },
		} {
			for _, n := range level {
				if n.Key == e.key && pass(n) {
					next = n
					break
				}
			}
			if next != nil {
				break
			}
		}
		if next == nil {
			break
		}
		if i == len(es)-1 && next.Limit != nil {
			found = next
		}
		if len(next.Children) == 0 {
			break
		}
		level = next.Children
	}
	if found == nil || found.Limit.Unlimited || found.ShadowMode {
		return nil
	}
	return found
}

// check replays cfg's requests and adds policies until limitmesh's
// matching agrees with envoyproxy/ratelimit's lookup on every one.
func (c *converter) check(cfg *Config) error {
	seqs, values := c.shapes(cfg)
	checked := seqs[:0:0]
	for _, seq := range seqs {
		total := 1
		for _, k := range seq {
			total *= len(values[c.group(cfg, k)])
			if total > c.o.MaxChecks {
				break
			}
		}
		if total > c.o.MaxChecks {
			c.note("%s: %s: not checked: more than %d requests of keys (%s)", cfg.File, cfg.Domain, c.o.MaxChecks, strings.Join(seq, ", "))
			continue
		}
		checked = append(checked, seq)
	}
	seqs = checked
	for round := 0; ; round++ {
		if round > 1000 {
			return &Error{File: cfg.File, Reason: "the check did not settle after 1000 rounds (a bug: please report it with this file)"}
		}
		live := make([]*policies.Policy, 0, len(c.gens))
		byName := map[string]*gen{}
		for _, g := range c.gens {
			if g.kind != KindShadow {
				live = append(live, g.parsed)
				byName[g.name] = g
			}
		}
		snap := policies.NewSnapshot(live)
		type fix struct {
			req  []entry
			want *Node
		}
		var fixes []fix
		pending := map[string]int{}
		for _, seq := range seqs {
			err := c.requests(cfg, seq, values, func(req []entry, d policies.Descriptor) error {
				want := lookup(cfg, req)
				var got *Node
				if p := snap.Match(d); p != nil {
					got = byName[p.Name].outcome()
				}
				if want == got {
					return nil
				}
				match := c.requestMatch(cfg, req, values)
				id := identity(match)
				if i, ok := pending[id]; ok {
					if fixes[i].want != want {
						return c.orderConflict(cfg, req, want, fixes[i].req, fixes[i].want)
					}
					return nil
				}
				pending[id] = len(fixes)
				fixes = append(fixes, fix{req, want})
				return nil
			})
			if err != nil {
				return err
			}
		}
		if len(fixes) == 0 {
			return nil
		}
		for _, f := range fixes {
			match := c.requestMatch(cfg, f.req, values)
			id := identity(match)
			for _, g := range c.gens {
				if g.kind != KindShadow && identity(g.match) == id {
					// The most specific policy possible for this request
					// exists and stands for another answer: the same
					// entries in another order (a bug otherwise).
					return c.orderConflict(cfg, f.req, f.want, g.keysEntries(), g.outcome())
				}
			}
			keys := make([]string, len(f.req))
			for i, e := range f.req {
				keys[i] = e.key
			}
			g := &gen{cfg: cfg, match: match, keys: keys, node: f.want, kind: KindCopy}
			if f.want == nil {
				g.kind = KindUnlimited
			}
			otherName := "no policy"
			if other := snap.Match(c.descriptor(cfg, f.req)); other != nil {
				otherName = other.Name
			}
			g.why = "without this policy " + otherName + " would apply"
			if f.want != nil {
				g.why = fmt.Sprintf("a copy of %s's limit; %s", f.want.Path(), g.why)
			}
			if err := c.add(g); err != nil {
				return err
			}
			answer := "no limit"
			if f.want != nil {
				answer = fmt.Sprintf("the limit of %s (line %d)", f.want.Path(), f.want.Line)
			}
			c.note("added %s: envoyproxy/ratelimit gives %s: %s %s; without it %s would apply", g.name, cfg.Domain, g.path(), answer, otherName)
		}
	}
}

// keysEntries returns g's path as entries (values "*" where any).
func (g *gen) keysEntries() []entry {
	es := make([]entry, len(g.keys))
	for i, k := range g.keys {
		es[i] = entry{k, g.match[i+1].Value}
	}
	return es
}

func (c *converter) orderConflict(cfg *Config, a []entry, wantA *Node, b []entry, wantB *Node) error {
	answer := func(n *Node) string {
		if n == nil {
			return "no limit"
		}
		return fmt.Sprintf("the limit of %s (line %d)", n.Path(), n.Line)
	}
	return &Error{File: cfg.File, Path: cfg.Domain, Unsupported: true,
		Reason: fmt.Sprintf("envoyproxy/ratelimit gives (%s) %s and (%s) %s: the same entries in another order; limitmesh descriptors have no order",
			showEntries(a), answer(wantA), showEntries(b), answer(wantB))}
}

func showEntries(es []entry) string {
	parts := make([]string, len(es))
	for i, e := range es {
		parts[i] = e.key + "=" + e.value
	}
	return strings.Join(parts, ", ")
}

// group is the dimension a key becomes on its own: keys of one group
// (they differ only in case or punctuation) meet the same policies, so
// they share their configured values in the check.
func (c *converter) group(cfg *Config, key string) string {
	return c.o.Names(cfg.Domain, []string{key})[0]
}

// shapes returns cfg's key sequences (every path from the top to a
// descriptor) and, per key group, the values configured for its keys plus
// one value configured nowhere (the last).
func (c *converter) shapes(cfg *Config) ([][]string, map[string][]string) {
	var seqs [][]string
	seen := map[string]bool{}
	all := map[string]bool{}
	values := map[string][]string{}
	var visit func(ns []*Node, prefix []string)
	visit = func(ns []*Node, prefix []string) {
		for _, n := range ns {
			seq := append(slices.Clone(prefix), n.Key)
			if id := strings.Join(seq, "\x00"); !seen[id] {
				seen[id] = true
				seqs = append(seqs, seq)
			}
			if n.Value != "" && n.Value != policies.AnyValue {
				all[n.Value] = true
				g := c.group(cfg, n.Key)
				if !slices.Contains(values[g], n.Value) {
					values[g] = append(values[g], n.Value)
				}
			}
			visit(n.Children, seq)
		}
	}
	visit(cfg.Descriptors, nil)
	other := "other"
	for all[other] {
		other += "_"
	}
	for _, seq := range seqs {
		for _, k := range seq {
			g := c.group(cfg, k)
			if vs := values[g]; len(vs) == 0 || vs[len(vs)-1] != other {
				values[g] = append(vs, other)
			}
		}
	}
	return seqs, values
}

// requests calls fn with every request of key sequence seq whose values
// come from values, and its limitmesh descriptor. A request the bridge
// cannot map is skipped: it is refused whatever the policies.
func (c *converter) requests(cfg *Config, seq []string, values map[string][]string, fn func([]entry, policies.Descriptor) error) error {
	vals := make([][]string, len(seq))
	for i, k := range seq {
		vals[i] = values[c.group(cfg, k)]
	}
	idx := make([]int, len(seq))
	req := make([]entry, len(seq))
	for {
		for i, k := range seq {
			req[i] = entry{k, vals[i][idx[i]]}
		}
		if d := c.descriptor(cfg, req); d != nil {
			if err := fn(slices.Clone(req), d); err != nil {
				return err
			}
		}
		i := len(idx) - 1
		for ; i >= 0; i-- {
			idx[i]++
			if idx[i] < len(vals[i]) {
				break
			}
			idx[i] = 0
		}
		if i < 0 {
			return nil
		}
	}
}

// descriptor is the limitmesh descriptor the bridge makes of req, nil
// when it refuses it.
func (c *converter) descriptor(cfg *Config, req []entry) policies.Descriptor {
	keys := make([]string, len(req))
	for i, e := range req {
		keys[i] = e.key
	}
	names := c.o.Names(cfg.Domain, keys)
	dims := []policies.Dim{{Name: c.o.DomainDimension, Value: cfg.Domain}}
	for i, e := range req {
		dims = append(dims, policies.Dim{Name: names[i], Value: e.value})
	}
	d, err := policies.NewDescriptor(dims)
	if err != nil {
		return nil
	}
	return d
}

// requestMatch is the most specific match of req: the domain, each entry
// with a configured value exact, the others "*".
func (c *converter) requestMatch(cfg *Config, req []entry, values map[string][]string) []policies.Dim {
	keys := make([]string, len(req))
	for i, e := range req {
		keys[i] = e.key
	}
	names := c.o.Names(cfg.Domain, keys)
	match := []policies.Dim{{Name: c.o.DomainDimension, Value: cfg.Domain}}
	for i, e := range req {
		v := e.value
		if vs := values[c.group(cfg, e.key)]; v == vs[len(vs)-1] {
			v = policies.AnyValue
		}
		match = append(match, policies.Dim{Name: names[i], Value: v})
	}
	return match
}
