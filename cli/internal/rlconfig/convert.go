package rlconfig

import (
	"bytes"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/limitmesh/limitmesh/policies"
)

// Algorithms a rate limit may become (Options.Algorithm).
const (
	FixedWindow   = "fixed_window"   // the default: envoyproxy/ratelimit's own counting
	SlidingWindow = "sliding_window" // smoother at window edges, not the same counts
	TokenBucket   = "token_bucket"   // rate N/unit, burst N (second to day only)
)

// unlimitedLimit is the limit of the policies that stand for "no limit"
// (unlimited descriptors, shadow-mode descriptors, and descriptors
// envoyproxy/ratelimit gives no limit where a broader policy would match):
// the largest a limit can be, per millisecond and per node (local mode, no
// state leaves the node), so that no request can be denied by it.
const (
	unlimitedLimit  = "9223372036854.775807"
	unlimitedWindow = "1ms"
	unlimitedSuffix = "-unlimited"
)

// zeroLimit is what requests_per_unit 0 (deny everything) becomes: one
// micro-unit per window, less than any request costs (an Envoy request
// costs at least 1), so every request is denied with retry_after_ms -1.
const zeroLimit = "0.000001"

// Options configure Convert.
type Options struct {
	// Algorithm is FixedWindow (default), SlidingWindow or TokenBucket.
	Algorithm string
	// CalendarMonth makes a month unit a UTC calendar month (a quota
	// limit), for an envoyproxy/ratelimit that runs with calendar months;
	// by default a month is a 30-day window, as envoyproxy/ratelimit's.
	CalendarMonth bool
	// Names maps a descriptor of domain whose entries have keys (in order)
	// to the dimension names the Envoy bridge gives them, one per key
	// (required).
	Names func(domain string, keys []string) []string
	// DomainDimension is the dimension the bridge puts the domain in
	// (required).
	DomainDimension string
	// Parse is the node's policy parser (required): every policy Convert
	// returns passed it.
	Parse func(name string, doc []byte) (*policies.Policy, error)
	// MaxChecks is the most requests the check replays for one key
	// sequence; longer sequences are reported in Notes, not checked
	// (default 1,000,000).
	MaxChecks int
}

// Kinds of converted policies (Policy.Kind).
const (
	KindLimit     = "limit"     // a descriptor's rate limit
	KindShadow    = "shadow"    // a shadow_mode descriptor's limit: a candidate ("shadow": true)
	KindUnlimited = "unlimited" // no limit, where a broader policy would otherwise apply
	KindCopy      = "copy"      // a descriptor's limit again, where a broader policy would otherwise win
)

// Policy is one converted policy.
type Policy struct {
	Name string
	Doc  []byte // JSON, accepted by Options.Parse
	Kind string
	// Line is the line of the descriptor whose limit the policy carries
	// (0 for KindUnlimited).
	Line int
	// Source is where it comes from: "file:line domain: path".
	Source string
}

// Result is what Convert returns.
type Result struct {
	Policies []Policy // in the files' order; added ones after
	// Notes are what changed in the conversion or could not be checked,
	// one line each.
	Notes []string
}

// gen is a policy being made.
type gen struct {
	cfg    *Config
	name   string
	kind   string
	match  []policies.Dim // domain first, then the entries in order
	keys   []string       // the Envoy keys of the entries
	node   *Node          // whose limit (nil for KindUnlimited)
	why    string         // the description's tail
	doc    []byte
	parsed *policies.Policy
}

// outcome is the node whose limit decides, nil for none.
func (g *gen) outcome() *Node {
	if g.kind == KindUnlimited {
		return nil
	}
	return g.node
}

// identity is the match as a set: limitmesh matching ignores order.
func identity(match []policies.Dim) string {
	s := slices.Clone(match)
	slices.SortFunc(s, func(a, b policies.Dim) int { return strings.Compare(a.Name, b.Name) })
	var b strings.Builder
	for _, d := range s {
		b.WriteString(d.Name)
		b.WriteByte(0)
		b.WriteString(d.Value)
		b.WriteByte(0)
	}
	return b.String()
}

type converter struct {
	o     Options
	res   Result
	gens  []*gen
	names map[string]string // policy name -> identity+kind that took it
}

// Convert converts configuration files to limitmesh policies. It returns
// an [*Error] (matching [ErrUnsupported] for what limitmesh cannot
// reproduce) for the first problem found.
func Convert(cfgs []*Config, o Options) (*Result, error) {
	switch o.Algorithm {
	case "":
		o.Algorithm = FixedWindow
	case FixedWindow, SlidingWindow, TokenBucket:
	default:
		return nil, fmt.Errorf("algorithm %q: want %s, %s or %s", o.Algorithm, FixedWindow, SlidingWindow, TokenBucket)
	}
	if o.MaxChecks <= 0 {
		o.MaxChecks = 1_000_000
	}
	c := &converter{o: o, names: map[string]string{}}
	domains := map[string]string{}
	for _, cfg := range cfgs {
		if f, dup := domains[cfg.Domain]; dup {
			return nil, &Error{File: cfg.File, Reason: fmt.Sprintf("domain %q is also in %s (envoyproxy/ratelimit refuses a repeated domain unless it merges them)", cfg.Domain, f)}
		}
		domains[cfg.Domain] = cfg.File
		if err := c.walk(cfg, cfg.Descriptors, nil); err != nil {
			return nil, err
		}
	}
	if err := c.distinct(); err != nil {
		return nil, err
	}
	for _, cfg := range cfgs {
		if err := c.check(cfg); err != nil {
			return nil, err
		}
	}
	for _, g := range c.gens {
		src, line := g.cfg.File, 0
		if g.node != nil && g.kind != KindUnlimited {
			line = g.node.Line
			src += ":" + strconv.Itoa(line)
		}
		c.res.Policies = append(c.res.Policies, Policy{Name: g.name, Doc: g.doc, Kind: g.kind, Line: line,
			Source: src + " " + g.cfg.Domain + ": " + g.path()})
	}
	return &c.res, nil
}

// path is the gen's match as "foo=*, bar=banned" (without the domain).
func (g *gen) path() string {
	parts := make([]string, 0, len(g.keys))
	for i, k := range g.keys {
		parts = append(parts, k+"="+g.match[i+1].Value)
	}
	return strings.Join(parts, ", ")
}

func (c *converter) errAt(cfg *Config, n *Node, reason string) error {
	return &Error{File: cfg.File, Line: n.Line, Path: cfg.Domain + ": " + n.Path(), Reason: reason}
}

func (c *converter) unsupportedAt(cfg *Config, n *Node, reason string) error {
	return &Error{File: cfg.File, Line: n.Line, Path: cfg.Domain + ": " + n.Path(), Reason: reason, Unsupported: true}
}

func (c *converter) note(format string, a ...any) {
	c.res.Notes = append(c.res.Notes, fmt.Sprintf(format, a...))
}

// pathOf returns the Envoy keys and the match (domain first) of n's path.
func (c *converter) pathOf(cfg *Config, n *Node) ([]string, []policies.Dim) {
	var nodes []*Node
	for m := n; m != nil; m = m.parent {
		nodes = append(nodes, m)
	}
	slices.Reverse(nodes)
	keys := make([]string, len(nodes))
	for i, m := range nodes {
		keys[i] = m.Key
	}
	names := c.o.Names(cfg.Domain, keys)
	match := []policies.Dim{{Name: c.o.DomainDimension, Value: cfg.Domain}}
	for i, m := range nodes {
		v := m.Value
		if v == "" {
			v = policies.AnyValue
		}
		match = append(match, policies.Dim{Name: names[i], Value: v})
	}
	return keys, match
}

// walk makes the policies of the descriptors ns (children of parent) and
// their children, refusing what cannot be mapped.
func (c *converter) walk(cfg *Config, ns []*Node, parent *Node) error {
	anyKey := map[string]bool{} // keys with a key-only descriptor at this level
	starKey := map[string]bool{}
	for _, n := range ns {
		if n.Value == "" {
			anyKey[n.Key] = true
		} else if n.Value == policies.AnyValue {
			starKey[n.Key] = true
		}
	}
	for _, n := range ns {
		switch {
		case strings.HasSuffix(n.Value, "*") && n.Value != policies.AnyValue:
			return c.unsupportedAt(cfg, n, fmt.Sprintf("value %q matches by prefix; a limitmesh match is an exact value or \"*\" (any value): list the values, or use a key without a value", n.Value))
		case n.Value == policies.AnyValue && anyKey[n.Key]:
			return c.unsupportedAt(cfg, n, fmt.Sprintf("value \"*\" and a descriptor of key %q without a value at one level: envoyproxy/ratelimit never reaches the one without a value; remove it", n.Key))
		case n.ShareThreshold:
			return c.unsupportedAt(cfg, n, "share_threshold (one counter for all values of a prefix wildcard) has no limitmesh equivalent")
		case n.Limit != nil && len(n.Limit.Replaces) > 0:
			return c.unsupportedAt(cfg, n, fmt.Sprintf("replaces %q: limitmesh applies every descriptor's policy, none drops another's; remove replaces (then both limits apply) or fold the override into one more specific descriptor", n.Limit.Replaces))
		}
		if n.DetailedMetric || n.ValueToMetric {
			c.note("%s:%d %s: %s: detailed_metric and value_to_metric have no effect: limitmesh metrics never carry descriptor values; per-key totals are in the usage ledger (limitmesh usage report --policy P)",
				cfg.File, n.Line, cfg.Domain, n.Path())
		}
		if n.Limit != nil && !n.Limit.Unlimited {
			kind := KindLimit
			if n.ShadowMode {
				kind = KindShadow
			}
			keys, match := c.pathOf(cfg, n)
			g := &gen{cfg: cfg, kind: kind, match: match, keys: keys, node: n}
			if err := c.add(g); err != nil {
				return err
			}
		}
		if err := c.walk(cfg, n.Children, n); err != nil {
			return err
		}
	}
	return nil
}

// distinct refuses two live policies with the same match: limitmesh would
// pick one by name, envoyproxy/ratelimit tells them apart by the order of
// the entries.
func (c *converter) distinct() error {
	seen := map[string]*gen{}
	for _, g := range c.gens {
		if g.kind == KindShadow {
			continue
		}
		id := identity(g.match)
		if o := seen[id]; o != nil {
			return c.unsupportedAt(g.cfg, g.node, fmt.Sprintf("the same keys and values as %s (line %d) in another order: limitmesh descriptors have no order", o.node.Path(), o.node.Line))
		}
		seen[id] = g
	}
	return nil
}

// add names g, writes its document, checks it with the node's parser and
// keeps it.
func (c *converter) add(g *gen) error {
	g.name = c.nameFor(g)
	doc, err := c.document(g)
	if err != nil {
		if g.node != nil {
			return c.errAt(g.cfg, g.node, err.Error())
		}
		return &Error{File: g.cfg.File, Path: g.cfg.Domain + ": " + g.path(), Reason: err.Error()}
	}
	p, err := c.o.Parse(g.name, doc)
	if err != nil {
		reason := "the policy is not valid: " + err.Error()
		if g.node != nil {
			return c.errAt(g.cfg, g.node, reason)
		}
		return &Error{File: g.cfg.File, Path: g.cfg.Domain + ": " + g.path(), Reason: reason}
	}
	g.doc, g.parsed = doc, p
	c.gens = append(c.gens, g)
	return nil
}

// nameFor proposes g's policy name: the domain, then each entry's
// dimension name and value, joined by '-', in [a-z0-9_-]; stand-ins end in
// "-unlimited". A name taken by another policy, or longer than 64 bytes,
// is cut and ends with a hash of what it stands for.
func (c *converter) nameFor(g *gen) string {
	var b strings.Builder
	b.WriteString(nameText(g.match[0].Value))
	for _, d := range g.match[1:] {
		b.WriteByte('-')
		b.WriteString(nameText(d.Name))
		if d.Value != policies.AnyValue {
			b.WriteByte('-')
			b.WriteString(nameText(d.Value))
		}
	}
	suffix := ""
	if g.kind == KindUnlimited {
		suffix = unlimitedSuffix
	}
	name := b.String()
	if name[0] == '_' || name[0] == '-' {
		name = "d" + name
	}
	id := identity(g.match) + g.kind
	if len(name)+len(suffix) > policies.MaxNameLen || (c.names[name+suffix] != "" && c.names[name+suffix] != id) {
		h := fnv.New32a()
		h.Write([]byte(id))
		tag := fmt.Sprintf("-%08x", h.Sum32())
		if cut := policies.MaxNameLen - len(suffix) - len(tag); len(name) > cut {
			name = name[:cut]
		}
		name += tag
	}
	name += suffix
	c.names[name] = id
	return name
}

// nameText maps s to policy-name characters: ASCII letters lower-cased,
// [a-z0-9_-] kept, anything else '_'.
func nameText(s string) string {
	out := make([]byte, 0, len(s))
	for _, r := range s {
		switch {
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9', r == '_', r == '-':
			out = append(out, byte(r))
		case r >= 'A' && r <= 'Z':
			out = append(out, byte(r-'A'+'a'))
		default:
			out = append(out, '_')
		}
	}
	if len(out) == 0 {
		return "_"
	}
	return string(out)
}

// document writes g's policy JSON: match (domain first, then the path in
// order), key (the dimensions matched by any value: a counter per value,
// as envoyproxy/ratelimit keeps one per distinct descriptor), the limit,
// shadow, the description.
func (c *converter) document(g *gen) ([]byte, error) {
	var b bytes.Buffer
	b.WriteString(`{"match":{`)
	key := []string{}
	for i, d := range g.match {
		if i > 0 {
			b.WriteByte(',')
		}
		writeJSON(&b, d.Name)
		b.WriteByte(':')
		writeJSON(&b, d.Value)
		if d.Value == policies.AnyValue {
			key = append(key, d.Name)
		}
	}
	b.WriteString(`},"key":`)
	if g.kind == KindUnlimited {
		key = []string{}
	}
	writeJSON(&b, key)
	b.WriteString(`,"limits":[`)
	desc := "envoyproxy/ratelimit " + g.cfg.Domain + ": " + g.path() + ": "
	if g.kind == KindUnlimited {
		fmt.Fprintf(&b, `{"name":"unlimited","algorithm":"fixed_window","limit":%s,"window":%q}],"mode":"local"`, unlimitedLimit, unlimitedWindow)
		desc += "no limit"
	} else {
		l := g.node.Limit
		lim, err := c.limit(l)
		if err != nil {
			return nil, err
		}
		b.Write(lim)
		b.WriteByte(']')
		if g.kind == KindShadow {
			b.WriteString(`,"shadow":true`)
		}
		desc += strconv.FormatUint(uint64(l.RequestsPerUnit), 10) + " per " + l.Unit
		if l.RequestsPerUnit == 0 {
			desc += " (denies every request)"
		}
		if g.kind == KindShadow {
			desc += ", shadow_mode"
		}
		if g.node.Line > 0 {
			desc += fmt.Sprintf(" (%s:%d)", filepath.Base(g.cfg.File), g.node.Line)
		}
	}
	if g.why != "" {
		desc += "; " + g.why
	}
	b.WriteString(`,"description":`)
	writeJSON(&b, cut(desc, policies.MaxDescription))
	b.WriteByte('}')
	return b.Bytes(), nil
}

// limit writes one limit object for l.
func (c *converter) limit(l *Limit) ([]byte, error) {
	n := strconv.FormatUint(uint64(l.RequestsPerUnit), 10)
	if l.RequestsPerUnit == 0 {
		n = zeroLimit
	}
	name := "per_" + l.Unit
	if l.Name != "" && validLimitName(l.Name) {
		name = l.Name
	}
	var b bytes.Buffer
	b.WriteString(`{"name":`)
	writeJSON(&b, name)
	switch {
	case l.Unit == "month" && c.o.CalendarMonth:
		fmt.Fprintf(&b, `,"algorithm":"quota","limit":%s,"period":"month"}`, n)
	case c.o.Algorithm == TokenBucket:
		per, ok := map[string]string{"second": "s", "minute": "m", "hour": "h", "day": "d"}[l.Unit]
		if !ok {
			return nil, fmt.Errorf("unit %s: a token_bucket rate is per second, minute, hour or day; use --algorithm fixed_window", l.Unit)
		}
		fmt.Fprintf(&b, `,"algorithm":"token_bucket","rate":"%s/%s","burst":%s}`, n, per, n)
	default:
		window := (secondsDuration(unitSeconds[l.Unit]))
		fmt.Fprintf(&b, `,"algorithm":%q,"limit":%s,"window":%q}`, c.o.Algorithm, n, window)
	}
	return b.Bytes(), nil
}

// secondsDuration writes s seconds as a Go duration: 1s, 1m, 1h, 24h, 168h.
func secondsDuration(s int64) string {
	switch {
	case s%3600 == 0:
		return strconv.FormatInt(s/3600, 10) + "h"
	case s%60 == 0:
		return strconv.FormatInt(s/60, 10) + "m"
	}
	return strconv.FormatInt(s, 10) + "s"
}

// validLimitName reports whether s is a limitmesh limit name, [a-z0-9_-]{1,64}.
func validLimitName(s string) bool {
	if len(s) == 0 || len(s) > policies.MaxNameLen {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}

func writeJSON(b *bytes.Buffer, v any) {
	enc := json.NewEncoder(b)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(v) // strings and string slices always encode
	b.Truncate(b.Len() - 1)
}

// cut shortens s to at most n bytes on a character boundary.
func cut(s string, n int) string {
	if len(s) <= n {
		return s
	}
	s = s[:n]
	for len(s) > 0 && !utf8.ValidString(s) {
		s = s[:len(s)-1]
	}
	return s
}
