package leasing

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
)

// The lease protocol's messages (docs/protocol.md, "Leased mode"). Every
// request and reply is one JSON object; units are integer micro-units and
// durations integer ns (these subjects are internal: nodes and the Go SDK).
// Unknown fields are ignored; a reply always has "result".

// Ops of requests.
const (
	opAcquire = "acquire"
	opReport  = "report"
	opReturn  = "return"
)

// Results of replies.
const (
	resGranted    = "granted"     // a grant (or sub-grant) was made
	resExhausted  = "exhausted"   // the key's limits lack the units: deny until retry_after_ns
	resFull       = "full"        // owner: max_outstanding leaves no room (decide remotely)
	resRemote     = "remote"      // gateway: no grant now, decide remotely (strict)
	resNotLeased  = "not_leased"  // the descriptor's policy (if any) is not leased
	resOK         = "ok"          // report or return applied
	resStale      = "stale_epoch" // report or return of an older epoch: refused
	resUnknown    = "unknown_grant"
	resBadSpend   = "bad_spend"
	resNotOwner   = "not_owner"   // owner subject: this node does not serve the partition (retry)
	resUnavail    = "unavailable" // the owner could not write the key's record
	resBadRequest = "bad_request"
)

// maxBody bounds a lease request (as a decide request).
const maxBody = 4096

// ownerRequest is a node's request to a key's owner, on
// <prefix>.v1.lease.shard.<n>.
type ownerRequest struct {
	Op     string `json:"op"`
	Policy string `json:"policy"`
	Key    string `json:"key"`
	Holder string `json:"holder,omitempty"` // acquire
	Want   int64  `json:"want,omitempty"`   // acquire: micro-units
	Min    int64  `json:"min,omitempty"`    // acquire: micro-units
	Grant  uint64 `json:"grant,omitempty"`  // report, return
	Epoch  uint64 `json:"epoch,omitempty"`  // report, return
	Spent  int64  `json:"spent"`            // report, return: cumulative micro-units
}

// reply is the reply of every lease subject.
type reply struct {
	Result     string `json:"result"`
	Policy     string `json:"policy,omitempty"`
	Revision   uint64 `json:"revision,omitempty"`
	Grant      uint64 `json:"grant,omitempty"`
	Epoch      uint64 `json:"epoch,omitempty"`
	Units      int64  `json:"units,omitempty"`
	TTL        int64  `json:"ttl_ns,omitempty"`
	Remaining  int64  `json:"remaining,omitempty"`
	RetryAfter int64  `json:"retry_after_ns,omitempty"`
	Refunded   int64  `json:"refunded,omitempty"`
	ReportTo   string `json:"report_to,omitempty"`
	Message    string `json:"message,omitempty"`
}

// gatewayRequest is a gateway's (SDK holder's) request, on <prefix>.v1.lease
// (acquire) and on the report_to subject of the node that made its grant
// (report, return).
type gatewayRequest struct {
	Op         string            `json:"op"`
	Descriptor map[string]string `json:"descriptor,omitempty"` // acquire
	Holder     string            `json:"holder,omitempty"`     // acquire
	Want       int64             `json:"want,omitempty"`       // acquire: micro-units (0: the policy's size)
	Min        int64             `json:"min,omitempty"`        // acquire: micro-units (0: one micro-unit)
	Grant      uint64            `json:"grant,omitempty"`      // report, return
	Epoch      uint64            `json:"epoch,omitempty"`      // report, return
	Spent      int64             `json:"spent"`                // report, return
}

var errBadRequest = errors.New("leasing: bad request")

// decode decodes a request body into v: at most maxBody bytes, one JSON
// object, an op it knows, and no negative quantity.
func decode(b []byte, v any) error {
	if len(b) > maxBody {
		return fmt.Errorf("%w: body is %d bytes, at most %d", errBadRequest, len(b), maxBody)
	}
	d := json.NewDecoder(bytes.NewReader(b))
	if err := d.Decode(v); err != nil {
		return fmt.Errorf("%w: %v", errBadRequest, err)
	}
	if d.More() {
		return fmt.Errorf("%w: trailing data", errBadRequest)
	}
	var op string
	var want, least, spent int64
	switch r := v.(type) {
	case *ownerRequest:
		op, want, least, spent = r.Op, r.Want, r.Min, r.Spent
		if r.Policy == "" || r.Key == "" {
			return fmt.Errorf("%w: policy and key are required", errBadRequest)
		}
	case *gatewayRequest:
		op, want, least, spent = r.Op, r.Want, r.Min, r.Spent
	}
	switch op {
	case opAcquire, opReport, opReturn:
	default:
		return fmt.Errorf("%w: op %s is not acquire, report or return", errBadRequest, strconv.Quote(op))
	}
	if want < 0 || least < 0 || spent < 0 {
		return fmt.Errorf("%w: negative quantity", errBadRequest)
	}
	return nil
}

func encode(r reply) []byte {
	b, _ := json.Marshal(r) // plain fields: never fails
	return b
}
