package envoy

import (
	"fmt"
	"hash/fnv"
	"strconv"
	"unicode/utf8"

	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"

	"github.com/limitmesh/limitmesh/policies"
)

// The mapping of an Envoy request to limitmesh descriptors
// (docs/protocol.md, "The Envoy rate limit service", is its definition):
//
//   - the request's domain becomes the dimension "domain" (an empty domain
//     adds none); then each entry of the descriptor, in order, becomes the
//     dimension DimensionName(key) with the entry's value;
//   - a name already taken in the descriptor (Envoy allows repeated keys,
//     and an entry may map to "domain") gets the suffix "_2", "_3", ...: the
//     first free one, the name cut so that name and suffix fit 32 bytes;
//   - values are kept byte for byte and must be valid dimension values
//     (CONTRACT.md §2: 1..128 bytes of printable UTF-8); so must the domain;
//     a descriptor of more than 16 dimensions, domain included, of none, or
//     with an invalid value is refused ([ErrRefused]);
//   - the cost is the descriptor's own hits_addend when it has one, else the
//     request's (0 means 1); at most [MaxCost], else the descriptor is
//     refused; a descriptor hits_addend of 0 asks without spending: a dry
//     run of cost 1;
//   - a descriptor with is_negative_hits (a refund) is not decided: limitmesh
//     never raises a limit on a gateway's say-so; its status is OK;
//   - a descriptor's "limit" override is ignored: limits come from policies.

// DomainDimension is the dimension that carries the request's domain.
const DomainDimension = "domain"

// MaxCost is the largest hits_addend a descriptor may spend (the decide
// service's largest cost, CONTRACT.md §2); a larger one is refused.
const MaxCost = 1_000_000_000

// keyPrefix is put before a normalized key that does not start with a
// letter; keyHashLen is the hex digits of the hash that ends a long one.
const (
	keyPrefix  = "k_"
	keyHashLen = 10
)

// DimensionName maps an Envoy descriptor key to a limitmesh dimension name
// ([a-z][a-z0-9_]{0,31}):
//
//  1. a key that is already a valid name is kept (generic_key,
//     remote_address, header_match, destination_cluster, ...);
//  2. otherwise it is normalized: ASCII letters are lower-cased, [a-z0-9_]
//     kept, and every other character (a UTF-8 character, or one byte of
//     invalid UTF-8) becomes '_'; a result that does not start with a
//     letter (or is empty) gets the prefix "k_": "X-User-Id" is "x_user_id",
//     "1st" is "k_1st", "" is "k_";
//  3. a normalized name longer than 32 bytes keeps its first 21 bytes and
//     ends with '_' and the first 10 hex digits of the FNV-1a 64-bit hash
//     of the whole normalized name.
//
// So two keys map to the same name exactly when they normalize to the same
// string (they differ only in case or in characters outside [a-z0-9_], or
// "k_" stands for a leading non-letter), except for 40-bit hash collisions
// between long names: the mapping is injective on names of [a-z0-9_]
// starting with a letter, of any length. It never fails and never panics.
func DimensionName(key string) string {
	if validDimName(key) {
		return key
	}
	n := normalizeKey(key)
	if len(n) <= policies.MaxDimNameLen {
		return string(n)
	}
	h := fnv.New64a()
	_, _ = h.Write(n)
	sum := fmt.Sprintf("%016x", h.Sum64())
	cut := policies.MaxDimNameLen - 1 - keyHashLen
	return string(n[:cut]) + "_" + sum[:keyHashLen]
}

// normalizeKey is step 2 of DimensionName.
func normalizeKey(key string) []byte {
	out := make([]byte, 0, len(key)+len(keyPrefix))
	for i := 0; i < len(key); {
		c := key[i]
		switch {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9', c == '_':
			out = append(out, c)
			i++
		case c >= 'A' && c <= 'Z':
			out = append(out, c+('a'-'A'))
			i++
		case c < utf8.RuneSelf:
			out = append(out, '_')
			i++
		default:
			_, size := utf8.DecodeRuneInString(key[i:]) // 1 for an invalid byte
			out = append(out, '_')
			i += size
		}
	}
	if len(out) == 0 || out[0] < 'a' || out[0] > 'z' {
		out = append([]byte(keyPrefix), out...)
	}
	return out
}

// validDimName reports whether s matches [a-z][a-z0-9_]{0,31}.
func validDimName(s string) bool {
	if len(s) == 0 || len(s) > policies.MaxDimNameLen || s[0] < 'a' || s[0] > 'z' {
		return false
	}
	for i := 1; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_') {
			return false
		}
	}
	return true
}

// uniqueName returns name when no earlier dimension of dims has it, else
// name with the first free suffix "_2", "_3", ... (name cut to fit).
func uniqueName(dims []policies.Dim, name string) string {
	if !hasName(dims, name) {
		return name
	}
	for n := 2; ; n++ {
		suffix := "_" + strconv.Itoa(n)
		base := name
		if len(base)+len(suffix) > policies.MaxDimNameLen {
			base = base[:policies.MaxDimNameLen-len(suffix)]
		}
		if c := base + suffix; !hasName(dims, c) {
			return c
		}
	}
}

func hasName(dims []policies.Dim, name string) bool {
	for i := range dims {
		if dims[i].Name == name {
			return true
		}
	}
	return false
}

// Mapped is one Envoy descriptor ready to be decided.
type Mapped struct {
	// Descriptor is the limitmesh descriptor, valid per CONTRACT.md §2
	// (sorted by name).
	Descriptor policies.Descriptor
	// Cost is the whole units to spend, 1..MaxCost.
	Cost int64
	// DryRun: the descriptor's hits_addend was 0; ask without spending.
	DryRun bool
	// Skip: a refund (is_negative_hits); not decided, its status is OK.
	Skip bool
}

// Map maps descriptor d of a request with domain domain and request-level
// hits_addend hits to a limitmesh descriptor and cost (see the rules at the
// top of this file). An error wraps ErrRefused and says why; Map never
// panics, whatever d holds (nil included).
func Map(domain string, d *ratelimitv3.RateLimitDescriptor, hits uint32) (Mapped, error) {
	if d.GetIsNegativeHits() {
		return Mapped{Skip: true}, nil
	}
	m := Mapped{Cost: int64(max(hits, 1))}
	if h := d.GetHitsAddend(); h != nil {
		switch v := h.GetValue(); {
		case v == 0:
			m.Cost, m.DryRun = 1, true
		case v > MaxCost:
			return Mapped{}, fmt.Errorf("%w: hits_addend %d is above %d", ErrRefused, v, MaxCost)
		default:
			m.Cost = int64(v)
		}
	} else if m.Cost > MaxCost {
		return Mapped{}, fmt.Errorf("%w: hits_addend %d is above %d", ErrRefused, hits, MaxCost)
	}
	entries := d.GetEntries()
	n := len(entries)
	if domain != "" {
		n++
	}
	if n > policies.MaxDims {
		return Mapped{}, fmt.Errorf("%w: %d dimensions, domain included (at most %d)", ErrRefused, n, policies.MaxDims)
	}
	dims := make([]policies.Dim, 0, n)
	if domain != "" {
		dims = append(dims, policies.Dim{Name: DomainDimension, Value: domain})
	}
	for _, e := range entries {
		dims = append(dims, policies.Dim{Name: uniqueName(dims, DimensionName(e.GetKey())), Value: e.GetValue()})
	}
	desc, err := policies.NewDescriptor(dims)
	if err != nil {
		return Mapped{}, fmt.Errorf("%w: %w", ErrRefused, err)
	}
	m.Descriptor = desc
	return m, nil
}
