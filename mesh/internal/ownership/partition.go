package ownership

import "hash/fnv"

// PartitionOf returns the partition of a limit key: FNV-1a 32 of the key
// modulo parts. Every node and client must compute the same.
func PartitionOf(key string, parts int) int {
	h := uint32(2166136261)
	for i := 0; i < len(key); i++ {
		h ^= uint32(key[i])
		h *= 16777619
	}
	return int(h % uint32(parts))
}

// hrwScore is the rendezvous score of node for partition part.
func hrwScore(node string, part int) uint64 {
	h := fnv.New64a()
	h.Write([]byte(node))
	x := h.Sum64() ^ (uint64(part)+1)*0x9e3779b97f4a7c15
	// splitmix64 finalizer: spreads nearby partitions over all nodes.
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

// hrwTarget returns the node of nodes (non-empty, any order) with the
// highest score for part; ties go to the smaller id.
func hrwTarget(nodes []string, part int) string {
	best, bestScore := "", uint64(0)
	for _, id := range nodes {
		s := hrwScore(id, part)
		if best == "" || s > bestScore || (s == bestScore && id < best) {
			best, bestScore = id, s
		}
	}
	return best
}

// MaxPartitions bounds the partition count of a mesh.
const MaxPartitions = 4096
