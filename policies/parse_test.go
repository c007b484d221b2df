package policies

import (
	"errors"
	"strings"
	"testing"

	"github.com/limitmesh/limitmesh/kvstate"
)

const contractExample = `{"match": {"tenant": "acme", "operation": "search"},
 "key": ["tenant", "operation", "plan"],
 "limits": [{"name": "rate", "algorithm": "token_bucket", "rate": "10/s", "burst": 40}],
 "shadow": false,
 "description": "Acme search contract"}`

func TestParseContractExample(t *testing.T) {
	p, err := Parse("acme-search", []byte(contractExample))
	if err != nil {
		t.Fatal(err)
	}
	if p.Name != "acme-search" || p.Mode != ModeStrict || p.Shadow || p.Description != "Acme search contract" {
		t.Errorf("header: %+v", p)
	}
	wantMatch := []Dim{{"operation", "search"}, {"tenant", "acme"}}
	if !equalDims(p.Match, wantMatch) {
		t.Errorf("match = %v, want %v", p.Match, wantMatch)
	}
	if got := strings.Join(p.Key, ","); got != "operation,plan,tenant" {
		t.Errorf("key = %s", got)
	}
	want := NamedLimit{Name: "rate", Limit: kvstate.Limit{Algorithm: kvstate.TokenBucket, Rate: 10_000_000, Burst: 40_000_000}}
	if len(p.Limits) != 1 || p.Limits[0] != want {
		t.Errorf("limits = %+v, want %+v", p.Limits, want)
	}
	if err := p.Validate(); err != nil {
		t.Errorf("Validate: %v", err)
	}
}

func equalDims(a, b []Dim) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// one wraps a single limit object in an otherwise valid document.
func one(limit string) string { return `{"limits":[` + limit + `]}` }

func TestParseAccepts(t *testing.T) {
	tb := func(rate, burst int64) kvstate.Limit {
		return kvstate.Limit{Algorithm: kvstate.TokenBucket, Rate: rate, Burst: burst}
	}
	win := func(a kvstate.Algorithm, limit, window int64) kvstate.Limit {
		return kvstate.Limit{Algorithm: a, Limit: limit, Window: window}
	}
	tbPer := func(rate, per, burst int64) kvstate.Limit {
		return kvstate.Limit{Algorithm: kvstate.TokenBucket, Rate: rate, RatePer: per, Burst: burst}
	}
	quota := func(limit int64, p kvstate.Period) kvstate.Limit {
		return kvstate.Limit{Algorithm: kvstate.Quota, Limit: limit, Period: p}
	}
	ms := int64(1_000_000)
	tests := []struct {
		doc  string
		want NamedLimit
	}{
		{one(`{"algorithm":"token_bucket","rate":"10/s","burst":1}`), NamedLimit{"token_bucket", tb(10_000_000, 1_000_000)}},
		{one(`{"algorithm":"token_bucket","rate":"600/m","burst":"2.5"}`), NamedLimit{"token_bucket", tb(10_000_000, 2_500_000)}},
		// 2.5/h = 2,500,000 micro / 3600 s = 694.44 micro/s: kept per hour, exactly.
		{one(`{"algorithm":"token_bucket","rate":"2.5/h","burst":0.000001}`), NamedLimit{"token_bucket", tbPer(2_500_000, 3600*sec, 1)}},
		{one(`{"algorithm":"gcra","rate":"1000/d","burst":40}`), NamedLimit{"gcra", kvstate.Limit{Algorithm: kvstate.GCRA, Rate: 1_000_000_000, RatePer: 86400 * sec, Burst: 40_000_000}}},
		// 86400/d is a whole 1/s: kept per second.
		{one(`{"algorithm":"token_bucket","rate":"86400/d","burst":1}`), NamedLimit{"token_bucket", tb(1_000_000, 1_000_000)}},
		{one(`{"algorithm":"token_bucket","rate":"0.000001/d","burst":1}`), NamedLimit{"token_bucket", tbPer(1, 86400*sec, 1_000_000)}},
		{one(`{"algorithm":"token_bucket","rate":"1/m","burst":1}`), NamedLimit{"token_bucket", tbPer(1_000_000, 60*sec, 1_000_000)}},
		{one(`{"algorithm":"quota","limit":20000000,"period":"month"}`), NamedLimit{"quota", quota(20_000_000_000_000, kvstate.Month)}},
		{one(`{"name":"q","algorithm":"quota","limit":"1000000000000","period":"hour"}`), NamedLimit{"q", quota(1_000_000_000_000_000_000, kvstate.Hour)}},
		{one(`{"algorithm":"quota","limit":0.5,"period":"week"}`), NamedLimit{"quota", quota(500_000, kvstate.Week)}},
		{one(`{"algorithm":"quota","period":"day","limit":"2.000001"}`), NamedLimit{"quota", quota(2_000_001, kvstate.Day)}},
		{one(`{"algorithm":"token_bucket","rate":"3600/h","burst":1}`), NamedLimit{"token_bucket", tb(1_000_000, 1_000_000)}},
		{one(`{"algorithm":"token_bucket","rate":"0.000001/s","burst":1}`), NamedLimit{"token_bucket", tb(1, 1_000_000)}},
		{one(`{"algorithm":"token_bucket","rate":"1.5/m","burst":1}`), NamedLimit{"token_bucket", tb(25_000, 1_000_000)}},
		{one(`{"name":"g","algorithm":"gcra","rate":"9223372036854.775807/s","burst":"9223372036854.775807"}`),
			NamedLimit{"g", kvstate.Limit{Algorithm: kvstate.GCRA, Rate: 9223372036854775807, Burst: 9223372036854775807}}},
		{one(`{"algorithm":"fixed_window","limit":100,"window":"1m"}`), NamedLimit{"fixed_window", win(kvstate.FixedWindow, 100_000_000, 60_000*ms)}},
		{one(`{"algorithm":"sliding_window","limit":"0.5","window":"1ms"}`), NamedLimit{"sliding_window", win(kvstate.SlidingWindow, 500_000, ms)}},
		{one(`{"algorithm":"sliding_log","limit":10000,"window":"1h30m"}`), NamedLimit{"sliding_log", win(kvstate.SlidingLog, 10_000_000_000, 90*60_000*ms)}},
		{one(`{"algorithm":"concurrency","limit":5,"window":"30s"}`), NamedLimit{"concurrency", win(kvstate.Concurrency, 5_000_000, 30_000*ms)}},
		{one(`{"algorithm":"concurrency","limit":5}`), NamedLimit{"concurrency", win(kvstate.Concurrency, 5_000_000, 3600_000*ms)}},
		{one(`{"name":null,"algorithm":"gcra","rate":"1/s","burst":1}`)[:0] + one(`{"name":"x-1_y","algorithm":"gcra","rate":"1/s","burst":1}`),
			NamedLimit{"x-1_y", kvstate.Limit{Algorithm: kvstate.GCRA, Rate: 1_000_000, Burst: 1_000_000}}},
	}
	for _, tt := range tests {
		p, err := Parse("p", []byte(tt.doc))
		if err != nil {
			t.Errorf("%s: %v", tt.doc, err)
			continue
		}
		if len(p.Limits) != 1 || p.Limits[0] != tt.want {
			t.Errorf("%s: limits %+v, want %+v", tt.doc, p.Limits, tt.want)
		}
		if err := p.Validate(); err != nil {
			t.Errorf("%s: Validate: %v", tt.doc, err)
		}
	}
}

func TestParseFields(t *testing.T) {
	lim := `"limits":[{"algorithm":"gcra","rate":"1/s","burst":1}]`
	tests := []struct {
		doc         string
		match, key  string
		mode        Mode
		shadow      bool
		description string
	}{
		{`{` + lim + `}`, "", "", ModeStrict, false, ""},
		{`{"match":{},"key":null,"mode":null,"shadow":null,"description":null,` + lim + `}`, "", "", ModeStrict, false, ""},
		{`{"match":{"b":"*","a":"x y ü"},` + lim + `,"mode":"async","shadow":true}`, "a=x y ü,b=*", "a,b", ModeAsync, true, ""},
		{`{"match":{"tenant":"acme"},"key":[],` + lim + `,"mode":"local"}`, "tenant=acme", "", ModeLocal, false, ""},
		{`{"match":{"tenant":"*"},"key":["user","tenant"],` + lim + `,"mode":"leased","description":"d"}`, "tenant=*", "tenant,user", ModeLeased, false, "d"},
		{` {` + lim + `}  ` + "\n", "", "", ModeStrict, false, ""},
	}
	for _, tt := range tests {
		p, err := Parse("p", []byte(tt.doc))
		if err != nil {
			t.Errorf("%s: %v", tt.doc, err)
			continue
		}
		var m []string
		for _, d := range p.Match {
			m = append(m, d.Name+"="+d.Value)
		}
		if got := strings.Join(m, ","); got != tt.match {
			t.Errorf("%s: match %q, want %q", tt.doc, got, tt.match)
		}
		if got := strings.Join(p.Key, ","); got != tt.key {
			t.Errorf("%s: key %q, want %q", tt.doc, got, tt.key)
		}
		if p.Mode != tt.mode || p.Shadow != tt.shadow || p.Description != tt.description {
			t.Errorf("%s: mode %v shadow %v description %q", tt.doc, p.Mode, p.Shadow, p.Description)
		}
	}
}

func TestParseRejects(t *testing.T) {
	long := strings.Repeat("a", 65)
	tests := []struct {
		name, doc, want string
	}{
		{"Bad", `{}`, `name: "Bad" is not [a-z0-9][a-z0-9_-]{0,63}`},
		{"-x", `{}`, `name: "-x" is not [a-z0-9][a-z0-9_-]{0,63}`},
		{long, `{}`, `name: "` + long + `" is not [a-z0-9][a-z0-9_-]{0,63}`},
		{"", `{}`, `name: "" is not [a-z0-9][a-z0-9_-]{0,63}`},
		{"p", ``, `policy is empty`},
		{"p", `[]`, `policy must be a JSON object`},
		{"p", `{"limits":`, `limits: malformed JSON: unexpected EOF`},
		{"p", `{`, `malformed JSON: unexpected EOF`},
		{"p", one(`{"algorithm":"gcra","rate":"1/s","burst":1}`) + `{}`, `trailing data after the policy object`},
		{"p", one(`{"algorithm":"gcra","rate":"1/s","burst":1}`) + `x`, `trailing data after the policy object`},
		{"p", `{"limit":[]}`, `limit: unknown field`},
		{"p", `{"a b":1}`, `"a b": unknown field`},
		{"p", `{}`, `limits: required (1..8 limits)`},
		{"p", `{"limits":null}`, `limits: must be an array of 1..8 limits`},
		{"p", `{"limits":{}}`, `limits: must be an array of 1..8 limits`},
		{"p", `{"limits":[]}`, `limits: is empty (needs 1..8 limits)`},
		{"p", `{"limits":[1]}`, `limits[0]: must be a limit object`},
		{"p", `{"limits":[null]}`, `limits[0]: must be a limit object`},
		{"p", `{"limits":[` + strings.Repeat(`{"name":"x","algorithm":"gcra","rate":"1/s","burst":1},`, 0) + nineLimits() + `]}`, `limits: has more than 8 limits`},
		{"p", `{"mode":"fast"}`, `mode: "fast" is not strict, async, local or leased`},
		{"p", `{"mode":1}`, `mode: must be a string`},
		{"p", `{"shadow":"yes"}`, `shadow: must be true or false`},
		{"p", `{"description":` + `"` + strings.Repeat("d", 1025) + `"}`, `description: is 1025 bytes (at most 1024)`},
		{"p", `{"description":1}`, `description: must be a string`},
		{"p", `{"shadow":true,"shadow":false}`, `shadow: duplicate field`},
		// match
		{"p", `{"match":[]}`, `match: must be an object of dimension -> value`},
		{"p", `{"match":{"Tenant":"a"}}`, `match: dimension name "Tenant" is not [a-z][a-z0-9_]{0,31}`},
		{"p", `{"match":{"1a":"a"}}`, `match: dimension name "1a" is not [a-z][a-z0-9_]{0,31}`},
		{"p", `{"match":{"` + strings.Repeat("a", 33) + `":"a"}}`, `match: dimension name "` + strings.Repeat("a", 33) + `" is not [a-z][a-z0-9_]{0,31}`},
		{"p", `{"match":{"a":"x","a":"y"}}`, `match.a: duplicate dimension`},
		{"p", `{"match":{"a":1}}`, `match.a: must be a string`},
		{"p", `{"match":{"a":null}}`, `match.a: must be a string`},
		{"p", `{"match":{"a":""}}`, `match.a: value is empty`},
		{"p", `{"match":{"a":"x\ty"}}`, `match.a: value has a control character`},
		{"p", `{"match":{"a":"x\u0085y"}}`, `match.a: value has a control character`},
		{"p", `{"match":{"a":"` + strings.Repeat("v", 129) + `"}}`, `match.a: value is 129 bytes (at most 128)`},
		{"p", `{"match":{` + manyDims(17) + `}}`, `match: has more than 16 entries`},
		// key
		{"p", `{"key":"tenant"}`, `key: must be an array of dimension names`},
		{"p", `{"key":[1]}`, `key[0]: must be a string`},
		{"p", `{"key":["a","B"]}`, `key[1]: "B" is not [a-z][a-z0-9_]{0,31}`},
		{"p", `{"key":["a","b","a"]}`, `key[2]: duplicate dimension "a"`},
		{"p", `{"key":[` + manyNames(17) + `]}`, `key: has more than 16 dimensions`},
		// limits: structure
		{"p", one(`{"rate":"1/s","burst":1}`), `limits[0].algorithm: required`},
		{"p", one(`{"algorithm":"leaky","rate":"1/s","burst":1}`), `limits[0].algorithm: unknown algorithm "leaky" (token_bucket, gcra, fixed_window, sliding_window, sliding_log, concurrency or quota)`},
		{"p", one(`{"algorithm":7}`), `limits[0].algorithm: must be a string`},
		{"p", one(`{"algorithm":"gcra","rate":"1/s","burst":1,"extra":2}`), `limits[0].extra: unknown field`},
		{"p", one(`{"algorithm":"gcra","algorithm":"gcra"}`), `limits[0].algorithm: duplicate field`},
		{"p", one(`{"algorithm":"gcra","rate":"1/s","burst":1,"limit":1}`), `limits[0].limit: is not a field of gcra`},
		{"p", one(`{"algorithm":"token_bucket","rate":"1/s","burst":1,"window":"1s"}`), `limits[0].window: is not a field of token_bucket`},
		{"p", one(`{"algorithm":"token_bucket","burst":1}`), `limits[0].rate: required for token_bucket`},
		{"p", one(`{"algorithm":"token_bucket","rate":"1/s"}`), `limits[0].burst: required for token_bucket`},
		{"p", one(`{"algorithm":"fixed_window","limit":1,"window":"1s","rate":"1/s"}`), `limits[0].rate: is not a field of fixed_window`},
		{"p", one(`{"algorithm":"sliding_log","limit":1,"window":"1s","burst":1}`), `limits[0].burst: is not a field of sliding_log`},
		{"p", one(`{"algorithm":"fixed_window","window":"1s"}`), `limits[0].limit: required for fixed_window`},
		{"p", one(`{"algorithm":"concurrency","limit":1,"window":"1us"}`), `limits[0].window: "1us" is under 1ms`},
		{"p", one(`{"name":"Rate","algorithm":"gcra","rate":"1/s","burst":1}`), `limits[0].name: "Rate" is not [a-z0-9_-]{1,64}`},
		{"p", one(`{"name":"","algorithm":"gcra","rate":"1/s","burst":1}`), `limits[0].name: "" is not [a-z0-9_-]{1,64}`},
		{"p", one(`{"name":null,"algorithm":"gcra","rate":"1/s","burst":1}`), `limits[0].name: must be a string`},
		{"p", `{"limits":[{"algorithm":"gcra","rate":"1/s","burst":1},{"algorithm":"gcra","rate":"2/s","burst":1}]}`, `limits[1].name: duplicate limit name "gcra" (also limits[0])`},
		{"p", `{"limits":[{"name":"a","algorithm":"gcra","rate":"1/s","burst":1},{"name":"a","algorithm":"fixed_window","limit":1,"window":"1s"}]}`, `limits[1].name: duplicate limit name "a" (also limits[0])`},
		// rates
		{"p", one(`{"algorithm":"token_bucket","rate":"ten per second","burst":1}`), `limits[0].rate: "ten per second" is not N/s, N/m, N/h or N/d`},
		{"p", one(`{"algorithm":"token_bucket","rate":10,"burst":1}`), `limits[0].rate: must be a string`},
		{"p", one(`{"algorithm":"token_bucket","rate":"10/w","burst":1}`), `limits[0].rate: "10/w" is not N/s, N/m, N/h or N/d`},
		{"p", one(`{"algorithm":"token_bucket","rate":"10/D","burst":1}`), `limits[0].rate: "10/D" is not N/s, N/m, N/h or N/d`},
		{"p", one(`{"algorithm":"token_bucket","rate":"/s","burst":1}`), `limits[0].rate: "/s" is not N/s, N/m, N/h or N/d`},
		{"p", one(`{"algorithm":"token_bucket","rate":"10","burst":1}`), `limits[0].rate: "10" is not N/s, N/m, N/h or N/d`},
		{"p", one(`{"algorithm":"token_bucket","rate":"10 /s","burst":1}`), `limits[0].rate: "10 /s" is not N/s, N/m, N/h or N/d`},
		{"p", one(`{"algorithm":"token_bucket","rate":"0/s","burst":1}`), `limits[0].rate: "0/s": N must be > 0`},
		{"p", one(`{"algorithm":"token_bucket","rate":"-1/s","burst":1}`), `limits[0].rate: "-1/s": N must be > 0`},
		{"p", one(`{"algorithm":"token_bucket","rate":"1e3/s","burst":1}`), `limits[0].rate: "1e3/s": N has an exponent (write the digits out)`},
		{"p", one(`{"algorithm":"token_bucket","rate":"0.0000001/s","burst":1}`), `limits[0].rate: "0.0000001/s": N has more than 6 fractional digits`},
		{"p", one(`{"algorithm":"token_bucket","rate":"0/d","burst":1}`), `limits[0].rate: "0/d": N must be > 0`},
		{"p", one(`{"algorithm":"token_bucket","rate":"0.0000001/d","burst":1}`), `limits[0].rate: "0.0000001/d": N has more than 6 fractional digits`},
		// quota
		{"p", one(`{"algorithm":"quota","limit":10}`), `limits[0].period: required for quota`},
		{"p", one(`{"algorithm":"quota","period":"day"}`), `limits[0].limit: required for quota`},
		{"p", one(`{"algorithm":"quota","limit":10,"period":"year"}`), `limits[0].period: "year" is not hour, day, week or month`},
		{"p", one(`{"algorithm":"quota","limit":10,"period":"Month"}`), `limits[0].period: "Month" is not hour, day, week or month`},
		{"p", one(`{"algorithm":"quota","limit":10,"period":30}`), `limits[0].period: must be a string`},
		{"p", one(`{"algorithm":"quota","limit":10,"period":null}`), `limits[0].period: must be a string`},
		{"p", one(`{"algorithm":"quota","limit":10,"period":"day","period":"day"}`), `limits[0].period: duplicate field`},
		{"p", one(`{"algorithm":"quota","limit":10,"period":"day","rate":"1/s"}`), `limits[0].rate: is not a field of quota`},
		{"p", one(`{"algorithm":"quota","limit":10,"period":"day","burst":1}`), `limits[0].burst: is not a field of quota`},
		{"p", one(`{"algorithm":"quota","limit":10,"period":"day","window":"1h"}`), `limits[0].window: is not a field of quota`},
		{"p", one(`{"algorithm":"quota","limit":0,"period":"day"}`), `limits[0].limit: 0 must be > 0`},
		{"p", one(`{"algorithm":"quota","limit":1000000000000.000001,"period":"day"}`), `limits[0].limit: 1000000000000.000001 is too large (at most 1000000000000)`},
		{"p", one(`{"algorithm":"quota","limit":"1e12","period":"day"}`), `limits[0].limit: "1e12" has an exponent (write the digits out)`},
		{"p", `{"limits":[{"algorithm":"gcra","rate":"1/s","burst":1},{"algorithm":"quota","limit":10,"period":"fortnight"}]}`, `limits[1].period: "fortnight" is not hour, day, week or month`},
		{"p", one(`{"algorithm":"fixed_window","limit":1,"window":"1s","period":"day"}`), `limits[0].period: is not a field of fixed_window`},
		{"p", one(`{"algorithm":"gcra","rate":"1/s","burst":1,"period":"day"}`), `limits[0].period: is not a field of gcra`},
		// max_keys
		{"p", one(`{"algorithm":"gcra","rate":"1/s","burst":1}`)[:1] + `"max_keys":0,` + one(`{"algorithm":"gcra","rate":"1/s","burst":1}`)[1:], `max_keys: 0 must be > 0`},
		{"p", `{"max_keys":-5}`, `max_keys: -5 must be > 0`},
		{"p", `{"max_keys":1.5}`, `max_keys: 1.5 is not a whole number`},
		{"p", `{"max_keys":"1e6"}`, `max_keys: "1e6" has an exponent (write the digits out)`},
		{"p", `{"max_keys":1e6}`, `max_keys: 1e6 has an exponent (write the digits out)`},
		{"p", `{"max_keys":"x"}`, `max_keys: "x" is not a decimal number`},
		{"p", `{"max_keys":""}`, `max_keys: "" is empty`},
		{"p", `{"max_keys":"010"}`, `max_keys: "010" is not a decimal number`},
		{"p", `{"max_keys":true}`, `max_keys: must be a whole number`},
		{"p", `{"max_keys":9223372036854775808}`, `max_keys: 9223372036854775808 is too large (at most 9223372036854775807)`},
		{"p", `{"max_keys":1,"max_keys":2}`, `max_keys: duplicate field`},
		// lease
		{"p", `{"lease":{},` + one(`{"algorithm":"gcra","rate":"1/s","burst":1}`)[1:], `lease: is only for "mode":"leased"`},
		{"p", `{"mode":"strict","lease":{"size":1},` + one(`{"algorithm":"gcra","rate":"1/s","burst":1}`)[1:], `lease: is only for "mode":"leased"`},
		{"p", `{"mode":"leased","lease":[]}`, `lease: must be an object with size, ttl and max_outstanding`},
		{"p", `{"mode":"leased","lease":{"sise":1}}`, `lease.sise: unknown field`},
		{"p", `{"mode":"leased","lease":{"size":1,"size":2}}`, `lease.size: duplicate field`},
		{"p", `{"mode":"leased","lease":{"size":0}}`, `lease.size: 0 must be > 0`},
		{"p", `{"mode":"leased","lease":{"size":"1.0000001"}}`, `lease.size: "1.0000001" has more than 6 fractional digits`},
		{"p", `{"mode":"leased","lease":{"size":true}}`, `lease.size: must be a number or a decimal string`},
		{"p", `{"mode":"leased","lease":{"ttl":2}}`, `lease.ttl: must be a string`},
		{"p", `{"mode":"leased","lease":{"ttl":"2 s"}}`, `lease.ttl: "2 s" is not a Go duration such as "2s" or "500ms"`},
		{"p", `{"mode":"leased","lease":{"ttl":"99ms"},` + one(`{"algorithm":"gcra","rate":"1/s","burst":1}`)[1:], `lease.ttl: "99ms" is under 100ms`},
		{"p", `{"mode":"leased","lease":{"max_outstanding":-1}}`, `lease.max_outstanding: -1 must be > 0`},
		{"p", `{"mode":"leased","lease":{"size":5,"max_outstanding":4},` + one(`{"algorithm":"gcra","rate":"1/s","burst":40}`)[1:], `lease.size: 5 is above max_outstanding 4`},
		{"p", `{"mode":"leased","lease":{"size":"41"},` + one(`{"algorithm":"gcra","rate":"1/s","burst":40}`)[1:], `lease.size: "41" is above max_outstanding 40`},
		{"p", one(`{"algorithm":"token_bucket","rate":"9223372036854.775808/s","burst":1}`), `limits[0].rate: "9223372036854.775808/s": N is too large (at most 9223372036854.775807)`},
		// decimals
		{"p", one(`{"algorithm":"token_bucket","rate":"1/s","burst":0}`), `limits[0].burst: 0 must be > 0`},
		{"p", one(`{"algorithm":"token_bucket","rate":"1/s","burst":"0.000000"}`), `limits[0].burst: "0.000000" must be > 0`},
		{"p", one(`{"algorithm":"token_bucket","rate":"1/s","burst":-5}`), `limits[0].burst: -5 must be > 0`},
		{"p", one(`{"algorithm":"token_bucket","rate":"1/s","burst":1e3}`), `limits[0].burst: 1e3 has an exponent (write the digits out)`},
		{"p", one(`{"algorithm":"token_bucket","rate":"1/s","burst":"1E3"}`), `limits[0].burst: "1E3" has an exponent (write the digits out)`},
		{"p", one(`{"algorithm":"token_bucket","rate":"1/s","burst":0.0000001}`), `limits[0].burst: 0.0000001 has more than 6 fractional digits`},
		{"p", one(`{"algorithm":"token_bucket","rate":"1/s","burst":"1.5x"}`), `limits[0].burst: "1.5x" is not a decimal number`},
		{"p", one(`{"algorithm":"token_bucket","rate":"1/s","burst":"01"}`), `limits[0].burst: "01" is not a decimal number`},
		{"p", one(`{"algorithm":"token_bucket","rate":"1/s","burst":"1."}`), `limits[0].burst: "1." is not a decimal number`},
		{"p", one(`{"algorithm":"token_bucket","rate":"1/s","burst":".5"}`), `limits[0].burst: ".5" is not a decimal number`},
		{"p", one(`{"algorithm":"token_bucket","rate":"1/s","burst":""}`), `limits[0].burst: "" is empty`},
		{"p", one(`{"algorithm":"token_bucket","rate":"1/s","burst":true}`), `limits[0].burst: must be a number or a decimal string`},
		{"p", one(`{"algorithm":"token_bucket","rate":"1/s","burst":9223372036855}`), `limits[0].burst: 9223372036855 is too large (at most 9223372036854.775807)`},
		{"p", one(`{"algorithm":"token_bucket","rate":"1/s","burst":"9223372036854.775808"}`), `limits[0].burst: "9223372036854.775808" is too large (at most 9223372036854.775807)`},
		{"p", one(`{"algorithm":"token_bucket","rate":"1/s","burst":100000000000000000000000}`), `limits[0].burst: 100000000000000000000000 is too large (at most 9223372036854.775807)`},
		// windows
		{"p", one(`{"algorithm":"fixed_window","limit":1,"window":"999us"}`), `limits[0].window: "999us" is under 1ms`},
		{"p", one(`{"algorithm":"fixed_window","limit":1,"window":"-1s"}`), `limits[0].window: "-1s" is under 1ms`},
		{"p", one(`{"algorithm":"fixed_window","limit":1,"window":"0"}`), `limits[0].window: "0" is under 1ms`},
		{"p", one(`{"algorithm":"fixed_window","limit":1,"window":"1 day"}`), `limits[0].window: "1 day" is not a Go duration such as "1s" or "500ms"`},
		{"p", one(`{"algorithm":"fixed_window","limit":1,"window":1000}`), `limits[0].window: must be a string`},
		{"p", one(`{"algorithm":"sliding_log","limit":10000.000001,"window":"1s"}`), `limits[0].limit: 10000.000001 is too large (at most 10000)`},
		{"p", one(`{"algorithm":"concurrency","limit":0,"window":"1s"}`), `limits[0].limit: 0 must be > 0`},
	}
	for _, tt := range tests {
		_, err := Parse(tt.name, []byte(tt.doc))
		if err == nil {
			t.Errorf("Parse(%q, %s) accepted, want %s", tt.name, tt.doc, tt.want)
			continue
		}
		if got := err.Error(); got != tt.want {
			t.Errorf("Parse(%q, %s)\n got  %s\n want %s", tt.name, tt.doc, got, tt.want)
		}
		var pe *Error
		if !errors.As(err, &pe) || !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: %T does not match *Error and ErrInvalid", tt.doc, err)
		}
	}
}

func nineLimits() string {
	var b []string
	for i := 0; i < 9; i++ {
		b = append(b, `{"name":"l`+string(rune('0'+i))+`","algorithm":"gcra","rate":"1/s","burst":1}`)
	}
	return strings.Join(b, ",")
}

func manyDims(n int) string {
	var b []string
	for i := 0; i < n; i++ {
		b = append(b, `"d`+string(rune('a'+i))+`":"v"`)
	}
	return strings.Join(b, ",")
}

func manyNames(n int) string {
	var b []string
	for i := 0; i < n; i++ {
		b = append(b, `"d`+string(rune('a'+i))+`"`)
	}
	return strings.Join(b, ",")
}

func TestValidateName(t *testing.T) {
	for _, ok := range []string{"a", "0", "acme-search", "a_b", "9-x", strings.Repeat("z", 64)} {
		if err := ValidateName(ok); err != nil {
			t.Errorf("ValidateName(%q) = %v", ok, err)
		}
	}
	for _, bad := range []string{"", "_a", "-a", "A", "a.b", "a b", "ü", strings.Repeat("z", 65)} {
		if err := ValidateName(bad); !errors.Is(err, ErrInvalid) {
			t.Errorf("ValidateName(%q) = %v, want ErrInvalid", bad, err)
		}
	}
}

func TestParseCost(t *testing.T) {
	good := []struct {
		in   string
		want int64
	}{
		{"1", 1_000_000},
		{"3", 3_000_000},
		{"1000000000", 1_000_000_000_000_000},
		{"0.000001", 1},
		{"0.5", 500_000},
		{"2.25", 2_250_000},
		{"999999999.999999", 999_999_999_999_999},
		{"1000000000.000000", 1_000_000_000_000_000},
	}
	for _, tt := range good {
		got, err := ParseCost(tt.in)
		if err != nil || got != tt.want {
			t.Errorf("ParseCost(%q) = %d, %v; want %d", tt.in, got, err, tt.want)
		}
	}
	bad := []struct{ in, want string }{
		{"", `cost: "" is empty`},
		{"0", `cost: "0" must be > 0`},
		{"0.0", `cost: "0.0" must be > 0`},
		{"-1", `cost: "-1" must be > 0`},
		{"0.0000001", `cost: "0.0000001" has more than 6 fractional digits`},
		{"1e3", `cost: "1e3" has an exponent (write the digits out)`},
		{"1000000001", `cost: "1000000001" is too large (at most 1000000000)`},
		{"1000000000.000001", `cost: "1000000000.000001" is too large (at most 1000000000)`},
		{"99999999999999999999999", `cost: "99999999999999999999999" is too large (at most 1000000000)`},
		{"+1", `cost: "+1" is not a decimal number`},
		{" 1", `cost: " 1" is not a decimal number`},
		{"1 ", `cost: "1 " is not a decimal number`},
		{"0x10", `cost: "0x10" is not a decimal number`},
		{"NaN", `cost: "NaN" is not a decimal number`},
		{"Infinity", `cost: "Infinity" is not a decimal number`},
		{"007", `cost: "007" is not a decimal number`},
	}
	for _, tt := range bad {
		got, err := ParseCost(tt.in)
		if err == nil {
			t.Errorf("ParseCost(%q) = %d, want error", tt.in, got)
			continue
		}
		if err.Error() != tt.want || !errors.Is(err, ErrInvalid) {
			t.Errorf("ParseCost(%q)\n got  %v\n want %s", tt.in, err, tt.want)
		}
	}
}

func TestParseCostAllocs(t *testing.T) {
	if n := testing.AllocsPerRun(100, func() { _, _ = ParseCost("12345") }); n != 0 {
		t.Errorf("ParseCost(integer) allocates %v times", n)
	}
}

func BenchmarkParseCost(b *testing.B) {
	for _, s := range []string{"3", "2.5"} {
		b.Run(s, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := ParseCost(s); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkParse(b *testing.B) {
	doc := []byte(contractExample)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Parse("acme-search", doc); err != nil {
			b.Fatal(err)
		}
	}
}
