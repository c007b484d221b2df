// Package policyset is the node's view of the policy bucket: the snapshot
// of live policies in force (swapped atomically, read without locks on
// every decision), recent versions of each policy for state transitions
// (§28), the node's own validation rules on top of policies.Parse, and the
// watcher that applies the bucket's changes.
//
// Candidate policies ("shadow": true, CONTRACT §7) are never live: they
// are evaluated off the decision path by the shadow evaluator, so they are
// not in the snapshot.
//
// policyset imports policies and keyrec.
package policyset

import (
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/policies"
)

// MaxVersions is how many versions of each policy a Set keeps in memory
// for state transitions (§28); older ones are read from the policy
// bucket's history when a stored record needs them.
const MaxVersions = 16

// Version is one version of a policy and the instant (Unix ns) its KV
// revision was written.
type Version struct {
	P       *policies.Policy
	Created int64
}

// Set holds the snapshot of live policies and recent versions of each
// policy. Its methods are safe for concurrent use; Snapshot never locks.
type Set struct {
	snap atomic.Pointer[policies.Snapshot]

	mu       sync.Mutex
	versions map[string][]Version // oldest first
}

// New returns an empty Set.
func New() *Set {
	s := &Set{versions: make(map[string][]Version)}
	s.snap.Store(policies.NewSnapshot(nil))
	return s
}

// Snapshot returns the live policies in force.
func (s *Set) Snapshot() *policies.Snapshot { return s.snap.Load() }

// Current returns the live policy named name, or nil.
func (s *Set) Current(name string) *policies.Policy { return s.snap.Load().Get(name) }

// Version returns version rev of policy name and the instant (Unix ns) it
// was written, if the Set knows it.
func (s *Set) Version(name string, rev uint64) (*policies.Policy, int64, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, v := range s.versions[name] {
		if v.P.Revision == rev {
			return v.P, v.Created, true
		}
	}
	return nil, 0, false
}

// Missing reports whether version rev of policy name is neither in force
// nor remembered: a stored record written under it needs it fetched
// (Watcher.FetchVersion) before the §28 transition can be exact.
func (s *Set) Missing(name string, rev uint64) bool {
	if name == "" {
		return false
	}
	if cur := s.Current(name); cur != nil && cur.Revision == rev {
		return false
	}
	_, _, ok := s.Version(name, rev)
	return !ok
}

// Remember adds a version, keeping the newest MaxVersions of its policy.
func (s *Set) Remember(v Version) {
	s.mu.Lock()
	defer s.mu.Unlock()
	vs := s.versions[v.P.Name]
	for _, o := range vs {
		if o.P.Revision == v.P.Revision {
			return
		}
	}
	vs = append(vs, v)
	// Keep revision order so trimming drops the oldest.
	for i := len(vs) - 1; i > 0 && vs[i].P.Revision < vs[i-1].P.Revision; i-- {
		vs[i], vs[i-1] = vs[i-1], vs[i]
	}
	if len(vs) > MaxVersions {
		vs = vs[len(vs)-MaxVersions:]
	}
	s.versions[v.P.Name] = vs
}

// Put remembers p (written at created, Unix ns) and makes it the version
// in force: live, unless it is a candidate (then it stops being live).
func (s *Set) Put(p *policies.Policy, created int64) {
	s.Remember(Version{P: p, Created: created})
	if p.Shadow {
		s.Remove(p.Name)
		return
	}
	s.snap.Store(s.snap.Load().With(p))
}

// Remove stops policy name from applying.
func (s *Set) Remove(name string) {
	if s.snap.Load().Get(name) != nil {
		s.snap.Store(s.snap.Load().Without(name))
	}
}

// Parse parses one policy entry and applies this node's rules on top of
// policies.Parse: every mode is implemented; a leased policy may not have
// a concurrency limit (slots are held and released, not spent: they
// cannot be granted ahead). rev is the entry's KV revision.
func Parse(name string, value []byte, rev uint64) (*policies.Policy, error) {
	p, err := policies.Parse(name, value)
	if err != nil {
		return nil, err
	}
	switch p.Mode {
	case policies.ModeStrict, policies.ModeAsync, policies.ModeLocal:
	case policies.ModeLeased:
		for i, l := range p.Limits {
			if l.Algorithm == kvstate.Concurrency {
				return nil, &policies.Error{Path: "limits[" + strconv.Itoa(i) + "].algorithm", Reason: `"concurrency" cannot be leased`}
			}
		}
	default:
		return nil, &policies.Error{Path: "mode", Reason: strconv.Quote(p.Mode.String()) + " is not implemented by this node"}
	}
	p.Revision = rev
	return p, nil
}
