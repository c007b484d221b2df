package mesh

import (
	"github.com/prometheus/client_golang/prometheus"
	"sync"
)

// metrics are the node's Prometheus collectors. Labels are policy names
// (operator-controlled, bounded) and fixed words; never descriptor values.
type metrics struct {
	// byPolicy caches each policy's decisions counters (*resultCounters by
	// policy name): a label lookup per decision costs more than the rest of
	// the bookkeeping.
	byPolicy sync.Map
	// stateOpObs caches stateOps' children: [get, update][ok, error].
	stateOpObs [2][2]prometheus.Observer

	decisions        *prometheus.CounterVec   // policy, result
	duration         prometheus.Histogram     // seconds
	casConflicts     prometheus.Counter       // writes that lost a CAS
	casRetries       prometheus.Counter       // re-decisions after a conflict
	policyRejections *prometheus.CounterVec   // policy
	policyRevision   *prometheus.GaugeVec     // policy
	errors           *prometheus.CounterVec   // code
	deduped          prometheus.Counter       // replies from a remembered request_id
	batchSize        prometheus.Histogram     // calls per state write
	corruptRecords   prometheus.Counter       // stored records that could not be decoded
	cachedKeys       prometheus.GaugeFunc     // keys held in memory
	stateOps         *prometheus.HistogramVec // op: get, update
	asyncLost        prometheus.Counter       // async write-behinds lost to a CAS (overshoot)
	ownedPartitions  prometheus.Gauge         // partitions this node holds
	forwarded        *prometheus.CounterVec   // outcome: ok, retry, not_owner, unavailable
	ownershipChanges *prometheus.CounterVec   // change: claimed, released, lost
}

func newMetrics(reg prometheus.Registerer, cachedKeys func() float64) (*metrics, error) {
	m := &metrics{
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limitmesh_decisions_total",
			Help: "Decisions by policy and result (allowed, denied, shadow_denied, error); dry runs are not counted.",
		}, []string{"policy", "result"}),
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "limitmesh_decision_duration_seconds",
			Help:    "Time from receiving a decide request to sending its reply.",
			Buckets: []float64{.00005, .0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1},
		}),
		casConflicts: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "limitmesh_cas_conflicts_total",
			Help: "State writes that lost a compare-and-swap (another writer got there first).",
		}),
		casRetries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "limitmesh_cas_retries_total",
			Help: "Decisions decided again after a lost compare-and-swap.",
		}),
		policyRejections: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limitmesh_policy_rejections_total",
			Help: "Policy values rejected as invalid (policy=\"invalid_name\" when the key itself is not a valid name).",
		}, []string{"policy"}),
		policyRevision: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "limitmesh_policy_revision",
			Help: "KV revision of the policy version in force.",
		}, []string{"policy"}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limitmesh_decide_errors_total",
			Help: "Decide requests answered with an error, by code (400, 413, 500, 503).",
		}, []string{"code"}),
		deduped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "limitmesh_dedupe_hits_total",
			Help: "Decide requests answered with the remembered decision of their request_id.",
		}),
		batchSize: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "limitmesh_write_batch_size",
			Help:    "Decisions carried by one state write (group commit).",
			Buckets: []float64{1, 2, 4, 8, 16, 32, 64, 128, 256},
		}),
		corruptRecords: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "limitmesh_corrupt_records_total",
			Help: "Stored key records that could not be decoded (the key started empty: no tokens, full windows).",
		}),
		cachedKeys: prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "limitmesh_cached_keys",
			Help: "Limit keys whose state this node holds in memory.",
		}, cachedKeys),
		stateOps: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "limitmesh_state_op_duration_seconds",
			Help:    "Latency of state store operations by op (get, update) and outcome.",
			Buckets: []float64{.00005, .0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5},
		}, []string{"op", "outcome"}),
		ownedPartitions: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "limitmesh_owned_partitions",
			Help: "Partitions of the key space this node owns.",
		}),
		forwarded: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limitmesh_forwarded_total",
			Help: "Forwarding attempts of decide requests to a partition's owner, by outcome (ok: relayed reply; retry: no owner reachable yet; not_owner: a forwarded request for a partition this node does not own; unavailable: deadline passed).",
		}, []string{"outcome"}),
		ownershipChanges: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limitmesh_ownership_changes_total",
			Help: "Partition ownership changes of this node, by change (claimed, released, lost).",
		}, []string{"change"}),
	}
	m.asyncLost = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "limitmesh_async_lost_writes_total",
		Help: "Async-mode keys whose unwritten changes were dropped because another writer won the compare-and-swap (admissions beyond the limit, within the mode's bound).",
	})
	if err := reg.Register(m.asyncLost); err != nil {
		return nil, err
	}
	for i, op := range [2]string{"get", "update"} {
		for k, outcome := range [2]string{"ok", "error"} {
			m.stateOpObs[i][k] = m.stateOps.WithLabelValues(op, outcome)
		}
	}
	for _, c := range []prometheus.Collector{m.decisions, m.duration, m.casConflicts, m.casRetries,
		m.policyRejections, m.policyRevision, m.errors, m.deduped, m.batchSize, m.corruptRecords,
		m.cachedKeys, m.stateOps, m.ownedPartitions, m.forwarded, m.ownershipChanges} {
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
	resShadowDenied
	resError
)

var resultNames = [...]string{"allowed", "denied", "shadow_denied", "error"}

type resultCounters [len(resultNames)]prometheus.Counter

// decision counts one decision of policy ("" when none matched) with
// result res.
func (m *metrics) decision(policy string, res int) {
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

// stateOp returns the duration histogram of a state store operation op
// ("get" or "update") that ended with err.
func (m *metrics) stateOp(op string, err error) prometheus.Observer {
	i, k := 0, 0
	if op != "get" {
		i = 1
	}
	if err != nil {
		k = 1
	}
	return m.stateOpObs[i][k]
}
