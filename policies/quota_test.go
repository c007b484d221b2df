package policies

import (
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
)

// acmeMonthly is Acme's contract: 10/s with a burst of 40 and 20 million
// units a month, atomically.
const acmeMonthly = `{"match":{"tenant":"acme"},
 "limits":[{"name":"rate","algorithm":"token_bucket","rate":"10/s","burst":40},
           {"name":"monthly","algorithm":"quota","limit":20000000,"period":"month"}],
 "max_keys":100000}`

func TestParseRateAndQuota(t *testing.T) {
	p, err := Parse("acme", []byte(acmeMonthly))
	if err != nil {
		t.Fatal(err)
	}
	want := []NamedLimit{
		{Name: "rate", Limit: kvstate.Limit{Algorithm: kvstate.TokenBucket, Rate: 10 * u, Burst: 40 * u}},
		{Name: "monthly", Limit: kvstate.Limit{Algorithm: kvstate.Quota, Limit: 20_000_000 * u, Period: kvstate.Month}},
	}
	if !reflect.DeepEqual(p.Limits, want) || p.MaxKeys != 100_000 || p.Lease != (Lease{}) {
		t.Fatalf("parsed %+v", p)
	}
	if err := p.Validate(); err != nil {
		t.Fatal(err)
	}
	// Both limits decide atomically: the bucket admits 40 at once, the
	// quota counts them.
	limits := []kvstate.Limit{p.Limits[0].Limit, p.Limits[1].Limit}
	at := time.Date(2026, 12, 31, 23, 0, 0, 0, time.UTC).UnixNano()
	d, states := kvstate.DecideAll(limits, nil, at, 40*u, nil)
	if !d.Allowed || states[1].Count != 40*u {
		t.Fatalf("first: %+v %+v", d, states)
	}
}

func TestParseMaxKeys(t *testing.T) {
	lim := `"limits":[{"algorithm":"gcra","rate":"1/s","burst":1}]`
	for doc, want := range map[string]int64{
		`{` + lim + `}`:                                DefaultMaxKeys,
		`{"max_keys":null,` + lim + `}`:                DefaultMaxKeys,
		`{"max_keys":1,` + lim + `}`:                   1,
		`{"max_keys":"250000",` + lim + `}`:            250_000,
		`{"max_keys":9223372036854775807,` + lim + `}`: 9223372036854775807,
	} {
		p, err := Parse("p", []byte(doc))
		if err != nil {
			t.Errorf("%s: %v", doc, err)
			continue
		}
		if p.MaxKeys != want {
			t.Errorf("%s: MaxKeys %d, want %d", doc, p.MaxKeys, want)
		}
	}
}

func TestParseLease(t *testing.T) {
	leased := func(lease, limits string) string {
		if lease != "" {
			lease = `"lease":` + lease + `,`
		}
		return `{"mode":"leased",` + lease + `"limits":[` + limits + `]}`
	}
	bucket40 := `{"algorithm":"token_bucket","rate":"10/s","burst":40}`
	tests := []struct {
		doc  string
		want Lease
	}{
		// Defaults: a tenth of the smallest capacity, 2 s, the smallest capacity.
		{leased("", bucket40), Lease{Size: 4 * u, TTL: 2 * time.Second, MaxOutstanding: 40 * u}},
		{leased("null", bucket40), Lease{Size: 4 * u, TTL: 2 * time.Second, MaxOutstanding: 40 * u}},
		{leased("{}", bucket40), Lease{Size: 4 * u, TTL: 2 * time.Second, MaxOutstanding: 40 * u}},
		// The contract's example.
		{leased(`{"size": 10, "ttl": "2s", "max_outstanding": 40}`, bucket40), Lease{Size: 10 * u, TTL: 2 * time.Second, MaxOutstanding: 40 * u}},
		{leased(`{"size":"2.5","ttl":"100ms"}`, bucket40), Lease{Size: 2_500_000, TTL: 100 * time.Millisecond, MaxOutstanding: 40 * u}},
		// The smallest limit: 25 of the quota, not 40 of the bucket; a
		// tenth of it is 2.5.
		{leased("", bucket40+`,{"algorithm":"quota","limit":25,"period":"day"}`), Lease{Size: 2_500_000, TTL: 2 * time.Second, MaxOutstanding: 25 * u}},
		// At least 1 unit...
		{leased("", `{"algorithm":"gcra","rate":"1/s","burst":5}`), Lease{Size: u, TTL: 2 * time.Second, MaxOutstanding: 5 * u}},
		// ...and at most max_outstanding.
		{leased("", `{"algorithm":"gcra","rate":"1/s","burst":0.5}`), Lease{Size: 500_000, TTL: 2 * time.Second, MaxOutstanding: 500_000}},
		{leased(`{"max_outstanding":2}`, bucket40), Lease{Size: 2 * u, TTL: 2 * time.Second, MaxOutstanding: 2 * u}},
		{leased(`{"max_outstanding":100,"ttl":"1m"}`, bucket40), Lease{Size: 4 * u, TTL: time.Minute, MaxOutstanding: 100 * u}},
		{leased(`{"size":40}`, bucket40), Lease{Size: 40 * u, TTL: 2 * time.Second, MaxOutstanding: 40 * u}},
	}
	for _, tt := range tests {
		p, err := Parse("p", []byte(tt.doc))
		if err != nil {
			t.Errorf("%s: %v", tt.doc, err)
			continue
		}
		if p.Lease != tt.want {
			t.Errorf("%s: lease %+v, want %+v", tt.doc, p.Lease, tt.want)
		}
		if err := p.Validate(); err != nil {
			t.Errorf("%s: Validate: %v", tt.doc, err)
		}
		if got := DefaultLease(p.Limits); !strings.Contains(tt.doc, `"lease":{"`) && got != tt.want {
			t.Errorf("%s: DefaultLease %+v", tt.doc, got)
		}
	}
}

func TestValidateNewFields(t *testing.T) {
	base := func() *Policy {
		p, err := Parse("p", []byte(`{"mode":"leased","limits":[{"algorithm":"gcra","rate":"1/s","burst":40}]}`))
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	tests := []struct {
		edit func(*Policy)
		want string
	}{
		{func(p *Policy) { p.MaxKeys = 0 }, `max_keys: 0 must be > 0`},
		{func(p *Policy) { p.Lease.Size = 0 }, `lease.size: 0 must be > 0`},
		{func(p *Policy) { p.Lease.MaxOutstanding = -1 }, `lease.max_outstanding: -0.000001 must be > 0`},
		{func(p *Policy) { p.Lease.TTL = time.Millisecond }, `lease.ttl: "1ms" is under 100ms`},
		{func(p *Policy) { p.Lease.Size = 41 * u }, `lease.size: 41 is above max_outstanding 40`},
		{func(p *Policy) { p.Mode = ModeStrict }, `lease: is only for "mode":"leased"`},
		{func(p *Policy) { p.Limits[0].RatePer = 7 }, `limits[0].rate: is not per second, minute, hour or day`},
		{func(p *Policy) { p.Limits[0].Rate, p.Limits[0].RatePer = 60*u, 60*sec }, `limits[0].rate: a whole number of micro-units per second is kept per second`},
		{func(p *Policy) { p.Limits[0].Period = kvstate.Day }, `limits[0]: a bucket limit has no limit, window or period`},
		{func(p *Policy) {
			p.Limits[0].Limit = kvstate.Limit{Algorithm: kvstate.Quota, Limit: MaxQuota + 1, Period: kvstate.Day}
		}, `limits[0].limit: 1000000000000.000001 is above 1000000000000, the most a quota allows`},
		{func(p *Policy) { p.Limits[0].Limit = kvstate.Limit{Algorithm: kvstate.Quota, Limit: u} }, `limits[0].period: is not hour, day, week or month`},
		{func(p *Policy) {
			p.Limits[0].Limit = kvstate.Limit{Algorithm: kvstate.Quota, Limit: u, Period: kvstate.Day, Window: sec}
		}, `limits[0]: a quota limit has no rate, burst or window`},
		{func(p *Policy) {
			p.Limits[0].Limit = kvstate.Limit{Algorithm: kvstate.FixedWindow, Limit: u, Window: sec, Period: kvstate.Day}
		}, `limits[0]: a fixed_window limit has no rate, burst or period`},
	}
	for _, tt := range tests {
		p := base()
		if err := p.Validate(); err != nil {
			t.Fatal(err)
		}
		tt.edit(p)
		err := p.Validate()
		if err == nil || err.Error() != tt.want || !errors.Is(err, ErrInvalid) {
			t.Errorf("Validate = %v, want %s", err, tt.want)
		}
	}
}

func TestMarshalNewFields(t *testing.T) {
	docs := map[string]string{
		acmeMonthly: `{"match":{"tenant":"acme"},"key":["tenant"],"limits":[` +
			`{"name":"rate","algorithm":"token_bucket","rate":"10/s","burst":40},` +
			`{"name":"monthly","algorithm":"quota","limit":20000000,"period":"month"}],` +
			`"mode":"strict","max_keys":100000,"shadow":false,"description":""}`,
		`{"mode":"leased","lease":{"ttl":"1m30s"},"limits":[{"algorithm":"gcra","rate":"1000/d","burst":2.5},{"algorithm":"token_bucket","rate":"90/m","burst":1}]}`: `{"match":{},"key":[],"limits":[` +
			`{"name":"gcra","algorithm":"gcra","rate":"1000/d","burst":2.5},` +
			`{"name":"token_bucket","algorithm":"token_bucket","rate":"1.5/s","burst":1}],` +
			`"mode":"leased","lease":{"size":1,"ttl":"1m30s","max_outstanding":1},"max_keys":1000000,"shadow":false,"description":""}`,
	}
	for doc, want := range docs {
		p, err := Parse("p", []byte(doc))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := p.MarshalJSON()
		if string(b) != want {
			t.Errorf("marshal:\n got  %s\n want %s", b, want)
		}
		q, err := Parse("p", b)
		if err != nil || !reflect.DeepEqual(p, q) {
			t.Errorf("round trip: %v\n%+v\n%+v", err, p, q)
		}
	}
}

func TestFormatRate(t *testing.T) {
	for _, c := range []struct {
		rate string
		want string
	}{
		{"10/s", "10/s"}, {"600/m", "10/s"}, {"1/m", "1/m"}, {"2.5/h", "2.5/h"}, {"3600/h", "1/s"},
		{"1000/d", "1000/d"}, {"0.000001/d", "0.000001/d"}, {"86400/d", "1/s"}, {"43200/d", "0.5/s"},
	} {
		rate, per, reason := parseRate(c.rate)
		if reason != "" {
			t.Fatalf("%s: %s", c.rate, reason)
		}
		if got := FormatRate(kvstate.Limit{Algorithm: kvstate.GCRA, Rate: rate, RatePer: per}); got != c.want {
			t.Errorf("FormatRate(%s) = %s, want %s", c.rate, got, c.want)
		}
	}
	if got := FormatRate(kvstate.Limit{Rate: 3 * u, RatePer: 90 * sec}); got != "3 per 1m30s" {
		t.Errorf("odd span: %s", got)
	}
}

func TestOverflowKey(t *testing.T) {
	p := &Policy{Name: "acme-search", Key: []string{"tenant"}}
	if got := p.OverflowKey(); got != "p.acme-search._overflow" {
		t.Fatalf("OverflowKey = %s", got)
	}
	// No limit key of the policy is its overflow key, literal or digest.
	for _, v := range []string{"_overflow", "overflow", strings.Repeat(".", 128)} {
		d, err := NewDescriptor([]Dim{{"tenant", v}})
		if err != nil {
			t.Fatal(err)
		}
		if k, _ := p.LimitKey(d); k == p.OverflowKey() || !strings.HasPrefix(k, "p.acme-search.") {
			t.Fatalf("limit key %s", k)
		}
	}
	long := &Policy{Name: strings.Repeat("z", 64)}
	if k := long.OverflowKey(); len(k) != 76 {
		t.Fatalf("longest overflow key: %d bytes", len(k))
	}
}

func TestTransitionQuota(t *testing.T) {
	parse := func(doc string) *Policy {
		p, err := Parse("p", []byte(doc))
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	monthly := parse(acmeMonthly)
	at := time.Date(2026, 12, 10, 0, 0, 0, 0, time.UTC).UnixNano()
	limits := func(p *Policy) []kvstate.Limit {
		var ls []kvstate.Limit
		for _, l := range p.Limits {
			ls = append(ls, l.Limit)
		}
		return ls
	}
	_, states := kvstate.DecideAll(limits(monthly), nil, at, 30*u, nil)
	left := func(p *Policy, states []kvstate.State, name string) int64 {
		for i, l := range p.Limits {
			if l.Name == name {
				d, _ := kvstate.Decide(l.Limit, states[i], at+sec, 0)
				return d.Remaining
			}
		}
		t.Fatalf("no limit %s", name)
		return 0
	}
	// The quota reordered and lowered, same period: matched by name, the
	// 30 spent are kept (100 - 30 = 70 left).
	lowered := parse(`{"match":{"tenant":"acme"},"limits":[
		{"name":"monthly","algorithm":"quota","limit":100,"period":"month"},
		{"name":"rate","algorithm":"token_bucket","rate":"10/s","burst":40}]}`)
	got := Transition(monthly, lowered, states, at+sec)
	if l := left(lowered, got, "monthly"); l != 70*u {
		t.Errorf("lowered quota: %d left", l)
	}
	// Lowered under what was spent: nothing left this period.
	tiny := parse(`{"limits":[{"name":"monthly","algorithm":"quota","limit":20,"period":"month"}]}`)
	if l := left(tiny, Transition(monthly, tiny, states, at+sec), "monthly"); l != 0 {
		t.Errorf("quota under spent: %d left", l)
	}
	// A changed period starts fresh.
	daily := parse(`{"limits":[{"name":"monthly","algorithm":"quota","limit":100,"period":"day"}]}`)
	if l := left(daily, Transition(monthly, daily, states, at+sec), "monthly"); l != 100*u {
		t.Errorf("changed period: %d left", l)
	}
	// A rate moved to a per-day rate keeps its credit: 10 left after the
	// 30 spent, plus 1 s at 10/s.
	perDay := parse(`{"limits":[{"name":"rate","algorithm":"token_bucket","rate":"864001/d","burst":40}]}`)
	got = Transition(monthly, perDay, states, at+sec)
	if l := left(perDay, got, "rate"); l != 20*u {
		t.Errorf("per-day rate: %d left", l)
	}
}
