package service

import (
	"sync"

	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the decide service's collectors. Labels are policy names
// (operator-controlled, bounded) and fixed words; never descriptor values.
type Metrics struct {
	// byPolicy caches each policy's decisions counters (*resultCounters by
	// policy name): a label lookup per decision costs more than the rest
	// of the bookkeeping.
	byPolicy  sync.Map
	decisions *prometheus.CounterVec // policy, result
	duration  prometheus.Histogram   // seconds
	errors    *prometheus.CounterVec // code
	deduped   prometheus.Counter     // replies from a remembered request_id
	forwarded *prometheus.CounterVec // outcome: ok, retry, not_owner, unavailable
	// overflow counts requests of keys new beyond their policy's
	// max_keys, decided against its overflow key (by policy);
	// overflowBy caches its counters by policy name.
	overflow   *prometheus.CounterVec
	overflowBy sync.Map
	// reservations counts ended reservations by policy and outcome
	// (settled, released, expired).
	reservations *prometheus.CounterVec
	// reservationsOpen: open reservations of the keys this node owns
	// and knows of, by policy.
	reservationsOpen *prometheus.GaugeVec
}

// NewMetrics registers the service's collectors on reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limitmesh_decisions_total",
			Help: "Decisions by policy and result (allowed, denied, error); dry runs are not counted.",
		}, []string{"policy", "result"}),
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "limitmesh_decision_duration_seconds",
			Help:    "Time from receiving a decide request to sending its reply.",
			Buckets: []float64{.00005, .0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1},
		}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limitmesh_decide_errors_total",
			Help: "Decide requests answered with an error, by code (400, 403, 413, 500, 503).",
		}, []string{"code"}),
		deduped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "limitmesh_dedupe_hits_total",
			Help: "Decide requests answered with the remembered decision of their request_id.",
		}),
		forwarded: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limitmesh_forwarded_total",
			Help: "Forwarding attempts of decide requests to a partition's owner, by outcome (ok: relayed reply; retry: no owner reachable yet; not_owner: a forwarded request for a partition this node does not own; unavailable: deadline passed).",
		}, []string{"outcome"}),
		overflow: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limitmesh_overflow_total",
			Help: "Decide requests for a limit key new beyond its policy's max_keys on the key's owner, decided against the policy's shared overflow key.",
		}, []string{"policy"}),
		reservations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limitmesh_reservations_total",
			Help: "Reservations ended by the keys' owners on this node, by policy and outcome (settled, released, expired).",
		}, []string{"policy", "outcome"}),
		reservationsOpen: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "limitmesh_reservations_open",
			Help: "Open reservations of the limit keys this node owns and has handled a reservation call of, by policy.",
		}, []string{"policy"}),
	}
	for _, c := range []prometheus.Collector{m.decisions, m.duration, m.errors, m.deduped, m.forwarded, m.overflow, m.reservations, m.reservationsOpen} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// Decision results, the result label of limitmesh_decisions_total.
const (
	resAllowed = iota
	resDenied
	resError
)

var resultNames = [...]string{"allowed", "denied", "error"}

type resultCounters [len(resultNames)]prometheus.Counter

// decision counts one decision of policy ("" when none matched) with
// result res.
func (m *Metrics) decision(policy string, res int) {
	v, ok := m.byPolicy.Load(policy)
	if !ok {
		rc := &resultCounters{}
		for i, name := range resultNames {
			rc[i] = m.decisions.WithLabelValues(policy, name)
		}
		v, _ = m.byPolicy.LoadOrStore(policy, rc)
	}
	v.(*resultCounters)[res].Inc()
}

// overflowed counts one request of policy decided against its overflow
// key.
func (m *Metrics) overflowed(policy string) {
	v, ok := m.overflowBy.Load(policy)
	if !ok {
		v, _ = m.overflowBy.LoadOrStore(policy, m.overflow.WithLabelValues(policy))
	}
	v.(prometheus.Counter).Inc()
}

// reservationsEnded counts the reservations a call of policy ended, by
// outcome (keyrec.Outcome: index 0, open, is not counted).
func (m *Metrics) reservationsEnded(policy string, ended [keyrec.Expired + 1]int) {
	for o := keyrec.Settled; o <= keyrec.Expired; o++ {
		if n := ended[o]; n > 0 {
			m.reservations.WithLabelValues(policy, o.String()).Add(float64(n))
		}
	}
}
