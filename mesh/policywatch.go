package mesh

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/limitmesh/limitmesh/policies"
	"github.com/nats-io/nats.go/jetstream"
)

// maxPolicyVersions is how many versions of each policy the node keeps in
// memory for state transitions (§28); older ones are read from the policy
// bucket's history when a stored record needs them.
const maxPolicyVersions = 16

// policyVersion is one version of a policy and the instant (ns) its KV
// revision was written.
type policyVersion struct {
	p       *policies.Policy
	created int64
}

// policySet holds the snapshot in force and recent versions of each
// policy. The snapshot is swapped atomically; readers never lock.
type policySet struct {
	snap atomic.Pointer[policies.Snapshot]

	mu       sync.Mutex
	versions map[string][]policyVersion // oldest first
}

func newPolicySet() *policySet {
	s := &policySet{versions: make(map[string][]policyVersion)}
	s.snap.Store(policies.NewSnapshot(nil))
	return s
}

// current implements policyEnv.
func (s *policySet) current(name string) *policies.Policy { return s.snap.Load().Get(name) }

// version implements policyEnv.
func (s *policySet) version(name string, rev uint64) (*policies.Policy, int64, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, v := range s.versions[name] {
		if v.p.Revision == rev {
			return v.p, v.created, true
		}
	}
	return nil, 0, false
}

// remember adds a version to the cache, keeping the newest maxPolicyVersions.
func (s *policySet) remember(v policyVersion) {
	s.mu.Lock()
	defer s.mu.Unlock()
	vs := s.versions[v.p.Name]
	for _, o := range vs {
		if o.p.Revision == v.p.Revision {
			return
		}
	}
	vs = append(vs, v)
	// Keep revision order so trimming drops the oldest.
	for i := len(vs) - 1; i > 0 && vs[i].p.Revision < vs[i-1].p.Revision; i-- {
		vs[i], vs[i-1] = vs[i-1], vs[i]
	}
	if len(vs) > maxPolicyVersions {
		vs = vs[len(vs)-maxPolicyVersions:]
	}
	s.versions[v.p.Name] = vs
}

// parsePolicy parses one policy entry and applies this node's rules on top
// of policies.Parse: the modes strict, async and local are implemented
// (leased is not yet).
func parsePolicy(name string, value []byte, rev uint64) (*policies.Policy, error) {
	p, err := policies.Parse(name, value)
	if err != nil {
		return nil, err
	}
	switch p.Mode {
	case policies.ModeStrict, policies.ModeAsync, policies.ModeLocal:
	default:
		return nil, &policies.Error{Path: "mode", Reason: strconv.Quote(p.Mode.String()) + " is not implemented by this node (strict, async and local are)"}
	}
	p.Revision = rev
	return p, nil
}

// policyWatcher applies the policy bucket to a policySet.
type policyWatcher struct {
	kv      jetstream.KeyValue
	set     *policySet
	log     *slog.Logger
	metrics *metrics
}

// run consumes w until it closes or ctx ends; ready is closed once the
// initial values have been applied.
func (pw *policyWatcher) run(ctx context.Context, w jetstream.KeyWatcher, ready chan<- struct{}) {
	defer func() { _ = w.Stop() }()
	initial := true
	for {
		select {
		case <-ctx.Done():
			return
		case e, ok := <-w.Updates():
			if !ok {
				return
			}
			if e == nil {
				if initial {
					initial = false
					close(ready)
				}
				continue
			}
			pw.apply(e)
		}
	}
}

// apply applies one watched entry: a put is validated and swapped in (or
// rejected, keeping the last valid version); a delete or purge removes the
// policy.
func (pw *policyWatcher) apply(e jetstream.KeyValueEntry) {
	name := e.Key()
	switch e.Operation() {
	case jetstream.KeyValueDelete, jetstream.KeyValuePurge:
		pw.set.snap.Store(pw.set.snap.Load().Without(name))
		pw.metrics.policyRevision.DeleteLabelValues(name)
		pw.log.Info("policy removed", "policy", name, "revision", e.Revision())
		return
	}
	p, err := parsePolicy(name, e.Value(), e.Revision())
	if err != nil {
		label := name
		if policies.ValidateName(name) != nil {
			label = "invalid_name"
		}
		pw.metrics.policyRejections.WithLabelValues(label).Inc()
		kept := uint64(0)
		if cur := pw.set.current(name); cur != nil {
			kept = cur.Revision
		}
		pw.log.Warn("policy rejected", "policy", label, "revision", e.Revision(), "error", err.Error(), "kept_revision", kept)
		return
	}
	pw.set.remember(policyVersion{p: p, created: e.Created().UnixNano()})
	pw.set.snap.Store(pw.set.snap.Load().With(p))
	pw.metrics.policyRevision.WithLabelValues(name).Set(float64(p.Revision))
	pw.log.Info("policy applied", "policy", name, "revision", p.Revision)
}

// fetchVersion reads version rev of policy name from the bucket's history
// into the cache. A revision that is gone, or was invalid, is an error.
func (pw *policyWatcher) fetchVersion(ctx context.Context, name string, rev uint64) error {
	if _, _, ok := pw.set.version(name, rev); ok {
		return nil
	}
	e, err := pw.kv.GetRevision(ctx, name, rev)
	if err != nil {
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			return fmt.Errorf("policy %q revision %d is no longer in the bucket history", name, rev)
		}
		return err
	}
	p, err := parsePolicy(name, e.Value(), e.Revision())
	if err != nil {
		return err
	}
	pw.set.remember(policyVersion{p: p, created: e.Created().UnixNano()})
	return nil
}
