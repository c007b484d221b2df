package shadow

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the evaluator's Prometheus metrics. Labels carry candidate
// names (operator-controlled, bounded) and fixed words only.
type metrics struct {
	decisions   *prometheus.CounterVec // policy, result: would_allow, would_deny
	overflow    *prometheus.CounterVec // policy
	skipped     *prometheus.CounterVec // policy
	invalid     prometheus.Counter     // usage messages that failed usage.DecodeBatch
	candidates  prometheus.Gauge
	leader      prometheus.Gauge
	lag         prometheus.Gauge
	checkpoints *prometheus.CounterVec // outcome: ok, error, fenced
	ckptBytes   prometheus.Gauge
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limitmesh_shadow_decisions_total",
			Help: "Usage records evaluated against a shadow candidate by this node's evaluator, by candidate and result (would_allow, would_deny).",
		}, []string{"policy", "result"}),
		overflow: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limitmesh_shadow_overflow_total",
			Help: "Records of a candidate decided against its shared overflow state because it held its maximum number of keys.",
		}, []string{"policy"}),
		skipped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limitmesh_shadow_skipped_total",
			Help: "Records a candidate matched but could not evaluate: the descriptor lacks a dimension of its key.",
		}, []string{"policy"}),
		invalid: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "limitmesh_shadow_invalid_batches_total",
			Help: "Usage stream messages the shadow evaluator skipped because they are not valid usage batches.",
		}),
		candidates: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "limitmesh_shadow_candidates",
			Help: "Shadow candidates under evaluation on this node (0 where the evaluator does not run).",
		}),
		leader: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "limitmesh_shadow_leader",
			Help: "1 while this node runs the shadow evaluator (one node at a time), else 0.",
		}),
		lag: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "limitmesh_shadow_lag_seconds",
			Help: "Age of the last usage message the evaluator applied while more were waiting; 0 when it has caught up.",
		}),
		checkpoints: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limitmesh_shadow_checkpoints_total",
			Help: "Checkpoints of the shadow evaluator's state, by outcome (ok, error, fenced: another evaluator took over).",
		}, []string{"outcome"}),
		ckptBytes: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "limitmesh_shadow_checkpoint_bytes",
			Help: "Size of the last checkpoint written.",
		}),
	}
	if reg == nil {
		return m, nil
	}
	var err error
	reuse(reg, &m.decisions, &err)
	reuse(reg, &m.overflow, &err)
	reuse(reg, &m.skipped, &err)
	reuse(reg, &m.invalid, &err)
	reuse(reg, &m.candidates, &err)
	reuse(reg, &m.leader, &err)
	reuse(reg, &m.lag, &err)
	reuse(reg, &m.checkpoints, &err)
	reuse(reg, &m.ckptBytes, &err)
	if err != nil {
		return nil, err
	}
	return m, nil
}

// reuse registers *c with reg; when an equal collector is registered
// already (a second evaluator in one process), *c becomes that one. The
// first other error is kept in *err.
func reuse[C prometheus.Collector](reg prometheus.Registerer, c *C, err *error) {
	if *err != nil {
		return
	}
	if e := reg.Register(*c); e != nil {
		var are prometheus.AlreadyRegisteredError
		if !errors.As(e, &are) {
			*err = e
			return
		}
		if existing, ok := are.ExistingCollector.(C); ok {
			*c = existing
			return
		}
		*err = e
	}
}

// counted is what this process's metrics have counted of one candidate
// revision: the largest counts of its summaries they include.
type counted struct {
	revision                                 uint64
	wouldAllow, wouldDeny, overflow, skipped uint64
}

// countedOf returns the counts of s.
func countedOf(s *Summary) counted {
	return counted{revision: s.Revision, wouldAllow: s.WouldAllow, wouldDeny: s.WouldDeny, overflow: s.Overflow, skipped: s.Skipped}
}

// add adds to the metrics what s counts beyond c (of the same revision;
// everything for another one) and returns the counts now included: the
// larger of c's and s's, so that records evaluated again after a restore
// are not counted twice.
func (m *metrics) add(c counted, s *Summary) counted {
	if c.revision != s.Revision {
		c = counted{revision: s.Revision}
	}
	add := func(v *prometheus.CounterVec, was *uint64, now uint64, labels ...string) {
		if now > *was {
			v.WithLabelValues(labels...).Add(float64(now - *was))
			*was = now
		}
	}
	add(m.decisions, &c.wouldAllow, s.WouldAllow, s.Policy, "would_allow")
	add(m.decisions, &c.wouldDeny, s.WouldDeny, s.Policy, "would_deny")
	add(m.overflow, &c.overflow, s.Overflow, s.Policy)
	add(m.skipped, &c.skipped, s.Skipped, s.Policy)
	return c
}

// baseline returns what the metrics should take as counted of s after a
// restore: the counts the process already included when s is of the same
// revision and not ahead of them (its own evaluations, checkpointed and
// replayed again), else s's counts (evaluations another node made).
func baseline(c counted, s *Summary) counted {
	r := countedOf(s)
	if c.revision != s.Revision {
		return r
	}
	r.wouldAllow, r.wouldDeny = max(r.wouldAllow, c.wouldAllow), max(r.wouldDeny, c.wouldDeny)
	r.overflow, r.skipped = max(r.overflow, c.overflow), max(r.skipped, c.skipped)
	return r
}
