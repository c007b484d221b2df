package envoy

import (
	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the bridge's own series; the decisions themselves are
// counted by the nodes that make them (limitmesh_decisions_total), like
// any other.
type metrics struct {
	requests    *prometheus.CounterVec // code: ok, over_limit, unavailable, invalid_argument, internal, canceled
	descriptors *prometheus.CounterVec // result: allowed, denied, unmatched, refused, refund
	duration    prometheus.Histogram
}

// Request codes (label values of limitmesh_envoy_requests_total).
const (
	codeOK              = "ok"
	codeOverLimit       = "over_limit"
	codeUnavailable     = "unavailable"
	codeInvalidArgument = "invalid_argument"
	codeInternal        = "internal"
	codeCanceled        = "canceled"
)

// Descriptor results (label values of limitmesh_envoy_descriptors_total).
const (
	resultAllowed   = "allowed"
	resultDenied    = "denied"
	resultUnmatched = "unmatched"
	resultRefused   = "refused"
	resultRefund    = "refund"
)

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limitmesh_envoy_requests_total",
			Help: "ShouldRateLimit calls of the Envoy rate limit service, by answer (ok, over_limit, or the gRPC error: unavailable, invalid_argument, internal, canceled).",
		}, []string{"code"}),
		descriptors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limitmesh_envoy_descriptors_total",
			Help: "Descriptors of answered ShouldRateLimit calls, by result (allowed, denied, unmatched: no policy, refused: not mappable or refused by the decide service, refund: is_negative_hits, not decided).",
		}, []string{"result"}),
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "limitmesh_envoy_request_duration_seconds",
			Help:    "Time to answer a ShouldRateLimit call, from its arrival at the handler to its answer.",
			Buckets: []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1},
		}),
	}
	for _, c := range []prometheus.Collector{m.requests, m.descriptors, m.duration} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	// Series exist from the start, so a dashboard sees zeros.
	for _, c := range []string{codeOK, codeOverLimit, codeUnavailable, codeInvalidArgument, codeInternal, codeCanceled} {
		m.requests.WithLabelValues(c)
	}
	for _, r := range []string{resultAllowed, resultDenied, resultUnmatched, resultRefused, resultRefund} {
		m.descriptors.WithLabelValues(r)
	}
	return m, nil
}
