// Package envoy serves Envoy's global rate limit API
// (envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit, CONTRACT.md
// §12) over gRPC, so that Envoy, Istio and other gateways that speak it use
// limitmesh without code.
//
// The bridge is a NATS client of the decide service: each Envoy descriptor
// becomes one decide request on "<prefix>.v1.decide" (through the Go SDK,
// mesh/client, with its partition hints), so routing, forwarding, usage
// records, the ledger, metrics and shadow evaluation are those of any
// decision, on an embedded server, a joined deployment or a secured one.
//
// It owns the mapping of Envoy requests to limitmesh descriptors
// (mapping.go: total, documented in docs/protocol.md, "The Envoy rate limit
// service"), the response (response.go: statuses, current_limit, the
// RateLimit headers), the gRPC server with health checking and reflection
// (server.go) and its metrics (metrics.go).
//
// envoy imports policies, kvstate and mesh/client; it must not import mesh
// (the node hands it what it needs as functions), cli or integration.
package envoy
