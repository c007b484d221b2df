package envoy

import (
	"errors"
	"strings"
	"testing"
	"unicode/utf8"

	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/limitmesh/limitmesh/policies"
)

func TestDimensionName(t *testing.T) {
	long := "x-very-long-header-name-that-goes-on-and-on"
	for _, tc := range []struct{ key, want string }{
		{"generic_key", "generic_key"},
		{"remote_address", "remote_address"},
		{"destination_cluster", "destination_cluster"},
		{"X-User-Id", "x_user_id"},
		{"x-user-id", "x_user_id"},
		{"Path", "path"},
		{"1st", "k_1st"},
		{"_private", "k__private"},
		{"", "k_"},
		{"é", "k__"},           // one character, one '_'
		{"a\xff\xfeb", "a__b"}, // one '_' per invalid byte
		{"user.id", "user_id"},
		{"abcdefghijklmnopqrstuvwxyz012345", "abcdefghijklmnopqrstuvwxyz012345"}, // 32: kept
		{"abcdefghijklmnopqrstuvwxyz0123456", "abcdefghijklmnopqrstu_" + fnvHex("abcdefghijklmnopqrstuvwxyz0123456")},
		{long, "x_very_long_header_na_" + fnvHex("x_very_long_header_name_that_goes_on_and_on")},
	} {
		if got := DimensionName(tc.key); got != tc.want {
			t.Errorf("DimensionName(%q) = %q, want %q", tc.key, got, tc.want)
		}
	}
}

// fnvHex is the documented hash suffix, computed the slow way.
func fnvHex(s string) string {
	h := uint64(14695981039346656037)
	for i := 0; i < len(s); i++ {
		h ^= uint64(s[i])
		h *= 1099511628211
	}
	const digits = "0123456789abcdef"
	out := make([]byte, 16)
	for i := 15; i >= 0; i-- {
		out[i] = digits[h&15]
		h >>= 4
	}
	return string(out[:10])
}

func entries(kv ...string) *ratelimitv3.RateLimitDescriptor {
	d := &ratelimitv3.RateLimitDescriptor{}
	for i := 0; i+1 < len(kv); i += 2 {
		d.Entries = append(d.Entries, &ratelimitv3.RateLimitDescriptor_Entry{Key: kv[i], Value: kv[i+1]})
	}
	return d
}

// descString renders a descriptor as name=value,... (sorted by name).
func descString(d policies.Descriptor) string {
	var b strings.Builder
	for i, dim := range d {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(dim.Name + "=" + dim.Value)
	}
	return b.String()
}

func TestMap(t *testing.T) {
	withHits := func(d *ratelimitv3.RateLimitDescriptor, h uint64) *ratelimitv3.RateLimitDescriptor {
		d.HitsAddend = wrapperspb.UInt64(h)
		return d
	}
	for _, tc := range []struct {
		name   string
		domain string
		d      *ratelimitv3.RateLimitDescriptor
		hits   uint32
		want   string // descriptor, or "refused: <substring>"
		cost   int64
		dry    bool
		skip   bool
	}{
		{"plain", "edge", entries("remote_address", "10.0.0.1"), 0, "domain=edge,remote_address=10.0.0.1", 1, false, false},
		{"request hits", "edge", entries("generic_key", "a"), 5, "domain=edge,generic_key=a", 5, false, false},
		{"descriptor hits win", "edge", withHits(entries("generic_key", "a"), 7), 5, "domain=edge,generic_key=a", 7, false, false},
		{"descriptor hits 0: dry run", "edge", withHits(entries("generic_key", "a"), 0), 5, "domain=edge,generic_key=a", 1, true, false},
		{"empty domain: no domain entry", "", entries("generic_key", "a"), 0, "generic_key=a", 1, false, false},
		{"no entries: the domain alone", "edge", entries(), 0, "domain=edge", 1, false, false},
		{"odd keys", "edge", entries("X-User-Id", "u1", ":path", "/a"), 0, "domain=edge,k__path=/a,x_user_id=u1", 1, false, false},
		{"repeated keys", "edge", entries("generic_key", "a", "generic_key", "b", "generic_key", "c"), 0,
			"domain=edge,generic_key=a,generic_key_2=b,generic_key_3=c", 1, false, false},
		{"an entry named domain", "edge", entries("domain", "other"), 0, "domain=edge,domain_2=other", 1, false, false},
		{"keys that map alike", "edge", entries("X-Id", "1", "x-id", "2"), 0, "domain=edge,x_id=1,x_id_2=2", 1, false, false},
		{"a suffix on a 32-byte name is cut in", "", entries("abcdefghijklmnopqrstuvwxyz012345", "a", "abcdefghijklmnopqrstuvwxyz012345", "b"), 0,
			"abcdefghijklmnopqrstuvwxyz012345=a,abcdefghijklmnopqrstuvwxyz0123_2=b", 1, false, false},
		{"values keep spaces and UTF-8", "edge", entries("user", "Zoë Smith"), 0, "domain=edge,user=Zoë Smith", 1, false, false},
		{"value of 128 bytes", "", entries("k", strings.Repeat("v", 128)), 0, "k=" + strings.Repeat("v", 128), 1, false, false},
		{"refund", "edge", &ratelimitv3.RateLimitDescriptor{IsNegativeHits: true}, 0, "", 0, false, true},

		{"value of 129 bytes", "", entries("k", strings.Repeat("v", 129)), 0, "refused: 129 bytes", 0, false, false},
		{"empty value", "edge", entries("k", ""), 0, "refused: value is empty", 0, false, false},
		{"invalid UTF-8", "edge", entries("k", "a\xffb"), 0, "refused: not valid UTF-8", 0, false, false},
		{"control character", "edge", entries("k", "a\nb"), 0, "refused: control character", 0, false, false},
		{"invalid domain", "bad\x00domain", entries("k", "v"), 0, "refused: descriptor.domain", 0, false, false},
		{"no domain, no entries", "", entries(), 0, "refused: no dimensions", 0, false, false},
		{"16 dimensions", "edge", entries(manyKV(15)...), 0, "", 1, false, false},
		{"17 dimensions", "edge", entries(manyKV(16)...), 0, "refused: 17 dimensions", 0, false, false},
		{"request hits above the largest cost", "edge", entries("k", "v"), MaxCost + 1, "refused: hits_addend 1000000001", 0, false, false},
		{"descriptor hits above the largest cost", "edge", withHits(entries("k", "v"), 1<<40), 0, "refused: hits_addend", 0, false, false},
		{"nil descriptor", "edge", nil, 0, "domain=edge", 1, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, err := Map(tc.domain, tc.d, tc.hits)
			if want, ok := strings.CutPrefix(tc.want, "refused: "); ok {
				if !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), want) {
					t.Fatalf("Map = %+v, %v; want a refusal naming %q", m, err, want)
				}
				return
			}
			if err != nil {
				t.Fatalf("Map: %v", err)
			}
			if m.Skip != tc.skip || m.DryRun != tc.dry || (!tc.skip && m.Cost != tc.cost) {
				t.Fatalf("Map = %+v; want cost %d, dry run %v, skip %v", m, tc.cost, tc.dry, tc.skip)
			}
			if tc.want != "" && descString(m.Descriptor) != tc.want {
				t.Fatalf("descriptor %s, want %s", descString(m.Descriptor), tc.want)
			}
		})
	}
}

func manyKV(n int) []string {
	var kv []string
	for i := range n {
		kv = append(kv, "k"+string(rune('a'+i)), "v")
	}
	return kv
}

// FuzzMap: Map never panics; it returns a valid descriptor (NewDescriptor
// accepts it again, with every entry and the domain in it, values byte for
// byte) and a cost in 1..MaxCost, or a refusal that matches ErrRefused;
// DimensionName always returns a valid name, keeps valid names, depends only
// on the normalized key, and is injective on canonical keys (the documented
// limit).
func FuzzMap(f *testing.F) {
	f.Add("edge", "X-User-Id", "u1", "generic_key", "a", uint32(0), uint64(0), false)
	f.Add("", "", "", "domain", "x", uint32(3), uint64(9), true)
	f.Add("d", "abcdefghijklmnopqrstuvwxyz0123456", "v", "abcdefghijklmnopqrstuvwxyz0123457", "w", uint32(1), uint64(0), false)
	f.Add("d\xff", "1st", "a\x7f", "é", strings.Repeat("x", 129), uint32(1<<31), uint64(1<<40), true)
	f.Fuzz(func(t *testing.T, domain, k1, v1, k2, v2 string, hits uint32, dh uint64, useDH bool) {
		for _, k := range []string{k1, k2} {
			name := DimensionName(k)
			if !validDimName(name) {
				t.Fatalf("DimensionName(%q) = %q: not a valid name", k, name)
			}
			if validDimName(k) && name != k {
				t.Fatalf("DimensionName(%q) = %q: a valid name must be kept", k, name)
			}
		}
		n1, n2 := string(normalizeKey(k1)), string(normalizeKey(k2))
		if validDimName(k1) {
			n1 = k1
		}
		if validDimName(k2) {
			n2 = k2
		}
		if same := DimensionName(k1) == DimensionName(k2); same != (n1 == n2) {
			t.Fatalf("keys %q and %q: names %q and %q, normalized %q and %q", k1, k2, DimensionName(k1), DimensionName(k2), n1, n2)
		}

		d := entries(k1, v1, k2, v2)
		if useDH {
			d.HitsAddend = wrapperspb.UInt64(dh)
		}
		m, err := Map(domain, d, hits)
		if err != nil {
			if !errors.Is(err, ErrRefused) {
				t.Fatalf("Map: %v does not match ErrRefused", err)
			}
			return
		}
		if m.Cost < 1 || m.Cost > MaxCost {
			t.Fatalf("cost %d", m.Cost)
		}
		again := append(policies.Descriptor(nil), m.Descriptor...)
		if _, err := policies.NewDescriptor(again); err != nil {
			t.Fatalf("Map gave an invalid descriptor %v: %v", m.Descriptor, err)
		}
		want := map[string]int{v1: 0, v2: 0}
		if domain != "" {
			if v, ok := m.Descriptor.Get(DomainDimension); !ok || v != domain {
				t.Fatalf("domain %q not in %v", domain, m.Descriptor)
			}
			want[domain] = 0
		}
		count := 0
		for _, dim := range m.Descriptor {
			if !utf8.ValidString(dim.Value) {
				t.Fatalf("invalid value kept: %q", dim.Value)
			}
			if _, ok := want[dim.Value]; !ok {
				t.Fatalf("value %q is none of the request's", dim.Value)
			}
			count++
		}
		if wantN := 2 + btoi(domain != ""); count != wantN {
			t.Fatalf("%d dimensions, want %d: %v", count, wantN, m.Descriptor)
		}
	})
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}
