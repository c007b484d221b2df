package envoy

import "errors"

// ErrRefused is matched (errors.Is) by every reason a descriptor is refused
// without a decision: it cannot be mapped to a valid limitmesh descriptor
// or cost (mapping.go), or the decide service answered it 400, 403 or 413.
// A refused descriptor's status is OVER_LIMIT with no current_limit
// (docs/protocol.md, "The Envoy rate limit service").
var ErrRefused = errors.New("envoy: descriptor refused")

// ErrConfig is returned, wrapped, by [New] for an invalid [Config].
var ErrConfig = errors.New("envoy: invalid configuration")
