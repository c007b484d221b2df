package policies

import (
	"crypto/sha256"
	"encoding/hex"
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
