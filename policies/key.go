package policies

import (
	"crypto/sha256"
	"encoding/hex"
	"strings"
)

// Limit keys. The state of one limit key (all the limits of one policy for
// one combination of key-dimension values) is stored under one JetStream KV
// key built by [Policy.AppendLimitKey]. The encoding is part of the stored
// data: changing it orphans every stored state, so it is pinned by golden
// tests and documented in KEYS.md. Version 1:
//
//	literal form   p.<policy>{.<dim>=<escaped value>}   dims in key order (sorted by name)
//	digest form    p.<policy>._h<64 lowercase hex>     when the literal form is over 256 bytes
//
// A policy without key dimensions has the single key "p.<policy>".
//
// Escaping: the bytes [A-Za-z0-9-] of a value are kept; every other byte
// (including '_', '.', '=', '/', space and every byte of a multi-byte UTF-8
// character) becomes '_' followed by its two lowercase hex digits. So
// "acme.eu_1" escapes to "acme_2eeu_5f1".
//
// Why it is injective: policy names ([a-z0-9][a-z0-9_-]*) and dimension
// names ([a-z][a-z0-9_]*) hold neither '.' nor '=', and an escaped value
// holds neither, so the dot-separated tokens and each "name=value" split
// are unambiguous, and the escaping is reversible. The digest form's last
// token starts with '_', which no literal token does (they start with a
// dimension name), and its digest is SHA-256 over the whole literal form,
// so two inputs share a digest key only through a SHA-256 collision.
//
// Every key matches ^[-/_=.a-zA-Z0-9]+$ with no empty dot-separated token,
// so it is a valid JetStream KV key, and it is at most [MaxKeyLen] bytes.

// MaxKeyLen is the most bytes in a limit key.
const MaxKeyLen = 256

// keepByte marks the bytes an escaped value keeps as they are.
var keepByte = func() (t [256]bool) {
	for c := 'a'; c <= 'z'; c++ {
		t[c] = true
		t[c-'a'+'A'] = true
	}
	for c := '0'; c <= '9'; c++ {
		t[c] = true
	}
	t['-'] = true
	return t
}()

const hexDigits = "0123456789abcdef"

// LimitKey returns the canonical state key of d under p (see
// [Policy.AppendLimitKey]).
func (p *Policy) LimitKey(d Descriptor) (string, error) {
	var buf [MaxKeyLen]byte
	b, err := p.AppendLimitKey(buf[:0], d)
	if err != nil {
		return "", err
	}
	return string(b), nil
}

// AppendLimitKey appends the canonical state key of d under p to dst: built
// from p's name and the names and values of p's key dimensions, in the
// version-1 encoding documented above and in KEYS.md. It is injective,
// bounded by MaxKeyLen bytes and a valid JetStream KV key. d must be a
// valid Descriptor (from [NewDescriptor]). If d lacks a key dimension the
// error is an [*Error] with Path "descriptor.<dim>" matching
// [ErrMissingDimension] (and [ErrInvalid]), and dst is returned unchanged.
// It allocates only when dst is too small or the digest form is needed.
func (p *Policy) AppendLimitKey(dst []byte, d Descriptor) ([]byte, error) {
	start := len(dst)
	dst = append(dst, "p."...)
	dst = append(dst, p.Name...)
	j := 0 // both p.Key and d are sorted: one merge walk
	for _, k := range p.Key {
		for j < len(d) && d[j].Name < k {
			j++
		}
		if j == len(d) || d[j].Name != k {
			return dst[:start], &Error{Path: "descriptor." + k,
				Reason: "missing; policy " + p.Name + " keys on it", Err: ErrMissingDimension}
		}
		dst = append(dst, '.')
		dst = append(dst, k...)
		dst = append(dst, '=')
		dst = appendEscaped(dst, d[j].Value)
	}
	if len(dst)-start <= MaxKeyLen {
		return dst, nil
	}
	sum := sha256.Sum256(dst[start:])
	dst = dst[:start]
	dst = append(dst, "p."...)
	dst = append(dst, p.Name...)
	dst = append(dst, "._h"...)
	return hex.AppendEncode(dst, sum[:]), nil
}

// OverflowKey returns the state key shared by every limit key of p beyond
// p.MaxKeys (CONTRACT.md §9; KEYS.md "Overflow key"):
// "p.<policy>._overflow". It is no limit key of any policy: its third
// token starts with "_o", while a literal key's third token starts with a
// dimension name, a digest key's with "_h", and a policy without key
// dimensions has the two-token key "p.<policy>". It is a valid JetStream KV
// key of at most 76 bytes.
func (p *Policy) OverflowKey() string { return "p." + p.Name + "." + overflowToken }

// overflowToken is the last token of an overflow key.
const overflowToken = "_overflow"

// appendEscaped appends v with every byte outside [A-Za-z0-9-] written as
// '_' and two lowercase hex digits.
func appendEscaped(dst []byte, v string) []byte {
	for i := 0; i < len(v); i++ {
		c := v[i]
		if keepByte[c] {
			dst = append(dst, c)
			continue
		}
		dst = append(dst, '_', hexDigits[c>>4], hexDigits[c&0xf])
	}
	return dst
}

// KeyCarries reports whether key is the literal-form limit key that a
// policy named policy keying on every dimension of d builds for d: then d
// can be recovered from key alone with [DescriptorOfKey]. The usage stream
// leaves out such a descriptor (CONTRACT.md §6a). d must be valid.
func KeyCarries(key, policy string, d Descriptor) bool {
	var buf [MaxKeyLen]byte
	b := append(buf[:0], "p."...)
	b = append(b, policy...)
	for _, dim := range d {
		if len(b) > len(key) {
			return false
		}
		b = append(b, '.')
		b = append(b, dim.Name...)
		b = append(b, '=')
		b = appendEscaped(b, dim.Value)
	}
	return string(b) == key
}

// DescriptorOfKey returns the descriptor a literal-form limit key of the
// policy named policy carries: one dimension per "name=value" token, the
// value unescaped. ok is false for a key that is not such a key (another
// policy's, a digest or overflow key, a key without dimensions) or whose
// dimensions do not make a valid Descriptor. For every valid d with
// KeyCarries(key, policy, d), DescriptorOfKey(key, policy) returns d.
func DescriptorOfKey(key, policy string) (Descriptor, bool) {
	if len(key) < len(policy)+3 || key[:2] != "p." || key[2:2+len(policy)] != policy || key[2+len(policy)] != '.' {
		return nil, false
	}
	rest := key[3+len(policy):]
	var dims []Dim
	for rest != "" {
		tok := rest
		if i := strings.IndexByte(rest, '.'); i >= 0 {
			tok, rest = rest[:i], rest[i+1:]
			if rest == "" {
				return nil, false
			}
		} else {
			rest = ""
		}
		eq := strings.IndexByte(tok, '=')
		if eq <= 0 {
			return nil, false
		}
		v, ok := unescapeValue(tok[eq+1:])
		if !ok {
			return nil, false
		}
		dims = append(dims, Dim{Name: tok[:eq], Value: v})
	}
	for i := 1; i < len(dims); i++ {
		if dims[i].Name <= dims[i-1].Name {
			return nil, false // a literal key's dimensions are sorted and unique
		}
	}
	d, err := NewDescriptor(dims)
	if err != nil {
		return nil, false
	}
	return d, true
}

// unescapeValue reverses appendEscaped; ok is false for text appendEscaped
// never writes (a kept byte outside [A-Za-z0-9-], an escape of a kept
// byte, upper-case hex).
func unescapeValue(s string) (string, bool) {
	plain := true
	for i := 0; i < len(s); i++ {
		if !keepByte[s[i]] {
			plain = false
			break
		}
	}
	if plain {
		return s, s != ""
	}
	out := make([]byte, 0, len(s))
	for i := 0; i < len(s); i++ {
		c := s[i]
		if keepByte[c] {
			out = append(out, c)
			continue
		}
		if c != '_' || i+2 >= len(s) {
			return "", false
		}
		h, l := unhex(s[i+1]), unhex(s[i+2])
		if h < 0 || l < 0 {
			return "", false
		}
		b := byte(h<<4 | l)
		if keepByte[b] {
			return "", false
		}
		out = append(out, b)
		i += 2
	}
	return string(out), len(out) > 0
}

func unhex(c byte) int {
	switch {
	case c >= '0' && c <= '9':
		return int(c - '0')
	case c >= 'a' && c <= 'f':
		return int(c-'a') + 10
	}
	return -1
}
