package envoy

import (
	"testing"
	"time"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"

	"github.com/limitmesh/limitmesh/mesh/client"
	"github.com/limitmesh/limitmesh/policies"
)

func mustPolicy(t *testing.T, name, limits string) *policies.Policy {
	t.Helper()
	p, err := policies.Parse(name, []byte(`{"match":{"tenant":"*"},"limits":`+limits+`}`))
	if err != nil {
		t.Fatalf("%s: %v", limits, err)
	}
	return p
}

func TestCurrentLimit(t *testing.T) {
	const (
		sec   = rlsv3.RateLimitResponse_RateLimit_SECOND
		min   = rlsv3.RateLimitResponse_RateLimit_MINUTE
		hour  = rlsv3.RateLimitResponse_RateLimit_HOUR
		day   = rlsv3.RateLimitResponse_RateLimit_DAY
		week  = rlsv3.RateLimitResponse_RateLimit_WEEK
		month = rlsv3.RateLimitResponse_RateLimit_MONTH
	)
	for _, tc := range []struct {
		limits string
		n      uint32
		unit   rlsv3.RateLimitResponse_RateLimit_Unit
		mult   uint32 // 0: no multiplier sent
		item   string // RateLimit-Policy item; "" when no limit
	}{
		{`[{"algorithm":"token_bucket","rate":"10/s","burst":40}]`, 10, sec, 0, `"p";q=10;w=1`},
		{`[{"algorithm":"gcra","rate":"2.5/s","burst":5}]`, 150, min, 0, `"p";q=150;w=60`},
		{`[{"algorithm":"token_bucket","rate":"1000/d","burst":1000}]`, 1000, day, 0, `"p";q=1000;w=86400`},
		{`[{"algorithm":"token_bucket","rate":"180/m","burst":10}]`, 3, sec, 0, `"p";q=3;w=1`},
		{`[{"algorithm":"token_bucket","rate":"90/m","burst":10}]`, 90, min, 0, `"p";q=90;w=60`},
		{`[{"algorithm":"token_bucket","rate":"0.001/d","burst":1}]`, 0, 0, 0, ""},
		{`[{"algorithm":"fixed_window","limit":100,"window":"1m"}]`, 100, min, 0, `"p";q=100;w=60`},
		{`[{"algorithm":"sliding_window","limit":5,"window":"10s"}]`, 5, sec, 10, `"p";q=5;w=10`},
		{`[{"algorithm":"sliding_log","limit":7,"window":"2h"}]`, 7, hour, 2, `"p";q=7;w=7200`},
		{`[{"algorithm":"fixed_window","limit":5,"window":"1500ms"}]`, 0, 0, 0, ""},
		{`[{"algorithm":"fixed_window","limit":2.5,"window":"1s"}]`, 0, 0, 0, ""},
		{`[{"algorithm":"quota","limit":20000000,"period":"month"}]`, 20000000, month, 0, `"p";q=20000000`},
		{`[{"algorithm":"quota","limit":500,"period":"week"}]`, 500, week, 0, `"p";q=500;w=604800`},
		{`[{"algorithm":"quota","limit":10000000000,"period":"day"}]`, 0, 0, 0, ""},
		{`[{"algorithm":"concurrency","limit":4}]`, 0, 0, 0, ""},
		// The first limit that has a unit.
		{`[{"algorithm":"concurrency","limit":4},{"algorithm":"quota","limit":9,"period":"hour"}]`, 9, hour, 0, `"p";q=9;w=3600`},
	} {
		pl := newPolicyLimit(mustPolicy(t, "p", tc.limits))
		if tc.n == 0 {
			if pl.limit != nil || pl.policyItem != nil {
				t.Errorf("%s: limit %v, item %q; want none", tc.limits, pl.limit, pl.policyItem)
			}
			continue
		}
		l := pl.limit
		if l == nil || l.Name != "p" || l.RequestsPerUnit != tc.n || l.Unit != tc.unit || l.GetUnitMultiplier().GetValue() != tc.mult {
			t.Errorf("%s: %v, want %d per %d x %v", tc.limits, l, tc.n, tc.mult, tc.unit)
		}
		if string(pl.policyItem) != tc.item {
			t.Errorf("%s: RateLimit-Policy item %q, want %q", tc.limits, pl.policyItem, tc.item)
		}
	}
}

func TestResponseAndHeaders(t *testing.T) {
	bucket := newPolicyLimit(mustPolicy(t, "acme-search", `[{"algorithm":"token_bucket","rate":"10/s","burst":40}]`))
	quota := newPolicyLimit(mustPolicy(t, "acme-month", `[{"algorithm":"quota","limit":100,"period":"month"}]`))
	allowed := outcome{res: &client.Result{Allowed: true, Policy: "acme-search", Remaining: "12.7", ResetAfter: 2100 * time.Millisecond}, pl: bucket}
	denied := outcome{res: &client.Result{Allowed: false, Policy: "acme-month", Remaining: "0", RetryAfter: 1500 * time.Millisecond, ResetAfter: time.Hour}, pl: quota}
	never := outcome{res: &client.Result{Allowed: false, Policy: "acme-search", Remaining: "40", Never: true, ResetAfter: 0}, pl: bucket}
	unmatched := outcome{res: &client.Result{Allowed: true, Remaining: "0"}}
	refused := outcome{err: ErrRefused}
	refund := outcome{m: Mapped{Skip: true}}

	headers := func(r *rlsv3.RateLimitResponse) map[string]string {
		h := map[string]string{}
		for _, hv := range r.ResponseHeadersToAdd {
			h[hv.Key] = hv.Value
		}
		return h
	}

	r := response([]outcome{allowed, unmatched, refund})
	if r.OverallCode != rlsv3.RateLimitResponse_OK || len(r.Statuses) != 3 {
		t.Fatalf("allowed: %v", r)
	}
	if s := r.Statuses[0]; s.Code != rlsv3.RateLimitResponse_OK || s.LimitRemaining != 12 || s.CurrentLimit.GetRequestsPerUnit() != 10 ||
		s.DurationUntilReset.AsDuration() != 2100*time.Millisecond {
		t.Errorf("allowed status: %v", s)
	}
	for _, s := range r.Statuses[1:] {
		if s.Code != rlsv3.RateLimitResponse_OK || s.CurrentLimit != nil || s.LimitRemaining != 0 || s.DurationUntilReset != nil {
			t.Errorf("unmatched or refund: %v, want OK with no limit", s)
		}
	}
	h := headers(r)
	if h[HeaderRateLimit] != `"acme-search";r=12;t=3` || h[HeaderRateLimitPolicy] != `"acme-search";q=10;w=1` || h[HeaderRetryAfter] != "" {
		t.Errorf("allowed headers: %v", h)
	}

	r = response([]outcome{allowed, denied})
	if r.OverallCode != rlsv3.RateLimitResponse_OVER_LIMIT || r.Statuses[0].Code != rlsv3.RateLimitResponse_OK ||
		r.Statuses[1].Code != rlsv3.RateLimitResponse_OVER_LIMIT || r.Statuses[1].CurrentLimit.GetUnit() != rlsv3.RateLimitResponse_RateLimit_MONTH {
		t.Fatalf("one denied: %v", r)
	}
	h = headers(r)
	if h[HeaderRateLimit] != `"acme-search";r=12;t=3, "acme-month";r=0;t=3600` ||
		h[HeaderRateLimitPolicy] != `"acme-search";q=10;w=1, "acme-month";q=100` || h[HeaderRetryAfter] != "2" {
		t.Errorf("denied headers: %v", h)
	}

	r = response([]outcome{denied, never})
	if h = headers(r); h[HeaderRetryAfter] != "" {
		t.Errorf("a denial that can never pass: Retry-After %q, want none", h[HeaderRetryAfter])
	}

	r = response([]outcome{allowed, refused})
	if r.OverallCode != rlsv3.RateLimitResponse_OVER_LIMIT || r.Statuses[1].Code != rlsv3.RateLimitResponse_OVER_LIMIT || r.Statuses[1].CurrentLimit != nil {
		t.Fatalf("refused: %v", r)
	}
	if h = headers(r); h[HeaderRetryAfter] != "" || h[HeaderRateLimit] != `"acme-search";r=12;t=3` {
		t.Errorf("refused headers: %v", h)
	}
}
