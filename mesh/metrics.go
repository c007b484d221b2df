package mesh

import "github.com/prometheus/client_golang/prometheus"

// ownershipMetrics implements ownership.Metrics.
type ownershipMetrics struct {
	owned   prometheus.Gauge       // partitions this node holds
	changes *prometheus.CounterVec // change: claimed, released, lost
}

// registerNodeInfo registers limitmesh_node_info, which names the node
// (one series per process): its id, its roles and its version.
func registerNodeInfo(reg prometheus.Registerer, id string, roles Roles) error {
	info := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        "limitmesh_node_info",
		Help:        "Always 1; its labels name this node (its id, as in the shards bucket), its roles (decide, ledger, shadow, comma-separated) and its version.",
		ConstLabels: prometheus.Labels{"node": id, "roles": roles.String(), "version": Version},
	})
	info.Set(1)
	return reg.Register(info)
}

// newOwnershipMetrics registers the ownership metrics (a node without the
// decide role registers them too: it owns 0 partitions).
func newOwnershipMetrics(reg prometheus.Registerer) (*ownershipMetrics, error) {
	m := &ownershipMetrics{
		owned: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "limitmesh_owned_partitions",
			Help: "Partitions of the key space this node owns.",
		}),
		changes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limitmesh_ownership_changes_total",
			Help: "Partition ownership changes of this node, by change (claimed, released, lost).",
		}, []string{"change"}),
	}
	for _, c := range []prometheus.Collector{m.owned, m.changes} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

func (m *ownershipMetrics) Owned(n int) { m.owned.Set(float64(n)) }
func (m *ownershipMetrics) Changed(change string, n int) {
	m.changes.WithLabelValues(change).Add(float64(n))
}
