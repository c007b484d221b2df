// The limits of a policy document: each limit's algorithm and parameters,
// max_keys and the lease block (CONTRACT.md §3, §8).

package policies

import (
	"encoding/json"
	"math"
	"strconv"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
)

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
	case !r.hasWindow && alg == kvstate.Concurrency:
		// A concurrency limit's holds last as long as their reservations
		// (CONTRACT §10): window, when given, only caps that.
		r.window = MaxReservationTTL.String()
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
