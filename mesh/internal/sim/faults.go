package sim

import (
	"slices"
	"strings"

	"github.com/limitmesh/limitmesh/mesh/internal/ownership"
)

func slicesSortEntries(es []ownership.Entry) {
	slices.SortFunc(es, func(a, b ownership.Entry) int { return strings.Compare(a.Key, b.Key) })
}

// fault injects one fault, then schedules the next.
func (s *Sim) fault() {
	if !s.faulty {
		return
	}
	lease := int64(s.cfg.Lease)
	n := s.nodes[s.s.rng.IntN(len(s.nodes))]
	switch k := s.s.rng.IntN(7); {
	case k == 0 && n.up && s.upCount() > 1:
		s.logf("%s crashes", n.id)
		n.crash()
		s.s.after(s.s.between(lease/2, 3*lease), nil, func() {
			if !n.up {
				s.logf("%s restarts", n.id)
				n.start()
			}
		})
	case k == 1 && n.up && s.upCount() > 1:
		// A graceful stop: the node leaves (hands its partitions over),
		// then stops; it comes back later.
		s.logf("%s leaves", n.id)
		life := n.life
		n.lease.Return(func() {}) // as the node does before it hands its partitions over
		n.m.Owner.Leave(s.cfg.Timeout*10, func(err error) {
			if n.life != life || !n.up {
				return
			}
			s.logf("%s left (%v) and stops", n.id, err)
			n.crash()
			s.s.after(s.s.between(lease/2, 3*lease), nil, func() {
				if !n.up {
					s.logf("%s restarts", n.id)
					n.start()
				}
			})
		})
	case k == 2 && n.up && !n.cut:
		s.logf("%s cut off", n.id)
		n.cut = true
		life := n.life
		s.s.after(s.s.between(lease/5, 3*lease), nil, func() {
			if n.life == life && n.up && n.cut {
				s.logf("%s reconnects", n.id)
				n.heal()
			}
		})
	case k == 3 && n.up && n.stale == nil:
		s.logf("%s reads from a cut-off leader", n.id)
		n.stale = map[*stream]uint64{s.shards: s.shards.last(), s.state: s.state.last(), s.journal: s.journal.last()}
		life := n.life
		s.s.after(s.s.between(lease/10, 2*lease), nil, func() {
			if n.life == life {
				s.logf("%s reads from the leader again", n.id)
				n.stale = nil
			}
		})
	case k == 5 && n.up && !n.stalled:
		s.logf("%s's watch stalls", n.id)
		n.stalled = true
		life := n.life
		s.s.after(s.s.between(lease/2, 5*lease), nil, func() {
			if n.life == life && n.up && n.stalled && !n.cut {
				s.logf("%s's watch resumes", n.id)
				n.heal()
			}
		})
	case k == 6 && n.up && n.pausedUntil <= s.s.now:
		d := s.s.between(lease/10, 2*lease)
		s.logf("%s pauses for %.3fs", n.id, float64(d)/1e9)
		n.pausedUntil = s.s.now + d
	case k == 4:
		st := []*stream{s.shards, s.state, s.journal}[s.s.rng.IntN(3)]
		d := s.s.between(lease/10, 3*lease/2)
		s.logf("stream %s elects a leader for %.3fs", st.name, float64(d)/1e9)
		st.down = s.s.now + d
	}
	s.s.after(s.s.between(lease/4, 2*lease), nil, s.fault)
}

func (s *Sim) upCount() int {
	k := 0
	for _, n := range s.nodes {
		if n.up {
			k++
		}
	}
	return k
}

// heal ends every fault: nodes restart and reconnect, streams answer, reads
// are current; from here on the mesh must converge.
func (s *Sim) heal() {
	s.faulty = false
	s.logf("faults end")
	for _, st := range []*stream{s.shards, s.state, s.journal} {
		st.down = 0
	}
	for _, n := range s.nodes {
		switch {
		case !n.up:
			s.logf("%s restarts", n.id)
			n.start()
		case n.cut || n.stalled:
			n.heal()
		}
		n.stale = nil
	}
}
