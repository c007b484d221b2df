package sim

// Leased mode (docs/protocol.md, "Leased mode"): the "leased" policy's
// keys are spent by holders on every node. Each node incarnation runs
// leasing's real Leasing (its Holder and Owner) on its runtime: a node's
// service spends a plain decide request from the node's grants
// (Holder.Spend) or, when no grant holds it, has the key's owner decide it
// like a strict one; the holder asks for grants, and every tick of its
// clock reports, returns and asks. Its requests to the key's owner cross
// the simulated network (lost, delayed, cut) to the node subscribed to the
// partition's lease subject, whose Owner applies them through its key core
// in its epoch: the grants live in the key's journalled record, so a new
// owner reads them back. What the gateways add (sub-grants) is not
// modelled.

// The leased policy: a token bucket whose grants hold at most
// leasedSize units, at most leasedMaxOut outstanding, for leasedTTL.
const (
	leasedPolicy = `{"match":{"kind":"leased"},"key":["k"],"limits":[{"algorithm":"token_bucket","rate":"20/s","burst":10}],` +
		`"mode":"leased","lease":{"size":4,"max_outstanding":12,"ttl":"2s"}}`
	leasedRate   = 20
	leasedBurst  = 10
	leasedMaxOut = 12
	leasedKeys   = 2
	// leasedLoad is the leased clients' decide requests per simulated
	// second, over the leased keys: half as much again as the keys'
	// rate, so the grants and max_outstanding bind.
	leasedLoad = 48
)

// leasedClients issue decide requests of the leased keys until end
// (global ns), as clients does for the others.
func (s *Sim) leasedClients(end int64) {
	var next func()
	next = func() {
		if s.s.now >= end {
			return
		}
		k := s.leased[s.s.rng.IntN(len(s.leased))]
		n := s.nodes[s.s.rng.IntN(len(s.nodes))]
		s.decide(k, n)
		gap := int64(s.s.rng.ExpFloat64() / leasedLoad * 1e9)
		s.s.after(max(gap, 1), nil, next)
	}
	s.s.after(int64(s.cfg.Lease), nil, next)
}
