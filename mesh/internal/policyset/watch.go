package policyset

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/limitmesh/limitmesh/policies"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the watcher's collectors.
type Metrics struct {
	rejections *prometheus.CounterVec // policy
	revision   *prometheus.GaugeVec   // policy
}

// NewMetrics registers the watcher's collectors on reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		rejections: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limitmesh_policy_rejections_total",
			Help: "Policy values rejected as invalid (policy=\"invalid_name\" when the key itself is not a valid name).",
		}, []string{"policy"}),
		revision: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "limitmesh_policy_revision",
			Help: "KV revision of the policy version in force.",
		}, []string{"policy"}),
	}
	for _, c := range []prometheus.Collector{m.rejections, m.revision} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// Watcher applies the policy bucket to a Set.
type Watcher struct {
	kv      jetstream.KeyValue
	set     *Set
	log     *slog.Logger
	metrics *Metrics
}

// NewWatcher returns a watcher of kv (the policy bucket) into set.
func NewWatcher(kv jetstream.KeyValue, set *Set, log *slog.Logger, m *Metrics) *Watcher {
	return &Watcher{kv: kv, set: set, log: log, metrics: m}
}

// Run consumes w (a kvstate.WatchAll of the bucket) until it closes or
// ctx ends; ready is closed once the initial values have been applied.
func (pw *Watcher) Run(ctx context.Context, w jetstream.KeyWatcher, ready chan<- struct{}) {
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
			pw.Apply(e)
		}
	}
}

// Apply applies one watched entry: a put is validated and swapped in (or
// rejected, keeping the last valid version); a delete or purge removes the
// policy.
func (pw *Watcher) Apply(e jetstream.KeyValueEntry) {
	name := e.Key()
	switch e.Operation() {
	case jetstream.KeyValueDelete, jetstream.KeyValuePurge:
		pw.set.Remove(name)
		pw.metrics.revision.DeleteLabelValues(name)
		pw.log.Info("policy removed", "policy", name, "revision", e.Revision())
		return
	}
	p, err := Parse(name, e.Value(), e.Revision())
	if err != nil {
		label := name
		if policies.ValidateName(name) != nil {
			label = "invalid_name"
		}
		pw.metrics.rejections.WithLabelValues(label).Inc()
		kept := uint64(0)
		if cur := pw.set.Current(name); cur != nil {
			kept = cur.Revision
		}
		pw.log.Warn("policy rejected", "policy", label, "revision", e.Revision(), "error", err.Error(), "kept_revision", kept)
		return
	}
	pw.set.Put(p, e.Created().UnixNano())
	if p.Shadow {
		pw.metrics.revision.DeleteLabelValues(name)
		pw.log.Info("candidate policy seen (evaluated off the decision path)", "policy", name, "revision", p.Revision)
		return
	}
	pw.metrics.revision.WithLabelValues(name).Set(float64(p.Revision))
	pw.log.Info("policy applied", "policy", name, "revision", p.Revision)
}

// FetchVersion reads version rev of policy name from the bucket's history
// into the Set. A revision that is gone, or was invalid, is an error.
func (pw *Watcher) FetchVersion(ctx context.Context, name string, rev uint64) error {
	if _, _, ok := pw.set.Version(name, rev); ok {
		return nil
	}
	e, err := pw.kv.GetRevision(ctx, name, rev)
	if err != nil {
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			return fmt.Errorf("policy %q revision %d is no longer in the bucket history", name, rev)
		}
		return err
	}
	p, err := Parse(name, e.Value(), e.Revision())
	if err != nil {
		return err
	}
	pw.set.Remember(Version{P: p, Created: e.Created().UnixNano()})
	return nil
}

// Set returns the set the watcher applies to.
func (pw *Watcher) Set() *Set { return pw.set }
