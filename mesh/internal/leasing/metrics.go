package leasing

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are leased mode's counters.
type metrics struct {
	// grants counts acquires answered by this node as a key's owner, by
	// result (granted, exhausted, full, not_leased).
	grants *prometheus.CounterVec
	// reports counts reports and returns answered as owner, by op and
	// result (ok, stale_epoch, unknown_grant, bad_spend).
	reports *prometheus.CounterVec
	// local counts plain decisions answered from this node's grants, by
	// policy and result (allowed, denied).
	local *prometheus.CounterVec
	// subGrants counts sub-grant requests of gateways, by result
	// (granted, exhausted, remote, not_leased).
	subGrants *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		grants: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "limitmesh_lease_grants_total",
			Help: "Grant requests of holder nodes answered as the key's owner, by result."}, []string{"result"}),
		reports: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "limitmesh_lease_reports_total",
			Help: "Grant reports and returns answered as the key's owner, by op and result."}, []string{"op", "result"}),
		local: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "limitmesh_lease_local_decisions_total",
			Help: "Decide requests of leased policies answered from this node's grants, by policy and result."}, []string{"policy", "result"}),
		subGrants: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "limitmesh_lease_sub_grants_total",
			Help: "Gateways' grant requests answered by this node, by result."}, []string{"result"}),
	}
	if reg == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.grants, m.reports, m.local, m.subGrants} {
		if err := reg.Register(c); err != nil {
			return nil, errors.Join(errors.New("leasing: registering metrics"), err)
		}
	}
	return m, nil
}
