// Package rlconfig reads envoyproxy/ratelimit's YAML configuration (one
// domain per file: nested descriptors with rate limits) and converts it to
// limitmesh policies that decide the requests Envoy sends the way
// envoyproxy/ratelimit would (`limitmesh policy import-envoy`).
//
// The conversion is a pure function of the files and [Options]: no I/O, no
// clock. Its rules are in deploy/envoy/README.md; in short, every
// descriptor with a rate limit becomes one policy whose match is the
// descriptor's path (the request's domain and each entry, a key without a
// value matching any value), and a check replays every request of the
// configured shapes through envoyproxy/ratelimit's lookup and limitmesh's
// matching, adding policies until both pick the same limit for each
// (see check.go).
//
// rlconfig imports policies (the descriptor and matching rules); the
// caller hands it the node's policy parser and the Envoy mapping of keys to
// dimension names, so that what it prints is what a node accepts and what
// the gRPC bridge sends.
package rlconfig

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"strings"

	"go.yaml.in/yaml/v3"
)

// Units are envoyproxy/ratelimit's rate limit units (the RateLimit.Unit
// enum of Envoy's rls.proto, lower-cased) and the length of the fixed
// window envoyproxy/ratelimit counts in: windows are aligned to multiples
// of it since the Unix epoch (a month is 30 days and a year 365, unless
// envoyproxy/ratelimit runs with calendar months).
var unitSeconds = map[string]int64{
	"second": 1,
	"minute": 60,
	"hour":   3600,
	"day":    86400,
	"week":   7 * 86400,
	"month":  30 * 86400,
	"year":   365 * 86400,
}

// Config is one envoyproxy/ratelimit configuration file.
type Config struct {
	File        string  // the name errors give
	Domain      string  // required, non-empty
	Descriptors []*Node // the top level
}

// Node is one descriptor of a configuration: a key, an optional value, an
// optional rate limit and nested descriptors.
type Node struct {
	Key   string
	Value string // "" matches any value of Key
	Limit *Limit // nil: no rate_limit block

	ShadowMode     bool
	DetailedMetric bool
	ValueToMetric  bool
	ShareThreshold bool

	Children []*Node
	Line     int // of the descriptor in its file

	parent *Node
}

// Limit is a descriptor's rate_limit block.
type Limit struct {
	Unit            string // lower case, a key of unitSeconds; "" when Unlimited
	RequestsPerUnit uint32
	Unlimited       bool
	Name            string
	Replaces        []string
}

// Error is a configuration that cannot be read or converted: File and Line
// say where (Line 0: the whole file), Path which descriptor
// ("rl: foo > bar=banned"), Reason what is wrong.
type Error struct {
	File   string
	Line   int
	Path   string
	Reason string
	// Unsupported: envoyproxy/ratelimit accepts it, limitmesh cannot
	// reproduce it (the error matches ErrUnsupported).
	Unsupported bool
}

func (e *Error) Error() string {
	var b strings.Builder
	b.WriteString(e.File)
	if e.Line > 0 {
		fmt.Fprintf(&b, ":%d", e.Line)
	}
	if e.Path != "" {
		b.WriteString(": ")
		b.WriteString(e.Path)
	}
	b.WriteString(": ")
	b.WriteString(e.Reason)
	return b.String()
}

// ErrUnsupported is matched (errors.Is) by every [Error] for a
// configuration that envoyproxy/ratelimit accepts but limitmesh cannot
// reproduce (replaces, prefix wildcards, share_threshold, descriptor
// orders that only differ in order, ...).
var ErrUnsupported = errors.New("cannot be mapped to limitmesh policies")

// Unwrap returns ErrUnsupported for an unsupported configuration, else nil.
func (e *Error) Unwrap() error {
	if e.Unsupported {
		return ErrUnsupported
	}
	return nil
}

// Path returns the node's path in its domain, for messages:
// "foo > bar=banned".
func (n *Node) Path() string {
	var parts []string
	for m := n; m != nil; m = m.parent {
		p := m.Key
		if m.Value != "" {
			p += "=" + m.Value
		}
		parts = append(parts, p)
	}
	for i, j := 0, len(parts)-1; i < j; i, j = i+1, j-1 {
		parts[i], parts[j] = parts[j], parts[i]
	}
	return strings.Join(parts, " > ")
}

// Parse reads one configuration file as envoyproxy/ratelimit does, and as
// strictly: unknown keys, an empty domain or key, an invalid unit, a unit
// beside unlimited, and two descriptors with the same composite key
// (key_value) at one level are errors. A file holds one YAML document.
func Parse(file string, data []byte) (*Config, error) {
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil {
		if err == io.EOF {
			return nil, &Error{File: file, Reason: "empty file: want a domain and its descriptors"}
		}
		return nil, &Error{File: file, Reason: "YAML: " + err.Error()}
	}
	var extra yaml.Node
	if err := dec.Decode(&extra); err != io.EOF {
		line := extra.Line
		if err != nil {
			line = 0
		}
		return nil, &Error{File: file, Line: line, Reason: "more than one YAML document: envoyproxy/ratelimit reads one domain per file"}
	}
	p := parser{file: file}
	root := resolve(&doc)
	if root.Kind == yaml.DocumentNode && len(root.Content) == 1 {
		root = resolve(root.Content[0])
	}
	cfg := &Config{File: file}
	err := p.mapping(root, func(k string, v *yaml.Node) error {
		switch k {
		case "domain":
			s, err := p.str(v, k)
			cfg.Domain = s
			return err
		case "descriptors":
			ns, err := p.descriptors(v, nil)
			cfg.Descriptors = ns
			return err
		}
		return p.errorf(v, "unknown key %q (a file has domain and descriptors)", k)
	})
	if err != nil {
		return nil, err
	}
	if cfg.Domain == "" {
		return nil, &Error{File: file, Line: root.Line, Reason: "the domain is empty"}
	}
	return cfg, nil
}

type parser struct{ file string }

func (p *parser) errorf(n *yaml.Node, format string, a ...any) error {
	return &Error{File: p.file, Line: n.Line, Reason: fmt.Sprintf(format, a...)}
}

// resolve follows aliases.
func resolve(n *yaml.Node) *yaml.Node {
	for n != nil && n.Kind == yaml.AliasNode {
		n = n.Alias
	}
	return n
}

// mapping calls fn with each key and value of the mapping n, in order;
// a repeated key is an error.
func (p *parser) mapping(n *yaml.Node, fn func(k string, v *yaml.Node) error) error {
	n = resolve(n)
	if n.Kind != yaml.MappingNode {
		return p.errorf(n, "want a mapping")
	}
	seen := map[string]bool{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		kn, vn := resolve(n.Content[i]), resolve(n.Content[i+1])
		if kn.Kind != yaml.ScalarNode {
			return p.errorf(kn, "a key must be a string")
		}
		if seen[kn.Value] {
			return p.errorf(kn, "key %q repeated", kn.Value)
		}
		seen[kn.Value] = true
		if err := fn(kn.Value, vn); err != nil {
			return err
		}
	}
	return nil
}

func isNull(n *yaml.Node) bool { return n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null" }

// str reads a scalar as text (numbers and booleans as written, as
// envoyproxy/ratelimit's YAML library does); null is "".
func (p *parser) str(n *yaml.Node, what string) (string, error) {
	if n.Kind != yaml.ScalarNode {
		return "", p.errorf(n, "%s must be a string", what)
	}
	if isNull(n) {
		return "", nil
	}
	return n.Value, nil
}

func (p *parser) boolean(n *yaml.Node, what string) (bool, error) {
	if isNull(n) {
		return false, nil
	}
	var b bool
	if n.Kind != yaml.ScalarNode || n.Decode(&b) != nil {
		return false, p.errorf(n, "%s must be true or false", what)
	}
	return b, nil
}

func (p *parser) descriptors(n *yaml.Node, parent *Node) ([]*Node, error) {
	if isNull(n) {
		return nil, nil
	}
	if n.Kind != yaml.SequenceNode {
		return nil, p.errorf(n, "descriptors must be a list")
	}
	var out []*Node
	seen := map[string]int{}
	for _, c := range n.Content {
		c = resolve(c)
		d, err := p.descriptor(c, parent)
		if err != nil {
			return nil, err
		}
		composite := d.Key
		if d.Value != "" {
			composite += "_" + d.Value
		}
		if line, dup := seen[composite]; dup {
			return nil, &Error{File: p.file, Line: c.Line, Path: d.Path(),
				Reason: fmt.Sprintf("duplicate descriptor composite key %q (also on line %d)", composite, line)}
		}
		seen[composite] = c.Line
		out = append(out, d)
	}
	return out, nil
}

func (p *parser) descriptor(n *yaml.Node, parent *Node) (*Node, error) {
	d := &Node{Line: n.Line, parent: parent}
	var children *yaml.Node
	err := p.mapping(n, func(k string, v *yaml.Node) error {
		var err error
		switch k {
		case "key":
			d.Key, err = p.str(v, k)
		case "value":
			d.Value, err = p.str(v, k)
		case "rate_limit":
			d.Limit, err = p.limit(v)
		case "shadow_mode":
			d.ShadowMode, err = p.boolean(v, k)
		case "detailed_metric":
			d.DetailedMetric, err = p.boolean(v, k)
		case "value_to_metric":
			d.ValueToMetric, err = p.boolean(v, k)
		case "share_threshold":
			d.ShareThreshold, err = p.boolean(v, k)
		case "descriptors":
			children = v
		default:
			err = p.errorf(v, "unknown key %q in a descriptor", k)
		}
		return err
	})
	if err != nil {
		return nil, err
	}
	if d.Key == "" {
		return nil, p.errorf(n, "descriptor has an empty key")
	}
	if children != nil {
		if d.Children, err = p.descriptors(children, d); err != nil {
			return nil, err
		}
	}
	return d, nil
}

func (p *parser) limit(n *yaml.Node) (*Limit, error) {
	if isNull(n) {
		return nil, nil
	}
	l := &Limit{}
	err := p.mapping(n, func(k string, v *yaml.Node) error {
		var err error
		switch k {
		case "unit":
			var s string
			s, err = p.str(v, k)
			l.Unit = strings.ToLower(s)
		case "requests_per_unit":
			if v.Kind != yaml.ScalarNode || v.ShortTag() != "!!int" || v.Decode(&l.RequestsPerUnit) != nil {
				err = p.errorf(v, "requests_per_unit must be a whole number 0..4294967295")
			}
		case "unlimited":
			l.Unlimited, err = p.boolean(v, k)
		case "name":
			l.Name, err = p.str(v, k)
		case "replaces":
			if isNull(v) {
				return nil
			}
			if v.Kind != yaml.SequenceNode {
				return p.errorf(v, "replaces must be a list of {name: ...}")
			}
			for _, r := range v.Content {
				var name string
				err = p.mapping(r, func(k string, v *yaml.Node) error {
					if k != "name" {
						return p.errorf(v, "unknown key %q in replaces", k)
					}
					var err error
					name, err = p.str(v, k)
					return err
				})
				if err != nil {
					return err
				}
				if name == "" {
					return p.errorf(r, "replaces has an empty name")
				}
				l.Replaces = append(l.Replaces, name)
			}
		default:
			err = p.errorf(v, "unknown key %q in rate_limit", k)
		}
		return err
	})
	if err != nil {
		return nil, err
	}
	_, valid := unitSeconds[l.Unit]
	switch {
	case l.Unlimited && valid:
		return nil, p.errorf(n, "should not specify rate limit unit when unlimited")
	case l.Unlimited:
		l.Unit = ""
	case !valid:
		return nil, p.errorf(n, "invalid rate limit unit %q (second, minute, hour, day, week, month or year)", l.Unit)
	}
	return l, nil
}
