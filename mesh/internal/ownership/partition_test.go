package ownership

import (
	"fmt"
	"hash/fnv"
	"math"
	"testing"
)

// partsCases are partition counts to check PartitionOf with; MaxUint32
// keeps the whole 32-bit hash (every vector below is smaller).
var partsCases = []int{1, 7, 64, 4096, 65536, math.MaxUint32}

// TestPartitionOfVectors: PartitionOf is FNV-1a (32 bit) modulo the
// partition count, pinned by the published FNV-1a test vectors, so the
// mapping of keys to partitions (and to shard subjects) cannot drift.
func TestPartitionOfVectors(t *testing.T) {
	for _, v := range []struct {
		key  string
		hash uint32
	}{
		{"", 0x811c9dc5}, // the offset basis
		{"a", 0xe40c292c},
		{"ab", 0x4d2505ca},
		{"abc", 0x1a47e90b},
		{"foobar", 0xbf9cf968},
	} {
		for _, parts := range partsCases {
			if got, want := PartitionOf(v.key, parts), int(v.hash%uint32(parts)); got != want {
				t.Errorf("PartitionOf(%q, %d) = %d, want %d (FNV-1a %#08x)", v.key, parts, got, want, v.hash)
			}
		}
	}
}

// TestPartitionOfIsFNV1a: PartitionOf agrees with the standard library's
// FNV-1a on limit keys and on bytes outside ASCII.
func TestPartitionOfIsFNV1a(t *testing.T) {
	keys := []string{"\x00", "\xff\xfe", "p.slow.tenant=é", "p.slow.tenant=\u4e16\u754c"}
	for i := range 200 {
		keys = append(keys, fmt.Sprintf("p.slow.tenant=t%d", i))
	}
	for _, key := range keys {
		h := fnv.New32a()
		h.Write([]byte(key))
		for _, parts := range partsCases {
			if got, want := PartitionOf(key, parts), int(h.Sum32()%uint32(parts)); got != want {
				t.Fatalf("PartitionOf(%q, %d) = %d, want %d", key, parts, got, want)
			}
		}
	}
}
