package policies

import (
	"bytes"
	"encoding/json"
	"io"
	"math"
	"slices"
	"strconv"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
)

// Parse parses and validates one policy document (CONTRACT.md §3) stored
// under name. Decoding is strict: unknown fields, duplicate keys, wrong
// types and trailing data are invalid. The document's fields:
//
//	match        object of dimension -> value ("*": present with any value);
//	             absent or {} matches every descriptor
//	key          array of dimension names forming the limit key; absent or
//	             null: the match names; [] : one key shared by everyone
//	limits       1..8 limit objects (below)
//	mode         "strict" (default), "async", "local" or "leased"
//	lease        leased mode only: object with the optional fields size
//	             (decimal units), ttl (a Go duration >= 100ms) and
//	             max_outstanding (decimal units); see [Lease] for the
//	             defaults, which Parse fills in for every leased policy
//	max_keys     positive integer (number or string), default 1,000,000
//	shadow       bool
//	description  string, at most 1024 bytes
//
// A null value is the same as an absent field, except for limits.
//
// A limit object has "name" (optional, [a-z0-9_-]{1,64}, default the
// algorithm's name, unique in the policy), "algorithm" and the fields of its
// algorithm, and no others:
//
//	token_bucket, gcra       rate ("N/s", "N/m", "N/h", "N/d"), burst
//	fixed_window,
//	sliding_window,
//	sliding_log              limit, window (a Go duration >= 1ms);
//	                         sliding_log limit <= 10000
//	concurrency              limit (held at once), window (how long a hold
//	                         lasts before it expires, a Go duration >= 1ms)
//	quota                    limit (<= 1e12 per period), period ("hour",
//	                         "day", "week" or "month", UTC; weeks start on
//	                         Monday)
//
// burst and limit are a JSON number or a string holding one, with at most 6
// fractional digits and no exponent, > 0; they become micro-units exactly.
// A rate's N follows the same syntax; the rate is kept exactly, per second
// or over its own period (see parseRate).
//
// Errors are [*Error] naming the field, such as
// `limits[0].rate: "ten per second" is not N/s, N/m, N/h or N/d`, and match
// [ErrInvalid]. Revision is left 0 for the caller to set.
func Parse(name string, doc []byte) (*Policy, error) {
	if err := ValidateName(name); err != nil {
		return nil, err
	}
	ps := &parser{dec: json.NewDecoder(bytes.NewReader(doc))}
	ps.dec.UseNumber()
	p, err := ps.policy(name)
	if err != nil {
		return nil, err
	}
	if _, err := ps.dec.Token(); err != io.EOF {
		return nil, invalid("", "trailing data after the policy object")
	}
	return p, nil
}

type parser struct {
	dec *json.Decoder
}

// token reads the next token; a syntax error or early end is reported at path.
func (ps *parser) token(path string) (json.Token, error) {
	t, err := ps.dec.Token()
	if err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return nil, invalid(path, "malformed JSON: "+err.Error())
	}
	return t, nil
}

// key reads an object key, or returns ok=false at the object's end.
func (ps *parser) key(path string) (string, bool, error) {
	if !ps.dec.More() {
		if _, err := ps.token(path); err != nil { // the closing '}'
			return "", false, err
		}
		return "", false, nil
	}
	t, err := ps.token(path)
	if err != nil {
		return "", false, err
	}
	k, _ := t.(string) // the decoder only yields string keys
	return k, true, nil
}

func (ps *parser) expectDelim(path string, d json.Delim, what string) (isNull bool, err error) {
	t, err := ps.token(path)
	if err != nil {
		return false, err
	}
	if t == nil {
		return true, nil
	}
	if got, ok := t.(json.Delim); !ok || got != d {
		return false, invalid(path, "must be "+what)
	}
	return false, nil
}

// str reads a string value (or null, when nullOK).
func (ps *parser) str(path string, nullOK bool) (s string, isNull bool, err error) {
	t, err := ps.token(path)
	if err != nil {
		return "", false, err
	}
	switch v := t.(type) {
	case string:
		return v, false, nil
	case nil:
		if nullOK {
			return "", true, nil
		}
	}
	return "", false, invalid(path, "must be a string")
}

// decimal reads a JSON number or a string holding a decimal; text is the
// raw text and display how to print it in errors.
func (ps *parser) decimal(path string) (text, display string, err error) {
	t, err := ps.token(path)
	if err != nil {
		return "", "", err
	}
	switch v := t.(type) {
	case json.Number:
		return string(v), string(v), nil
	case string:
		return v, strconv.Quote(v), nil
	}
	return "", "", invalid(path, "must be a number or a decimal string")
}

func fieldPath(base, k string) string {
	ident := k != ""
	for i := 0; i < len(k); i++ {
		c := k[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-') {
			ident = false
			break
		}
	}
	if !ident {
		k = strconv.Quote(k)
	}
	if base == "" {
		return k
	}
	return base + "." + k
}

func (ps *parser) policy(name string) (*Policy, error) {
	t, err := ps.dec.Token()
	if err == io.EOF {
		return nil, invalid("", "policy is empty")
	}
	if err != nil {
		return nil, invalid("", "malformed JSON: "+err.Error())
	}
	if d, ok := t.(json.Delim); !ok || d != '{' {
		return nil, invalid("", "policy must be a JSON object")
	}
	p := &Policy{Name: name, MaxKeys: DefaultMaxKeys}
	var (
		seen      = map[string]bool{}
		keyGiven  bool
		keyNames  []string
		hasLimits bool
		lease     *rawLease
	)
	for {
		k, ok, err := ps.key("")
		if err != nil {
			return nil, err
		}
		if !ok {
			break
		}
		path := fieldPath("", k)
		if seen[k] {
			return nil, invalid(path, "duplicate field")
		}
		seen[k] = true
		switch k {
		case "match":
			if p.Match, err = ps.match(); err != nil {
				return nil, err
			}
		case "key":
			if keyNames, keyGiven, err = ps.keyDims(); err != nil {
				return nil, err
			}
		case "limits":
			if p.Limits, err = ps.limits(); err != nil {
				return nil, err
			}
			hasLimits = true
		case "mode":
			s, null, err := ps.str(path, true)
			if err != nil {
				return nil, err
			}
			if !null {
				m, ok := ParseMode(s)
				if !ok {
					return nil, invalid(path, strconv.Quote(s)+" is not strict, async, local or leased")
				}
				p.Mode = m
			}
		case "max_keys":
			if p.MaxKeys, err = ps.maxKeys(path); err != nil {
				return nil, err
			}
		case "lease":
			if lease, err = ps.lease(path); err != nil {
				return nil, err
			}
		case "shadow":
			t, err := ps.token(path)
			if err != nil {
				return nil, err
			}
			switch v := t.(type) {
			case bool:
				p.Shadow = v
			case nil:
			default:
				return nil, invalid(path, "must be true or false")
			}
		case "description":
			s, _, err := ps.str(path, true)
			if err != nil {
				return nil, err
			}
			if len(s) > MaxDescription {
				return nil, invalid(path, "is "+strconv.Itoa(len(s))+" bytes (at most 1024)")
			}
			p.Description = s
		default:
			return nil, invalid(path, "unknown field")
		}
	}
	if !hasLimits {
		return nil, invalid("limits", "required (1..8 limits)")
	}
	if p.Mode == ModeLeased {
		if p.Lease, err = lease.build(p.Limits); err != nil {
			return nil, err
		}
	} else if lease != nil {
		return nil, invalid("lease", reasonLeaseMode)
	}
	if keyGiven {
		p.Key = keyNames
	} else {
		p.Key = make([]string, len(p.Match))
		for i, d := range p.Match {
			p.Key[i] = d.Name
		}
	}
	return p, nil
}

func (ps *parser) match() ([]Dim, error) {
	null, err := ps.expectDelim("match", '{', "an object of dimension -> value")
	if err != nil || null {
		return nil, err
	}
	var dims []Dim
	for {
		k, ok, err := ps.key("match")
		if err != nil {
			return nil, err
		}
		if !ok {
			break
		}
		if !validDimName(k) {
			return nil, invalid("match", "dimension name "+strconv.Quote(k)+" is not [a-z][a-z0-9_]{0,31}")
		}
		path := "match." + k
		for _, d := range dims {
			if d.Name == k {
				return nil, invalid(path, "duplicate dimension")
			}
		}
		if len(dims) == MaxDims {
			return nil, invalid("match", "has more than 16 entries")
		}
		v, _, err := ps.str(path, false)
		if err != nil {
			return nil, err
		}
		if v != AnyValue {
			if r := valueProblem(v); r != "" {
				return nil, invalid(path, r)
			}
		}
		dims = append(dims, Dim{Name: k, Value: v})
	}
	slices.SortFunc(dims, func(a, b Dim) int {
		if a.Name < b.Name {
			return -1
		}
		return 1 // names are unique
	})
	return dims, nil
}

func (ps *parser) keyDims() (names []string, given bool, err error) {
	null, err := ps.expectDelim("key", '[', "an array of dimension names")
	if err != nil || null {
		return nil, false, err
	}
	names = []string{}
	for i := 0; ps.dec.More(); i++ {
		path := "key[" + strconv.Itoa(i) + "]"
		s, _, err := ps.str(path, false)
		if err != nil {
			return nil, false, err
		}
		if !validDimName(s) {
			return nil, false, invalid(path, strconv.Quote(s)+" is not [a-z][a-z0-9_]{0,31}")
		}
		if slices.Contains(names, s) {
			return nil, false, invalid(path, "duplicate dimension "+strconv.Quote(s))
		}
		if len(names) == MaxDims {
			return nil, false, invalid("key", "has more than 16 dimensions")
		}
		names = append(names, s)
	}
	if _, err := ps.token("key"); err != nil { // ']'
		return nil, false, err
	}
	slices.Sort(names)
	return names, true, nil
}

func (ps *parser) limits() ([]NamedLimit, error) {
	null, err := ps.expectDelim("limits", '[', "an array of 1..8 limits")
	if err != nil {
		return nil, err
	}
	if null {
		return nil, invalid("limits", "must be an array of 1..8 limits")
	}
	var ls []NamedLimit
	for i := 0; ps.dec.More(); i++ {
		if i == MaxLimits {
			return nil, invalid("limits", "has more than 8 limits")
		}
		path := "limits[" + strconv.Itoa(i) + "]"
		l, err := ps.limit(path)
		if err != nil {
			return nil, err
		}
		for j := range ls {
			if ls[j].Name == l.Name {
				return nil, invalid(path+".name", "duplicate limit name "+strconv.Quote(l.Name)+" (also limits["+strconv.Itoa(j)+"])")
			}
		}
		ls = append(ls, l)
	}
	if _, err := ps.token("limits"); err != nil { // ']'
		return nil, err
	}
	if len(ls) == 0 {
		return nil, invalid("limits", "is empty (needs 1..8 limits)")
	}
	return ls, nil
}

// rawLimit is a limit object as written, before it is checked against its
// algorithm. A field's text is "" when absent.
type rawLimit struct {
	name, algorithm      string
	rate, burst, limit   string
	burstShow, limitShow string
	window, period       string
	hasName, hasAlg      bool
	hasRate, hasBurst    bool
	hasLimit, hasWindow  bool
	hasPeriod            bool
}

func (ps *parser) limit(path string) (NamedLimit, error) {
	null, err := ps.expectDelim(path, '{', "a limit object")
	if err != nil {
		return NamedLimit{}, err
	}
	if null {
		return NamedLimit{}, invalid(path, "must be a limit object")
	}
	var r rawLimit
	for {
		k, ok, err := ps.key(path)
		if err != nil {
			return NamedLimit{}, err
		}
		if !ok {
			break
		}
		fp := fieldPath(path, k)
		var dup bool
		switch k {
		case "name":
			dup, r.hasName = r.hasName, true
			if !dup {
				r.name, _, err = ps.str(fp, false)
			}
		case "algorithm":
			dup, r.hasAlg = r.hasAlg, true
			if !dup {
				r.algorithm, _, err = ps.str(fp, false)
			}
		case "rate":
			dup, r.hasRate = r.hasRate, true
			if !dup {
				r.rate, _, err = ps.str(fp, false)
			}
		case "burst":
			dup, r.hasBurst = r.hasBurst, true
			if !dup {
				r.burst, r.burstShow, err = ps.decimal(fp)
			}
		case "limit":
			dup, r.hasLimit = r.hasLimit, true
			if !dup {
				r.limit, r.limitShow, err = ps.decimal(fp)
			}
		case "window":
			dup, r.hasWindow = r.hasWindow, true
			if !dup {
				r.window, _, err = ps.str(fp, false)
			}
		case "period":
			dup, r.hasPeriod = r.hasPeriod, true
			if !dup {
				r.period, _, err = ps.str(fp, false)
			}
		default:
			return NamedLimit{}, invalid(fp, "unknown field")
		}
		if dup {
			return NamedLimit{}, invalid(fp, "duplicate field")
		}
		if err != nil {
			return NamedLimit{}, err
		}
	}
	return r.build(path)
}

func (r *rawLimit) build(path string) (NamedLimit, error) {
	if !r.hasAlg {
		return NamedLimit{}, invalid(path+".algorithm", "required")
	}
	alg, ok := kvstate.ParseAlgorithm(r.algorithm)
	if !ok {
		return NamedLimit{}, invalid(path+".algorithm", "unknown algorithm "+strconv.Quote(r.algorithm)+
			" (token_bucket, gcra, fixed_window, sliding_window, sliding_log, concurrency or quota)")
	}
	nl := NamedLimit{Name: alg.String(), Limit: kvstate.Limit{Algorithm: alg}}
	if r.hasName {
		if !validLimitName(r.name) {
			return NamedLimit{}, invalid(path+".name", strconv.Quote(r.name)+" is not [a-z0-9_-]{1,64}")
		}
		nl.Name = r.name
	}
	notFor := func(field string) error {
		return invalid(path+"."+field, "is not a field of "+alg.String())
	}
	required := func(field string) error {
		return invalid(path+"."+field, "required for "+alg.String())
	}
	if alg.Bucket() {
		switch {
		case r.hasLimit:
			return NamedLimit{}, notFor("limit")
		case r.hasWindow:
			return NamedLimit{}, notFor("window")
		case r.hasPeriod:
			return NamedLimit{}, notFor("period")
		case !r.hasRate:
			return NamedLimit{}, required("rate")
		case !r.hasBurst:
			return NamedLimit{}, required("burst")
		}
		rate, per, reason := parseRate(r.rate)
		if reason != "" {
			return NamedLimit{}, invalid(path+".rate", reason)
		}
		burst, reason := parseMicro(r.burst, math.MaxInt64)
		if reason != "" {
			return NamedLimit{}, invalid(path+".burst", r.burstShow+" "+reason)
		}
		nl.Rate, nl.RatePer, nl.Burst = rate, per, burst
		return nl, nil
	}
	switch {
	case r.hasRate:
		return NamedLimit{}, notFor("rate")
	case r.hasBurst:
		return NamedLimit{}, notFor("burst")
	case !r.hasLimit:
		return NamedLimit{}, required("limit")
	}
	if alg == kvstate.Quota {
		switch {
		case r.hasWindow:
			return NamedLimit{}, notFor("window")
		case !r.hasPeriod:
			return NamedLimit{}, required("period")
		}
		limit, reason := parseMicro(r.limit, MaxQuota)
		if reason != "" {
			return NamedLimit{}, invalid(path+".limit", r.limitShow+" "+reason)
		}
		period, ok := kvstate.ParsePeriod(r.period)
		if !ok {
			return NamedLimit{}, invalid(path+".period", strconv.Quote(r.period)+" is not hour, day, week or month")
		}
		nl.Limit.Limit, nl.Period = limit, period
		return nl, nil
	}
	switch {
	case r.hasPeriod:
		return NamedLimit{}, notFor("period")
	case !r.hasWindow:
		return NamedLimit{}, required("window")
	}
	max := int64(math.MaxInt64)
	if alg == kvstate.SlidingLog {
		max = MaxSlidingLog
	}
	limit, reason := parseMicro(r.limit, max)
	if reason != "" {
		return NamedLimit{}, invalid(path+".limit", r.limitShow+" "+reason)
	}
	w, err := time.ParseDuration(r.window)
	if err != nil {
		return NamedLimit{}, invalid(path+".window", strconv.Quote(r.window)+" is not a Go duration such as \"1s\" or \"500ms\"")
	}
	if w < time.Millisecond {
		return NamedLimit{}, invalid(path+".window", strconv.Quote(r.window)+" is under 1ms")
	}
	nl.Limit.Limit, nl.Window = limit, int64(w)
	return nl, nil
}

// maxKeys reads max_keys: a positive whole number, as a JSON number or a
// string holding one; null is the default.
func (ps *parser) maxKeys(path string) (int64, error) {
	t, err := ps.token(path)
	if err != nil {
		return 0, err
	}
	var text, show string
	switch v := t.(type) {
	case nil:
		return DefaultMaxKeys, nil
	case json.Number:
		text, show = string(v), string(v)
	case string:
		text, show = v, strconv.Quote(v)
	default:
		return 0, invalid(path, "must be a whole number")
	}
	n, reason := parseCount(text)
	if reason != "" {
		return 0, invalid(path, show+" "+reason)
	}
	return n, nil
}

// rawLease is a lease object as read: the fields given, checked one by
// one; the defaults and the rule between them wait for the limits.
type rawLease struct {
	Lease           // the fields given; 0 when absent
	sizeShow string // size as written, for errors
}

// lease reads the lease object (nil for null).
func (ps *parser) lease(path string) (*rawLease, error) {
	null, err := ps.expectDelim(path, '{', "an object with size, ttl and max_outstanding")
	if err != nil || null {
		return nil, err
	}
	r := &rawLease{}
	seen := map[string]bool{}
	for {
		k, ok, err := ps.key(path)
		if err != nil {
			return nil, err
		}
		if !ok {
			return r, nil
		}
		fp := fieldPath(path, k)
		switch k {
		case "size", "max_outstanding", "ttl":
			if seen[k] {
				return nil, invalid(fp, "duplicate field")
			}
			seen[k] = true
		default:
			return nil, invalid(fp, "unknown field")
		}
		if k == "ttl" {
			text, _, err := ps.str(fp, false)
			if err != nil {
				return nil, err
			}
			d, err := time.ParseDuration(text)
			if err != nil {
				return nil, invalid(fp, strconv.Quote(text)+" is not a Go duration such as \"2s\" or \"500ms\"")
			}
			if d < MinLeaseTTL {
				return nil, invalid(fp, strconv.Quote(text)+" is under 100ms")
			}
			r.TTL = d
			continue
		}
		text, show, err := ps.decimal(fp)
		if err != nil {
			return nil, err
		}
		v, reason := parseMicro(text, math.MaxInt64)
		if reason != "" {
			return nil, invalid(fp, show+" "+reason)
		}
		if k == "size" {
			r.Size, r.sizeShow = v, show
		} else {
			r.MaxOutstanding = v
		}
	}
}

// build fills in the defaults for limits (r may be nil: no lease object)
// and checks that a grant fits in max_outstanding.
func (r *rawLease) build(limits []NamedLimit) (Lease, error) {
	if r == nil {
		return leaseDefaults(Lease{}, limits), nil
	}
	l := leaseDefaults(r.Lease, limits)
	if l.Size > l.MaxOutstanding { // only a size given: a default size is at most max_outstanding
		return Lease{}, invalid("lease.size", r.sizeShow+" is above max_outstanding "+formatMicro(l.MaxOutstanding))
	}
	return l, nil
}
