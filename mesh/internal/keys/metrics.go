package keys

import "github.com/prometheus/client_golang/prometheus"

// Metrics are the key owners' collectors.
type Metrics struct {
	casConflicts   prometheus.Counter   // writes that lost a CAS to another writer
	casRetries     prometheus.Counter   // re-decisions after a conflict
	asyncLost      prometheus.Counter   // async changes dropped by a lost CAS
	batchSize      prometheus.Histogram // calls per state write
	corruptRecords prometheus.Counter   // stored records that could not be decoded
	// stateOps are the durations of store operations: [get, update][ok, error].
	stateOps [2][2]prometheus.Observer
}

// NewMetrics registers the key owners' collectors on reg; cachedKeys
// reports the keys held in memory.
func NewMetrics(reg prometheus.Registerer, cachedKeys func() float64) (*Metrics, error) {
	m := &Metrics{
		casConflicts: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "limitmesh_cas_conflicts_total",
			Help: "State writes that lost a compare-and-swap to another writer (including a first write of a key this node had not read that found the key stored), each decided again after a reload.",
		}),
		casRetries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "limitmesh_cas_retries_total",
			Help: "Decisions decided again after a lost compare-and-swap.",
		}),
		asyncLost: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "limitmesh_async_lost_writes_total",
			Help: "Async-mode keys whose unwritten changes were dropped because another writer won the compare-and-swap (admissions beyond the limit, within the mode's bound).",
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
	}
	ops := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "limitmesh_state_op_duration_seconds",
		Help:    "Latency of state store operations by op (get, update) and outcome.",
		Buckets: []float64{.00005, .0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5},
	}, []string{"op", "outcome"})
	for i, op := range [2]string{"get", "update"} {
		for k, outcome := range [2]string{"ok", "error"} {
			m.stateOps[i][k] = ops.WithLabelValues(op, outcome)
		}
	}
	cached := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "limitmesh_cached_keys",
		Help: "Limit keys whose state this node holds in memory.",
	}, cachedKeys)
	for _, c := range []prometheus.Collector{m.casConflicts, m.casRetries, m.asyncLost, m.batchSize,
		m.corruptRecords, ops, cached} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// stateOp returns the duration histogram of a store operation (write:
// an update, else a get) that ended with err.
func (m *Metrics) stateOp(write bool, err error) prometheus.Observer {
	i, k := 0, 0
	if write {
		i = 1
	}
	if err != nil {
		k = 1
	}
	return m.stateOps[i][k]
}
