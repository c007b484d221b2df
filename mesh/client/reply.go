package client

import (
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
)

// Reply header names of NATS micro errors (CONTRACT.md §2).
const (
	headerErrorCode = "Nats-Service-Error-Code"
	headerError     = "Nats-Service-Error"
)

// Source tells where a [Result] came from.
type Source uint8

const (
	// SourceService: the decide service answered (the zero value).
	SourceService Source = iota
	// SourceFailClosed: the service was unavailable and the failure
	// behaviour [FailClosed] denied the request.
	SourceFailClosed
	// SourceEmergency: the service was unavailable and a local emergency
	// bucket ([FailOpenBucket]) decided.
	SourceEmergency
	// SourceLease: a leased policy's decision the client made itself
	// ([Leasing]): admitted from a grant it holds, or denied while the
	// nodes say the key's limits lack the units (RetryAfter set).
	SourceLease
)

// String returns "service", "fail_closed", "emergency" or "lease".
func (s Source) String() string {
	switch s {
	case SourceService:
		return "service"
	case SourceFailClosed:
		return "fail_closed"
	case SourceEmergency:
		return "emergency"
	case SourceLease:
		return "lease"
	}
	return "source(" + strconv.Itoa(int(s)) + ")"
}

// Decimal is a non-negative decimal number as the service wrote it, without
// exponent, e.g. "0", "12" or "2.5". It keeps the exact text; Micro and
// Floor read it as fixed point.
type Decimal string

// Micro returns d in micro-units (1e-6), truncating further fractional
// digits; ok is false if d is not a decimal or does not fit an int64.
func (d Decimal) Micro() (micro int64, ok bool) {
	return parseMicro(string(d))
}

// Floor returns the whole units of d rounded down (0 if d is not a decimal).
func (d Decimal) Floor() int64 {
	m, _ := parseMicro(string(d))
	return m / 1_000_000
}

// String returns the decimal text.
func (d Decimal) String() string { return string(d) }

// parseMicro parses [-]digits[.digits] into micro-units, truncating toward
// zero after 6 fractional digits.
func parseMicro(s string) (int64, bool) {
	neg := false
	if len(s) > 0 && s[0] == '-' {
		neg, s = true, s[1:]
	}
	var v int64
	i := 0
	for ; i < len(s) && s[i] >= '0' && s[i] <= '9'; i++ {
		if v > (1<<63-1-9)/10 {
			return 0, false
		}
		v = v*10 + int64(s[i]-'0')
	}
	if i == 0 {
		return 0, false
	}
	if v > (1<<63-1)/1_000_000 {
		return 0, false
	}
	v *= 1_000_000
	if i < len(s) {
		if s[i] != '.' || i+1 == len(s) {
			return 0, false
		}
		scale := int64(100_000)
		for i++; i < len(s); i++ {
			c := s[i]
			if c < '0' || c > '9' {
				return 0, false
			}
			v += int64(c-'0') * scale
			scale /= 10
		}
		if v < 0 {
			return 0, false
		}
	}
	if neg {
		v = -v
	}
	return v, true
}

// Result is one decision (CONTRACT.md §2), from the service or, when the
// service was unavailable, from the configured failure behaviour (Source).
type Result struct {
	// Allowed is the decision. A denial is a Result with Allowed false and
	// a nil error.
	Allowed bool
	// Policy is the name of the policy that decided; "" when no policy
	// matched (then Allowed is true). For failure results it is the policy
	// that last decided this descriptor, if the client remembers one.
	Policy string
	// Revision is the KV revision of that policy's entry (0 for failure results).
	Revision uint64
	// Remaining is the snapshot of units left after this decision in the
	// limit with the least left.
	Remaining Decimal
	// RetryAfter is 0 when allowed; when denied, the wait until this cost
	// could be admitted (whole milliseconds from the service). It is 0 when
	// Never is set: check Never first.
	RetryAfter time.Duration
	// Never is true when the cost can never be admitted (above the limit's
	// capacity; retry_after_ms -1 on the wire).
	Never bool
	// ResetAfter is the time until the limit is full again (bucket
	// algorithms) or its window ends (window algorithms).
	ResetAfter time.Duration
	// ShadowDenied is true when a shadow policy would have denied (then
	// Allowed is true).
	ShadowDenied bool
	// Source tells whether the service or the failure behaviour decided.
	Source Source
	// Err is the unavailability error (matching ErrTimeout, ErrNoResponders
	// or ErrUnavailable) when Source is not SourceService; nil otherwise.
	Err error
}

// wireReply is the JSON reply of the decide endpoint.
type wireReply struct {
	Allowed      *bool       `json:"allowed"`
	Policy       string      `json:"policy"`
	Revision     uint64      `json:"revision"`
	Remaining    json.Number `json:"remaining"`
	RetryAfterMs int64       `json:"retry_after_ms"`
	ResetAfterMs int64       `json:"reset_after_ms"`
	ShadowDenied bool        `json:"shadow_denied"`
	// Partition is the limit key's partition (docs/protocol.md), absent
	// for unmatched descriptors and local-mode policies.
	Partition *int `json:"partition"`
}

// wireError is the JSON body of a micro error reply.
type wireError struct {
	Error   string `json:"error"`
	Message string `json:"message"`
}

// maxMs bounds millisecond fields so that they convert to a Duration
// without overflow (about 292 years).
const maxMs = int64(1<<63-1) / int64(time.Millisecond)

// decodeReply decodes one reply message of the decide endpoint: a
// *ServiceError when it carries the micro error headers, else the Result.
// Errors wrap ErrBadReply, or are a *ServiceError; it never panics.
func decodeReply(h nats.Header, data []byte) (*Result, error) {
	r, _, err := decodeReplyHint(h, data)
	return r, err
}

// decodeReplyHint is decodeReply that also returns the reply's partition
// hint: the "partition" field, or the PartitionHeader older nodes set
// ("" when there is none).
func decodeReplyHint(h nats.Header, data []byte) (*Result, string, error) {
	if code, desc := h.Get(headerErrorCode), h.Get(headerError); code != "" || desc != "" {
		return nil, "", decodeServiceError(code, desc, data)
	}
	var w wireReply
	if err := json.Unmarshal(data, &w); err != nil {
		return nil, "", fmt.Errorf("%w: %w", ErrBadReply, err)
	}
	hint := h.Get(PartitionHeader)
	if w.Partition != nil {
		hint = strconv.Itoa(*w.Partition)
	}
	r, err := resultOf(&w)
	return r, hint, err
}

func resultOf(w *wireReply) (*Result, error) {
	if w.Allowed == nil {
		return nil, fmt.Errorf("%w: no \"allowed\" field", ErrBadReply)
	}
	r := &Result{
		Allowed:      *w.Allowed,
		Policy:       w.Policy,
		Revision:     w.Revision,
		Remaining:    "0",
		ShadowDenied: w.ShadowDenied,
	}
	if w.Remaining != "" {
		if m, ok := parseMicro(string(w.Remaining)); !ok || m < 0 {
			return nil, fmt.Errorf("%w: remaining %q is not a non-negative decimal", ErrBadReply, w.Remaining)
		}
		r.Remaining = Decimal(w.Remaining)
	}
	switch {
	case w.RetryAfterMs == -1:
		r.Never = true
	case w.RetryAfterMs < -1 || w.RetryAfterMs > maxMs:
		return nil, fmt.Errorf("%w: retry_after_ms %d out of range", ErrBadReply, w.RetryAfterMs)
	default:
		r.RetryAfter = time.Duration(w.RetryAfterMs) * time.Millisecond
	}
	if w.ResetAfterMs < 0 || w.ResetAfterMs > maxMs {
		return nil, fmt.Errorf("%w: reset_after_ms %d out of range", ErrBadReply, w.ResetAfterMs)
	}
	r.ResetAfter = time.Duration(w.ResetAfterMs) * time.Millisecond
	return r, nil
}

// decodeServiceError builds the *ServiceError of an error reply. An
// unparsable code becomes 0 (mapped to ErrInternal); an unparsable body
// leaves Symbol empty and uses the header text as Message.
func decodeServiceError(code, desc string, data []byte) *ServiceError {
	e := &ServiceError{Message: desc}
	if n, err := strconv.Atoi(code); err == nil && n >= 0 && n <= 999 {
		e.Code = n
	}
	var w wireError
	if len(data) > 0 && json.Unmarshal(data, &w) == nil {
		e.Symbol = w.Error
		if w.Message != "" {
			e.Message = w.Message
		}
	}
	return e
}
