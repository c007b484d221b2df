package rlconfig

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"pgregory.net/rapid"

	"github.com/limitmesh/limitmesh/mesh"
	"github.com/limitmesh/limitmesh/policies"
)

// testNames maps keys as the bridge does for keys that are already
// dimension names: unchanged, a repeated one with the suffix _2, _3...
func testNames(_ string, keys []string) []string {
	out := make([]string, len(keys))
	for i, k := range keys {
		out[i] = k
		for n := 2; slices.Contains(out[:i], out[i]) || out[i] == "domain"; n++ {
			out[i] = fmt.Sprintf("%s_%d", k, n)
		}
	}
	return out
}

func testOptions() Options {
	return Options{Names: testNames, DomainDimension: "domain", Parse: mesh.ParsePolicy}
}

func convertYAML(t *testing.T, o Options, files ...string) (*Result, error) {
	t.Helper()
	var cfgs []*Config
	for i, f := range files {
		cfg, err := Parse(fmt.Sprintf("f%d.yaml", i), []byte(f))
		if err != nil {
			return nil, err
		}
		cfgs = append(cfgs, cfg)
	}
	return Convert(cfgs, o)
}

// doc decodes a converted policy for comparisons.
type doc struct {
	Match  map[string]string `json:"match"`
	Key    []string          `json:"key"`
	Limits []struct {
		Name      string      `json:"name"`
		Algorithm string      `json:"algorithm"`
		Limit     json.Number `json:"limit"`
		Window    string      `json:"window"`
		Rate      string      `json:"rate"`
		Burst     json.Number `json:"burst"`
		Period    string      `json:"period"`
	} `json:"limits"`
	Mode   string `json:"mode"`
	Shadow bool   `json:"shadow"`
}

func decode(t *testing.T, p Policy) doc {
	t.Helper()
	var d doc
	if err := json.Unmarshal(p.Doc, &d); err != nil {
		t.Fatalf("%s: %v\n%s", p.Name, err, p.Doc)
	}
	return d
}

// summary is "name kind match key limit" per policy, for step tables.
func summary(t *testing.T, res *Result) []string {
	t.Helper()
	var out []string
	for _, p := range res.Policies {
		d := decode(t, p)
		var m []string
		for k, v := range d.Match {
			m = append(m, k+"="+v)
		}
		slices.Sort(m)
		l := d.Limits[0]
		lim := l.Algorithm + " " + string(l.Limit) + "/" + l.Window
		if l.Algorithm == TokenBucket {
			lim = l.Algorithm + " " + l.Rate + " burst " + string(l.Burst)
		} else if l.Algorithm == "quota" {
			lim = "quota " + string(l.Limit) + "/" + l.Period
		}
		if p.Kind == KindUnlimited {
			lim = "unlimited " + d.Mode
		}
		out = append(out, fmt.Sprintf("%s %s {%s} key=%v %s", p.Name, p.Kind, strings.Join(m, " "), d.Key, lim))
	}
	return out
}

func TestReadmeExamples(t *testing.T) {
	for _, tc := range []struct {
		name   string
		config string
		want   []string
		notes  int
	}{
		{"example 1: two values of one key", `
domain: mongo_cps
descriptors:
  - key: database
    value: users
    rate_limit: {unit: second, requests_per_unit: 500}
  - key: database
    value: default
    rate_limit: {unit: second, requests_per_unit: 500}
`, []string{
			"mongo_cps-database-users limit {database=users domain=mongo_cps} key=[] fixed_window 500/1s",
			"mongo_cps-database-default limit {database=default domain=mongo_cps} key=[] fixed_window 500/1s",
		}, 0},
		{"example 2: nested, and a key without a value", `
domain: messaging
descriptors:
  - key: message_type
    value: marketing
    descriptors:
      - key: to_number
        rate_limit:
          unit: day
          requests_per_unit: 5
  - key: to_number
    rate_limit:
      unit: day
      requests_per_unit: 100
`, []string{
			"messaging-message_type-marketing-to_number limit {domain=messaging message_type=marketing to_number=*} key=[to_number] fixed_window 5/24h",
			"messaging-to_number limit {domain=messaging to_number=*} key=[to_number] fixed_window 100/24h",
			// (message_type=other, to_number=n) gets no limit from
			// envoyproxy/ratelimit; messaging-to_number would match it.
			"messaging-message_type-to_number-unlimited unlimited {domain=messaging message_type=* to_number=*} key=[] unlimited local",
		}, 1},
		{"example 3: a value beside the same key without one; 0 denies all", `
domain: edge_proxy_per_ip
descriptors:
  - key: remote_address
    rate_limit:
      unit: second
      requests_per_unit: 10
  - key: remote_address
    value: 50.0.0.5
    rate_limit:
      unit: second
      requests_per_unit: 0
`, []string{
			"edge_proxy_per_ip-remote_address limit {domain=edge_proxy_per_ip remote_address=*} key=[remote_address] fixed_window 10/1s",
			"edge_proxy_per_ip-remote_address-50_0_0_5 limit {domain=edge_proxy_per_ip remote_address=50.0.0.5} key=[] fixed_window 0.000001/1s",
		}, 0},
		{"example 5: unlimited needs no policy where nothing else matches", `
domain: internal
descriptors:
  - key: ldap
    rate_limit:
      unlimited: true
  - key: azure
    rate_limit:
      unit: minute
      requests_per_unit: 100
`, []string{
			"internal-azure limit {azure=* domain=internal} key=[azure] fixed_window 100/1m",
		}, 0},
		{"example 6: shadow mode", `
domain: example6
descriptors:
  - key: service
    descriptors:
      - key: user
        value: user-a
        rate_limit:
          requests_per_unit: 10
          unit: second
        shadow_mode: true
      - key: user
        value: user-b
        rate_limit:
          requests_per_unit: 20
          unit: second
`, []string{
			"example6-service-user-user-a shadow {domain=example6 service=* user=user-a} key=[service] fixed_window 10/1s",
			"example6-service-user-user-b limit {domain=example6 service=* user=user-b} key=[service] fixed_window 20/1s",
		}, 0},
		{"example 8: detailed_metric is noted", `
domain: example8
descriptors:
  - key: key1
    detailed_metric: true
    rate_limit:
      unit: minute
      requests_per_unit: 10
  - key: key1
    value: value1
    rate_limit:
      unit: minute
      requests_per_unit: 20
`, []string{
			"example8-key1 limit {domain=example8 key1=*} key=[key1] fixed_window 10/1m",
			"example8-key1-value1 limit {domain=example8 key1=value1} key=[] fixed_window 20/1m",
		}, 1},
		{"shadow mode and unlimited under a broader limit get stand-ins", `
domain: rl
descriptors:
  - key: foo
    rate_limit: {unit: minute, requests_per_unit: 2}
    descriptors:
      - key: baz
        rate_limit: {unit: second, requests_per_unit: 1}
      - key: bay
        rate_limit: {unlimited: true}
      - key: baz
        value: shady
        rate_limit: {unit: minute, requests_per_unit: 1}
        shadow_mode: true
`, []string{
			"rl-foo limit {domain=rl foo=*} key=[foo] fixed_window 2/1m",
			"rl-foo-baz limit {baz=* domain=rl foo=*} key=[foo baz] fixed_window 1/1s",
			"rl-foo-baz-shady shadow {baz=shady domain=rl foo=*} key=[foo] fixed_window 1/1m",
			"rl-foo-baz-shady-unlimited unlimited {baz=shady domain=rl foo=*} key=[] unlimited local",
			"rl-foo-bay-unlimited unlimited {bay=* domain=rl foo=*} key=[] unlimited local",
		}, 2},
		{"lookup never backtracks: a value without the child stops there", `
domain: d
descriptors:
  - key: a
    value: x
    descriptors:
      - key: b
        value: z
        rate_limit: {unit: hour, requests_per_unit: 1}
  - key: a
    descriptors:
      - key: b
        rate_limit: {unit: hour, requests_per_unit: 2}
`, []string{
			"d-a-x-b-z limit {a=x b=z domain=d} key=[] fixed_window 1/1h",
			"d-a-b limit {a=* b=* domain=d} key=[a b] fixed_window 2/1h",
			// (a=x, b=y): envoyproxy/ratelimit stops under a=x.
			"d-a-x-b-unlimited unlimited {a=x b=* domain=d} key=[] unlimited local",
		}, 1},
		{"precedence by level: an exact first entry beats an exact second one", `
domain: d
descriptors:
  - key: a
    value: x
    descriptors:
      - key: b
        rate_limit: {unit: hour, requests_per_unit: 1}
  - key: a
    descriptors:
      - key: b
        value: z
        rate_limit: {unit: hour, requests_per_unit: 2}
`, []string{
			"d-a-x-b limit {a=x b=* domain=d} key=[b] fixed_window 1/1h",
			"d-a-b-z limit {a=* b=z domain=d} key=[a] fixed_window 2/1h",
			// (a=x, b=z): envoyproxy/ratelimit goes into a=x and takes b;
			// limitmesh ties (one exact value each) and takes the smaller
			// name, d-a-b-z: a copy of a=x > b's limit decides instead.
			"d-a-x-b-z copy {a=x b=z domain=d} key=[] fixed_window 1/1h",
		}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res, err := convertYAML(t, testOptions(), tc.config)
			if err != nil {
				t.Fatal(err)
			}
			if got := summary(t, res); !slices.Equal(got, tc.want) {
				t.Errorf("policies:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(tc.want, "\n"))
			}
			if len(res.Notes) != tc.notes {
				t.Errorf("notes %q, want %d", res.Notes, tc.notes)
			}
		})
	}
}

func TestUnsupported(t *testing.T) {
	for _, tc := range []struct {
		name, config, want string
	}{
		{"example 7: replaces", `
domain: example7
descriptors:
  - key: key_1
    value: value_1
    descriptors:
      - key: user
        value: bkthomps
        rate_limit:
          name: specific_limit
          requests_per_unit: 5
          unit: second
  - key: key_2
    value: value_2
    descriptors:
      - key: user
        value: bkthomps
        rate_limit:
          replaces:
            - name: specific_limit
          requests_per_unit: 10
          unit: second
`, `f0.yaml:16: example7: key_2=value_2 > user=bkthomps: replaces ["specific_limit"]`},
		{"example 9: prefix wildcard", `
domain: example9
descriptors:
  - key: key1
    value: value*
    rate_limit: {unit: minute, requests_per_unit: 20}
`, `f0.yaml:4: example9: key1=value*: value "value*" matches by prefix`},
		{"share_threshold", `
domain: d
descriptors:
  - key: k
    value: "*"
    share_threshold: true
    rate_limit: {unit: minute, requests_per_unit: 20}
`, "share_threshold"},
		{"\"*\" beside a key without a value", `
domain: d
descriptors:
  - key: k
    value: "*"
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: k
    rate_limit: {unit: minute, requests_per_unit: 10}
`, "never reaches the one without a value"},
		{"the same entries in two orders", `
domain: d
descriptors:
  - key: a
    value: x
    descriptors:
      - key: b
        rate_limit: {unit: minute, requests_per_unit: 1}
  - key: b
    descriptors:
      - key: a
        value: x
        rate_limit: {unit: minute, requests_per_unit: 2}
`, "limitmesh descriptors have no order"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := convertYAML(t, testOptions(), tc.config)
			if !errors.Is(err, ErrUnsupported) {
				t.Fatalf("err %v, want ErrUnsupported", err)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("err %q lacks %q", err, tc.want)
			}
		})
	}
}

func TestParseErrors(t *testing.T) {
	for _, tc := range []struct{ config, want string }{
		{"", "empty file"},
		{"domain: ''\ndescriptors: []\n", "the domain is empty"},
		{"domain: d\nextra: 1\n", `f0.yaml:2: unknown key "extra"`},
		{"domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n", `f0.yaml:4: invalid rate limit unit "fortnight"`},
		{"domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, unlimited: true}\n", "should not specify rate limit unit when unlimited"},
		{"domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: '5'}\n", "requests_per_unit must be a whole number"},
		{"domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: -1}\n", "requests_per_unit must be a whole number"},
		{"domain: d\ndescriptors:\n  - key: k\n    value: v\n  - key: k\n    value: v\n", `f0.yaml:5: k=v: duplicate descriptor composite key "k_v" (also on line 3)`},
		{"domain: d\ndescriptors:\n  - value: v\n", "descriptor has an empty key"},
		{"domain: d\ndescriptors:\n  - key: k\n    key: j\n", `key "key" repeated`},
		{"domain: d\n---\ndomain: e\n", "more than one YAML document"},
		{"domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, name: a, replaces: [{nam: b}]}\n", `unknown key "nam" in replaces`},
	} {
		_, err := Parse("f0.yaml", []byte(tc.config))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: err %v, want %q", tc.config, err, tc.want)
		}
	}
	// Accepted as envoyproxy/ratelimit accepts them: numbers as values,
	// an upper-case unit, unlimited with an invalid unit, aliases.
	cfg, err := Parse("ok.yaml", []byte(`
domain: d
descriptors:
  - &a
    key: port
    value: 443
    rate_limit: {unit: SECOND, requests_per_unit: 1}
  - key: k
    rate_limit: {unit: nonsense, unlimited: true}
  - key: other
    descriptors: [*a]
`))
	if err != nil {
		t.Fatal(err)
	}
	if n := cfg.Descriptors[0]; n.Value != "443" || n.Limit.Unit != "second" {
		t.Errorf("first descriptor %+v %+v", n, n.Limit)
	}
	if got := cfg.Descriptors[2].Children[0].Path(); got != "other > port=443" {
		t.Errorf("alias path %q", got)
	}
}

func TestAlgorithms(t *testing.T) {
	config := `
domain: d
descriptors:
  - key: s
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: w
    rate_limit: {unit: week, requests_per_unit: 7}
  - key: m
    rate_limit: {unit: month, requests_per_unit: 30, name: monthly}
  - key: y
    rate_limit: {unit: year, requests_per_unit: 365}
`
	res, err := convertYAML(t, testOptions(), config)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		"d-s limit {domain=d s=*} key=[s] fixed_window 3/1s",
		"d-w limit {domain=d w=*} key=[w] fixed_window 7/168h",
		"d-m limit {domain=d m=*} key=[m] fixed_window 30/720h",
		"d-y limit {domain=d y=*} key=[y] fixed_window 365/8760h",
	}
	if got := summary(t, res); !slices.Equal(got, want) {
		t.Errorf("fixed windows:\n%s", strings.Join(got, "\n"))
	}
	if n := decode(t, res.Policies[2]).Limits[0].Name; n != "monthly" {
		t.Errorf("limit name %q, want the rate_limit's name", n)
	}

	o := testOptions()
	o.CalendarMonth, o.Algorithm = true, SlidingWindow
	res, err = convertYAML(t, o, config)
	if err != nil {
		t.Fatal(err)
	}
	if got := summary(t, res); got[2] != "d-m limit {domain=d m=*} key=[m] quota 30/month" || got[0] != "d-s limit {domain=d s=*} key=[s] sliding_window 3/1s" {
		t.Errorf("calendar month, sliding windows:\n%s", strings.Join(got, "\n"))
	}

	o = testOptions()
	o.Algorithm = TokenBucket
	if _, err := convertYAML(t, o, config); err == nil || !strings.Contains(err.Error(), "token_bucket rate is per second, minute, hour or day") {
		t.Errorf("token bucket of a week: %v", err)
	}
	res, err = convertYAML(t, o, "domain: d\ndescriptors:\n  - key: s\n    rate_limit: {unit: hour, requests_per_unit: 0}\n")
	if err != nil {
		t.Fatal(err)
	}
	if got := summary(t, res); got[0] != "d-s limit {domain=d s=*} key=[s] token_bucket 0.000001/h burst 0.000001" {
		t.Errorf("token bucket: %s", got[0])
	}
}

func TestNames(t *testing.T) {
	o := testOptions()
	o.Names = func(_ string, keys []string) []string {
		out := make([]string, len(keys))
		for i, k := range keys {
			out[i] = strings.ToLower(strings.ReplaceAll(k, "-", "_"))
		}
		return out
	}
	long := strings.Repeat("v", 70)
	res, err := convertYAML(t, o, `
domain: Edge.Proxy
descriptors:
  - key: X-Client
    value: "a.b"
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: X-Client
    value: "a_b"
    rate_limit: {unit: second, requests_per_unit: 2}
  - key: long
    value: `+long+`
    rate_limit: {unit: second, requests_per_unit: 3}
`)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, p := range res.Policies {
		names = append(names, p.Name)
		if err := policies.ValidateName(p.Name); err != nil {
			t.Errorf("%s: %v", p.Name, err)
		}
	}
	if names[0] != "edge_proxy-x_client-a_b" || !strings.HasPrefix(names[1], "edge_proxy-x_client-a_b-") ||
		len(names[2]) != policies.MaxNameLen || !strings.HasPrefix(names[2], "edge_proxy-long-vvv") {
		t.Errorf("names %q", names)
	}
	if d := decode(t, res.Policies[0]); d.Match["x_client"] != "a.b" || d.Match["domain"] != "Edge.Proxy" {
		t.Errorf("match %v", d.Match)
	}

	// A value limitmesh cannot match is the parser's error, with the place.
	_, err = convertYAML(t, testOptions(), "domain: d\ndescriptors:\n  - key: k\n    value: "+strings.Repeat("x", 129)+"\n    rate_limit: {unit: second, requests_per_unit: 1}\n")
	if err == nil || !strings.Contains(err.Error(), "f0.yaml:3: d: k=xxx") || !strings.Contains(err.Error(), "the policy is not valid") {
		t.Errorf("long value: %v", err)
	}
	if _, err := convertYAML(t, testOptions(), "domain: d\n", "domain: d\n"); err == nil || !strings.Contains(err.Error(), `domain "d" is also in f0.yaml`) {
		t.Errorf("repeated domain: %v", err)
	}
}

// TestLookup pins lookup to envoyproxy/ratelimit's documented matching
// (its README's examples 3 and 4) and its no-backtracking walk.
func TestLookup(t *testing.T) {
	cfg, err := Parse("f.yaml", []byte(`
domain: d
descriptors:
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 10}
  - key: remote_address
    value: 50.0.0.5
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: key
    value: value
    rate_limit: {unit: second, requests_per_unit: 300}
  - key: k
    value: x
    descriptors:
      - key: sub
        value: z
        rate_limit: {unit: second, requests_per_unit: 1}
  - key: k
    descriptors:
      - key: sub
        rate_limit: {unit: second, requests_per_unit: 2}
  - key: w
    value: "*"
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: w
    value: v
    rate_limit: {unlimited: true}
`))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		req  []entry
		line int // of the descriptor that applies, 0 for none
	}{
		{[]entry{{"remote_address", "50.0.0.1"}}, 4},
		{[]entry{{"remote_address", "50.0.0.5"}}, 6},
		{[]entry{{"key", "value"}}, 9},
		{[]entry{{"key", "value"}, {"subkey", "subvalue"}}, 0}, // example 4: deeper than the config
		{[]entry{{"k", "x"}, {"sub", "z"}}, 15},
		{[]entry{{"k", "x"}, {"sub", "y"}}, 0}, // no way back to k > sub
		{[]entry{{"k", "q"}, {"sub", "y"}}, 20},
		{[]entry{{"k", "q"}}, 0},
		{[]entry{{"w", "anything"}}, 22},
		{[]entry{{"w", "v"}}, 0},
		{[]entry{{"unknown", "v"}}, 0},
	} {
		got := 0
		if n := lookup(cfg, tc.req); n != nil {
			got = n.Line
		}
		if got != tc.line {
			t.Errorf("%v: line %d, want %d", tc.req, got, tc.line)
		}
	}
}

// TestConvertAgreesWithLookup: for random configurations, every request of
// every configured key sequence gets from the converted policies (matched
// by limitmesh's own snapshot) the limit envoyproxy/ratelimit's lookup
// gives it, or none when it gives none. It checks Convert's result
// independently of Convert's own check loop.
func TestConvertAgreesWithLookup(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		keys := []string{"a", "b", "c"}
		vals := []string{"", "", "x", "y"}
		line := 0
		var gen func(depth int, parent *Node) []*Node
		gen = func(depth int, parent *Node) []*Node {
			var out []*Node
			seen := map[string]bool{}
			for range rapid.IntRange(0, 3).Draw(rt, "n") {
				k := rapid.SampledFrom(keys).Draw(rt, "key")
				v := rapid.SampledFrom(vals).Draw(rt, "value")
				if seen[k+"_"+v] {
					continue
				}
				seen[k+"_"+v] = true
				line++
				n := &Node{Key: k, Value: v, Line: line, parent: parent}
				switch rapid.IntRange(0, 5).Draw(rt, "limit") {
				case 0, 1:
				case 2:
					n.Limit = &Limit{Unlimited: true}
				default:
					n.Limit = &Limit{Unit: "minute", RequestsPerUnit: uint32(line)}
					n.ShadowMode = rapid.IntRange(0, 4).Draw(rt, "shadow") == 0
				}
				if depth < 3 {
					n.Children = gen(depth+1, n)
				}
				out = append(out, n)
			}
			return out
		}
		cfg := &Config{File: "r.yaml", Domain: "d", Descriptors: gen(1, nil)}
		res, err := Convert([]*Config{cfg}, testOptions())
		if errors.Is(err, ErrUnsupported) {
			return // the same keys and values in two orders
		}
		if err != nil {
			rt.Fatal(err)
		}
		var live []*policies.Policy
		lines := map[string]int{}
		for _, p := range res.Policies {
			pp, err := policies.Parse(p.Name, p.Doc)
			if err != nil {
				rt.Fatalf("%s: %v", p.Name, err)
			}
			if p.Kind != KindShadow {
				live = append(live, pp)
				lines[p.Name] = p.Line
			}
		}
		snap := policies.NewSnapshot(live)
		c := &converter{o: testOptions()}
		seqs, _ := c.shapes(cfg)
		for _, seq := range seqs {
			req := make([]entry, len(seq))
			var try func(i int)
			try = func(i int) {
				if i == len(seq) {
					want := 0
					if n := lookup(cfg, req); n != nil {
						want = n.Line
					}
					got := 0
					dims := []policies.Dim{{Name: "domain", Value: "d"}}
					names := testNames("d", seq)
					for i, e := range req {
						dims = append(dims, policies.Dim{Name: names[i], Value: e.value})
					}
					d, err := policies.NewDescriptor(dims)
					if err != nil {
						rt.Fatal(err)
					}
					if p := snap.Match(d); p != nil {
						got = lines[p.Name]
					}
					if got != want {
						var ps []string
						for _, p := range res.Policies {
							ps = append(ps, p.Name+" "+p.Kind+" "+string(p.Doc))
						}
						rt.Fatalf("%v: limit of line %d, envoyproxy/ratelimit's of line %d\n%s", req, got, want, strings.Join(ps, "\n"))
					}
					return
				}
				for _, v := range []string{"x", "y", "fresh"} {
					req[i] = entry{seq[i], v}
					try(i + 1)
				}
			}
			try(0)
		}
	})
}
