package envoy

import (
	"math"
	"math/big"
	"strconv"
	"sync"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/client"
	"github.com/limitmesh/limitmesh/policies"
)

// Response header names (lower case, as HTTP/2 and Envoy want them): the
// draft RateLimit headers in the structured-field form the SDK's net/http
// middleware writes (mesh/client/middleware.go), and Retry-After on a
// denial.
const (
	HeaderRateLimit       = "ratelimit"
	HeaderRateLimitPolicy = "ratelimit-policy"
	HeaderRetryAfter      = "retry-after"
)

// policyLimit is what a policy contributes to the statuses it decides: its
// current_limit (nil when none of its limits has a RateLimit unit) and its
// RateLimit-Policy item. Both are built once per policy version and shared
// by responses (a proto message is only read while it is marshalled).
type policyLimit struct {
	limit      *rlsv3.RateLimitResponse_RateLimit
	policyItem []byte // `"name";q=N;w=S`, nil without a limit
}

// limitCache maps policy versions (immutable *policies.Policy values) to
// their policyLimit; it forgets everything once it holds maxCachedPolicies.
type limitCache struct {
	mu sync.Mutex
	m  map[*policies.Policy]*policyLimit
}

const maxCachedPolicies = 4096

func (c *limitCache) get(p *policies.Policy) *policyLimit {
	c.mu.Lock()
	defer c.mu.Unlock()
	if pl, ok := c.m[p]; ok {
		return pl
	}
	if c.m == nil || len(c.m) >= maxCachedPolicies {
		c.m = make(map[*policies.Policy]*policyLimit)
	}
	pl := newPolicyLimit(p)
	c.m[p] = pl
	return pl
}

// newPolicyLimit describes policy p: current_limit is its first limit (in
// document order) that has a RateLimit unit (rateLimitOf).
func newPolicyLimit(p *policies.Policy) *policyLimit {
	pl := &policyLimit{}
	for _, nl := range p.Limits {
		n, unit, mult, window, ok := rateLimitOf(nl.Limit)
		if !ok {
			continue
		}
		pl.limit = &rlsv3.RateLimitResponse_RateLimit{Name: p.Name, RequestsPerUnit: n, Unit: unit}
		if mult > 1 {
			pl.limit.UnitMultiplier = wrapperspb.UInt32(mult)
		}
		item := appendSFString(nil, p.Name)
		item = append(item, ";q="...)
		item = strconv.AppendUint(item, uint64(n), 10)
		if window > 0 {
			item = append(item, ";w="...)
			item = strconv.AppendInt(item, window, 10)
		}
		pl.policyItem = item
		break
	}
	return pl
}

// Seconds of the RateLimit units a limit may be expressed in.
var bucketUnits = []struct {
	unit    rlsv3.RateLimitResponse_RateLimit_Unit
	seconds int64
}{
	{rlsv3.RateLimitResponse_RateLimit_SECOND, 1},
	{rlsv3.RateLimitResponse_RateLimit_MINUTE, 60},
	{rlsv3.RateLimitResponse_RateLimit_HOUR, 3600},
	{rlsv3.RateLimitResponse_RateLimit_DAY, 86400},
}

// rateLimitOf expresses limit l as Envoy's RateLimit: n requests per
// mult units (the window: mult units, in seconds; 0 for a month), and ok
// false when it has no such form:
//
//   - token_bucket, gcra: the rate, in the smallest of second, minute, hour
//     and day in which it is a whole number (2.5/s is 150 per minute);
//   - fixed_window, sliding_window, sliding_log: the limit per window, when
//     both are whole (units, seconds), the unit the largest of day, hour,
//     minute and second dividing the window, with its multiplier (a 10s
//     window is 10 x SECOND);
//   - quota: the limit per hour, day, week or month, when whole;
//   - concurrency: none.
//
// n must be 1..4294967295.
func rateLimitOf(l kvstate.Limit) (n uint32, unit rlsv3.RateLimitResponse_RateLimit_Unit, mult uint32, window int64, ok bool) {
	switch l.Algorithm {
	case kvstate.TokenBucket, kvstate.GCRA:
		per := l.RatePer
		if per == 0 {
			per = kvstate.Second
		}
		// n = Rate * seconds * 1e9 / (per * 1e6), whole.
		den := new(big.Int).Mul(big.NewInt(per), big.NewInt(kvstate.Unit))
		for _, u := range bucketUnits {
			num := new(big.Int).Mul(big.NewInt(l.Rate), big.NewInt(u.seconds*kvstate.Second))
			q, r := new(big.Int).QuoRem(num, den, new(big.Int))
			if r.Sign() == 0 && q.Sign() > 0 && q.IsUint64() && q.Uint64() <= math.MaxUint32 {
				return uint32(q.Uint64()), u.unit, 1, u.seconds, true
			}
		}
	case kvstate.FixedWindow, kvstate.SlidingWindow, kvstate.SlidingLog:
		if l.Limit%kvstate.Unit != 0 || l.Window%kvstate.Second != 0 || l.Window <= 0 {
			return 0, 0, 0, 0, false
		}
		count, secs := l.Limit/kvstate.Unit, l.Window/kvstate.Second
		for i := len(bucketUnits) - 1; i >= 0; i-- {
			u := bucketUnits[i]
			if secs%u.seconds == 0 && count >= 1 && count <= math.MaxUint32 && secs/u.seconds <= math.MaxUint32 {
				return uint32(count), u.unit, uint32(secs / u.seconds), secs, true
			}
		}
	case kvstate.Quota:
		if l.Limit%kvstate.Unit != 0 || l.Limit/kvstate.Unit > math.MaxUint32 || l.Limit <= 0 {
			return 0, 0, 0, 0, false
		}
		count := uint32(l.Limit / kvstate.Unit)
		switch l.Period {
		case kvstate.Hour:
			return count, rlsv3.RateLimitResponse_RateLimit_HOUR, 1, 3600, true
		case kvstate.Day:
			return count, rlsv3.RateLimitResponse_RateLimit_DAY, 1, 86400, true
		case kvstate.Week:
			return count, rlsv3.RateLimitResponse_RateLimit_WEEK, 1, 7 * 86400, true
		case kvstate.Month:
			return count, rlsv3.RateLimitResponse_RateLimit_MONTH, 1, 0, true
		}
	}
	return 0, 0, 0, 0, false
}

// outcome is one descriptor's answer: refused (err wraps ErrRefused),
// skipped (a refund), or decided (res; pl when a policy decided).
type outcome struct {
	m   Mapped
	res *client.Result
	pl  *policyLimit
	err error
}

// status returns the descriptor's status and whether it is over the limit.
func (o *outcome) status() (*rlsv3.RateLimitResponse_DescriptorStatus, bool) {
	switch {
	case o.err != nil: // refused: no limit, nothing remaining
		return &rlsv3.RateLimitResponse_DescriptorStatus{Code: rlsv3.RateLimitResponse_OVER_LIMIT}, true
	case o.m.Skip || o.res == nil || o.res.Policy == "":
		return &rlsv3.RateLimitResponse_DescriptorStatus{Code: rlsv3.RateLimitResponse_OK}, false
	}
	st := &rlsv3.RateLimitResponse_DescriptorStatus{
		Code:               rlsv3.RateLimitResponse_OK,
		LimitRemaining:     uint32(min(o.res.Remaining.Floor(), math.MaxUint32)),
		DurationUntilReset: durationpb.New(o.res.ResetAfter),
	}
	if o.pl != nil {
		st.CurrentLimit = o.pl.limit
	}
	if !o.res.Allowed {
		st.Code = rlsv3.RateLimitResponse_OVER_LIMIT
	}
	return st, !o.res.Allowed
}

// response builds the RPC's answer from the descriptors' outcomes:
// OVER_LIMIT when any descriptor is over, one status per descriptor, and
// the headers (appendHeaders).
func response(outs []outcome) *rlsv3.RateLimitResponse {
	resp := &rlsv3.RateLimitResponse{
		OverallCode: rlsv3.RateLimitResponse_OK,
		Statuses:    make([]*rlsv3.RateLimitResponse_DescriptorStatus, len(outs)),
	}
	for i := range outs {
		st, over := outs[i].status()
		resp.Statuses[i] = st
		if over {
			resp.OverallCode = rlsv3.RateLimitResponse_OVER_LIMIT
		}
	}
	resp.ResponseHeadersToAdd = appendHeaders(nil, outs)
	return resp
}

// appendHeaders appends the response headers: for the descriptors a policy
// decided, in order, a RateLimit list item `"policy";r=R;t=T` each (R the
// remaining units rounded down, T the seconds until the limit is full
// again, rounded up) and, for those whose policy has a current_limit, a
// RateLimit-Policy item `"policy";q=N;w=S` (N requests per window of S
// seconds; no w for a month); on a denial, Retry-After: the longest wait of
// the denied descriptors in whole seconds rounded up, at least 1, omitted
// when one of them can never be admitted or only refusals denied.
func appendHeaders(dst []*corev3.HeaderValue, outs []outcome) []*corev3.HeaderValue {
	var rl, rlp []byte
	var retry time.Duration
	denied, never := false, false
	for i := range outs {
		o := &outs[i]
		if o.err != nil || o.res == nil || o.res.Policy == "" {
			continue
		}
		if len(rl) > 0 {
			rl = append(rl, ", "...)
		}
		rl = appendSFString(rl, o.res.Policy)
		rl = append(rl, ";r="...)
		rl = strconv.AppendInt(rl, o.res.Remaining.Floor(), 10)
		rl = append(rl, ";t="...)
		rl = strconv.AppendInt(rl, ceilSeconds(o.res.ResetAfter), 10)
		if o.pl != nil && o.pl.policyItem != nil {
			if len(rlp) > 0 {
				rlp = append(rlp, ", "...)
			}
			rlp = append(rlp, o.pl.policyItem...)
		}
		if !o.res.Allowed {
			denied = true
			never = never || o.res.Never
			retry = max(retry, o.res.RetryAfter)
		}
	}
	if len(rl) > 0 {
		dst = append(dst, &corev3.HeaderValue{Key: HeaderRateLimit, Value: string(rl)})
	}
	if len(rlp) > 0 {
		dst = append(dst, &corev3.HeaderValue{Key: HeaderRateLimitPolicy, Value: string(rlp)})
	}
	if denied && !never {
		dst = append(dst, &corev3.HeaderValue{Key: HeaderRetryAfter, Value: strconv.FormatInt(max(ceilSeconds(retry), 1), 10)})
	}
	return dst
}

// ceilSeconds rounds d up to whole seconds (0 for d <= 0).
func ceilSeconds(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	return int64((d + time.Second - 1) / time.Second)
}

// appendSFString appends s as an RFC 8941 sf-string: quotes and
// backslashes escaped, characters outside printable ASCII dropped (policy
// names are [a-z0-9_-], so nothing is dropped in practice).
func appendSFString(dst []byte, s string) []byte {
	dst = append(dst, '"')
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '"' || c == '\\':
			dst = append(dst, '\\', c)
		case c >= 0x20 && c < 0x7f:
			dst = append(dst, c)
		}
	}
	return append(dst, '"')
}
