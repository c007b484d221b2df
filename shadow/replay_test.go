package shadow

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"

	"github.com/limitmesh/limitmesh/usage"
)

const acmeV2 = `{"match": {"tenant": "acme", "operation": "search"},
 "key": ["tenant"],
 "limits": [{"name": "rate", "algorithm": "token_bucket", "rate": "1/s", "burst": 2}],
 "shadow": true}`

// TestReplaySteps walks one candidate through a timeline: a 1/s bucket of
// burst 2 keyed on the tenant, with live results that disagree sometimes.
func TestReplaySteps(t *testing.T) {
	p := mustPolicy(t, "acme-v2", 7, acmeV2)
	r := NewReplay(Options{})
	r.SetCandidates([]*policyT{p})
	acme := desc(t, "tenant", "acme", "operation", "search", "plan", "v7")
	other := desc(t, "tenant", "birch", "operation", "search")
	steps := []struct {
		rec       usage.Record
		wouldDeny bool // expected candidate decision
	}{
		{rec(acme, 0, 1, true), false},           // 2 -> 1
		{rec(acme, 0, 1, true), false},           // 1 -> 0
		{rec(acme, 0, 1, false), true},           // empty; live denied too
		{rec(acme, 500_000, 1, true), true},      // half a token
		{rec(acme, 1_000_000, 1, false), false},  // one token; live denied, candidate allows
		{rec(other, 1_000_000, 1, true), false},  // not matched: not evaluated
		{rec(acme, 1_000_000, 3, true), true},    // above the burst: never
		{rec(acme, 10_000_000, 2, true), false},  // full again
		{rec(acme, 10_000_000, 1, false), true},  // empty
		{rec(acme, 10_000_001, 1, true), true},   // still empty
		{rec(acme, 600_000_000, 1, true), false}, // ten minutes later
	}
	want := Summary{Policy: "acme-v2", Revision: 7, SinceUs: t0}
	for i, st := range steps {
		r.Apply(&st.rec)
		if v, _ := st.rec.Descriptor.Get("tenant"); v == "birch" {
			continue
		}
		want.Evaluated++
		want.LastUs = st.rec.TimeUs
		live := !st.rec.Allowed
		switch {
		case st.wouldDeny && live:
			want.WouldDeny++
			want.BothDenied++
			want.LiveDenied++
		case st.wouldDeny:
			want.WouldDeny++
			want.OnlyCandidateDenied++
		case live:
			want.WouldAllow++
			want.OnlyLiveDenied++
			want.LiveDenied++
		default:
			want.WouldAllow++
		}
		if st.wouldDeny {
			want.WouldDenyUnits += Units(st.rec.Cost)
		}
		got, _ := r.Summary("acme-v2")
		got.TopDenied, got.Series, got.Keys = nil, nil, 0
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("step %d:\n got %+v\nwant %+v", i, got, want)
		}
	}
	s, _ := r.Summary("acme-v2")
	if wantTop := []TopKey{{Key: "p.acme-v2.tenant=acme", WouldDeny: 5}}; !reflect.DeepEqual(s.TopDenied, wantTop) {
		t.Errorf("top_denied = %+v, want %+v", s.TopDenied, wantTop)
	}
	if s.Keys != 1 {
		t.Errorf("keys = %d, want 1", s.Keys)
	}
	if s.WouldDenyUnits != 7*Units(unit) {
		t.Errorf("would_deny_units = %v, want 7", s.WouldDenyUnits)
	}
	// The series: buckets of 10 s from t0 to t0+600 s, all kept but the
	// oldest (61 buckets of which SeriesLen remain).
	if len(s.Series) != SeriesLen || s.Series[len(s.Series)-1].TimeUs != t0+600_000_000 || s.Series[len(s.Series)-1].Evaluated != 1 {
		t.Errorf("series: %d points, last %+v", len(s.Series), s.Series[len(s.Series)-1])
	}
}

// TestReplayRevisionRestarts: a new revision of a candidate starts its
// counts (and state) at 0; the same revision keeps them.
func TestReplayRevisionRestarts(t *testing.T) {
	r := NewReplay(Options{})
	r.SetCandidates([]*policyT{mustPolicy(t, "acme-v2", 7, acmeV2)})
	acme := desc(t, "tenant", "acme", "operation", "search")
	for i := int64(0); i < 5; i++ {
		x := rec(acme, i, 1, true)
		r.Apply(&x)
	}
	r.SetCandidates([]*policyT{mustPolicy(t, "acme-v2", 7, acmeV2)}) // same revision
	if s, _ := r.Summary("acme-v2"); s.Evaluated != 5 || s.WouldDeny != 3 {
		t.Fatalf("same revision: %+v", s)
	}
	r.SetCandidates([]*policyT{mustPolicy(t, "acme-v2", 9, acmeV2)})
	s, _ := r.Summary("acme-v2")
	if s.Revision != 9 || s.Evaluated != 0 || s.SinceUs != 0 || len(s.TopDenied) != 0 || s.Keys != 0 {
		t.Fatalf("new revision did not restart: %+v", s)
	}
	x := rec(acme, 100, 1, true)
	r.Apply(&x)
	if s, _ := r.Summary("acme-v2"); s.Evaluated != 1 || s.WouldAllow != 1 || s.SinceUs != t0+100 {
		t.Fatalf("new revision, first record: %+v (fresh state admits it)", s)
	}
	r.SetCandidates(nil)
	if _, ok := r.Summary("acme-v2"); ok {
		t.Fatal("a dropped candidate still has a summary")
	}
}

// TestReplayUnmatchedAndSkipped: a candidate on descriptors no live policy
// matches is evaluated from the unmatched records (key "", revision 0);
// a matching descriptor without a key dimension is skipped and counted;
// two candidates on the same records are evaluated independently.
func TestReplayUnmatchedAndSkipped(t *testing.T) {
	wide := mustPolicy(t, "wide", 3, `{"match": {"service": "*"}, "key": ["service", "user"],
		"limits": [{"algorithm": "fixed_window", "limit": 2, "window": "1m"}], "shadow": true}`)
	narrow := mustPolicy(t, "narrow", 4, `{"match": {"service": "api"},
		"limits": [{"algorithm": "fixed_window", "limit": 1, "window": "1m"}], "shadow": true}`)
	r := NewReplay(Options{})
	r.SetCandidates([]*policyT{wide, narrow})
	recs := []usage.Record{
		rec(desc(t, "service", "api", "user", "u1"), 0, 1, true),
		rec(desc(t, "service", "api", "user", "u1"), 1, 1, true),
		rec(desc(t, "service", "api", "user", "u1"), 2, 1, true),
		rec(desc(t, "service", "web", "user", "u1"), 3, 1, true),
		rec(desc(t, "service", "api"), 4, 1, true), // no user: wide skips it
		rec(desc(t, "tenant", "acme"), 5, 1, true), // neither matches
	}
	for i := range recs {
		r.Apply(&recs[i])
	}
	w, _ := r.Summary("wide")
	if w.Evaluated != 4 || w.WouldAllow != 3 || w.WouldDeny != 1 || w.Skipped != 1 || w.Keys != 2 {
		t.Errorf("wide: %+v", w)
	}
	n, _ := r.Summary("narrow")
	if n.Evaluated != 4 || n.WouldAllow != 1 || n.WouldDeny != 3 || n.Skipped != 0 || n.Keys != 1 {
		t.Errorf("narrow: %+v", n)
	}
	if want := []TopKey{{Key: "p.narrow.service=api", WouldDeny: 3}}; !reflect.DeepEqual(n.TopDenied, want) {
		t.Errorf("narrow top: %+v", n.TopDenied)
	}
}

// TestReplayOverflow: a candidate holding MaxKeys keys decides new keys
// against its shared overflow state and counts them; once keys are at
// rest they are dropped and new keys get state of their own again.
func TestReplayOverflow(t *testing.T) {
	p := mustPolicy(t, "per-user", 1, `{"match": {"user": "*"},
		"limits": [{"algorithm": "token_bucket", "rate": "1/s", "burst": 1}], "shadow": true}`)
	r := NewReplay(Options{MaxKeys: 2})
	r.SetCandidates([]*policyT{p})
	apply := func(user string, at int64) {
		x := rec(desc(t, "user", user), at, 1, true)
		r.Apply(&x)
	}
	apply("a", 0)
	apply("b", 0)
	apply("c", 0) // full, nothing at rest: overflow state (allowed, spends it)
	apply("d", 0) // overflow state is empty: denied
	s, _ := r.Summary("per-user")
	if s.Keys != 2 || s.Overflow != 2 || s.WouldAllow != 3 || s.WouldDeny != 1 {
		t.Fatalf("overflow: %+v", s)
	}
	if s.TopDenied[0].Key != OverflowKey("per-user") {
		t.Fatalf("top: %+v", s.TopDenied)
	}
	apply("e", 2_000_000) // a and b are full again: dropped, e gets its own
	s, _ = r.Summary("per-user")
	if s.Keys != 1 || s.Overflow != 2 || s.WouldAllow != 4 {
		t.Fatalf("after the sweep: %+v", s)
	}
}

// TestReplayReservationEnds: a reservation's end (CONTRACT.md §10) is a
// request of its settled cost at its time; one that settled 0 (a release)
// spends nothing in a candidate and is not evaluated, counted or kept as
// a key, and the summary's since_us is the first request's.
func TestReplayReservationEnds(t *testing.T) {
	p := mustPolicy(t, "per-user", 1, `{"match": {"user": "*"}, "key": ["user"],
		"limits": [{"algorithm": "fixed_window", "limit": 2, "window": "1m"}], "shadow": true}`)
	r := NewReplay(Options{})
	r.SetCandidates([]*policyT{p})
	end := func(user string, at, cost int64) {
		x := rec(desc(t, "user", user), at, cost, true)
		x.Reservation = "r." + user
		r.Apply(&x)
	}
	end("a", 0, 0) // released before anything: no key, no since_us
	if s, _ := r.Summary("per-user"); s.Evaluated != 0 || s.Keys != 0 || s.SinceUs != 0 {
		t.Fatalf("after a release: %+v", s)
	}
	end("a", 1, 2) // settled at 2: the window is full
	for i := range int64(5) {
		end("a", 2+i, 0) // releases: they spend nothing, so they are never denied
	}
	end("b", 3, 0)
	s, _ := r.Summary("per-user")
	if s.Evaluated != 1 || s.WouldAllow != 1 || s.WouldDeny != 0 || s.Keys != 1 || s.SinceUs != t0+1 || s.LastUs != t0+1 {
		t.Fatalf("after the settle and releases: %+v", s)
	}
	end("a", 10, 1) // a request of 1 finds the window full
	s, _ = r.Summary("per-user")
	if s.Evaluated != 2 || s.WouldDeny != 1 || s.WouldDenyUnits != Units(unit) {
		t.Fatalf("after a settle of 1: %+v", s)
	}
}

// TestSummaryJSON: the stored summary has the contract's fields in its
// order, units as decimal numbers, an empty top list as [] and reads back
// equal.
func TestSummaryJSON(t *testing.T) {
	s := Summary{Policy: "acme-search-v2", Revision: 31, SinceUs: 1764752400000000, Evaluated: 1000,
		WouldAllow: 400, WouldDeny: 600, WouldDenyUnits: Units(1800 * unit), LiveDenied: 500,
		BothDenied: 450, OnlyCandidateDenied: 150, OnlyLiveDenied: 50,
		TopDenied: []TopKey{{Key: "p.acme-search-v2.tenant=acme", WouldDeny: 600}}, Series: []Point{}}
	b, err := json.Marshal(s)
	if err != nil {
		t.Fatal(err)
	}
	const head = `{"policy":"acme-search-v2","revision":31,"since_us":1764752400000000,"evaluated":1000,` +
		`"would_allow":400,"would_deny":600,"would_deny_units":1800,"live_denied":500,"both_denied":450,` +
		`"only_candidate_denied":150,"only_live_denied":50,"top_denied":[{"key":"p.acme-search-v2.tenant=acme","would_deny":600}],`
	if string(b[:len(head)]) != head {
		t.Fatalf("summary JSON:\n%s\nwant it to start with\n%s", b, head)
	}
	var back Summary
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back, s) {
		t.Fatalf("round trip: %+v", back)
	}
	for in, want := range map[string]Units{"2.5": 2_500_000, "0.000001": 1, "\"3\"": 3 * Units(unit), "-1.5": -1_500_000} {
		var u Units
		if err := json.Unmarshal([]byte(in), &u); err != nil || u != want {
			t.Errorf("units %s = %d, %v; want %d", in, u, err, want)
		}
	}
	for _, bad := range []string{"1e3", "1.", ".5", "1.0000001", "x", "\"\"", "1234567890123"} {
		var u Units
		if err := json.Unmarshal([]byte(bad), &u); err == nil {
			t.Errorf("units %s accepted as %d", bad, u)
		}
	}
	e, _ := json.Marshal(NewReplay(Options{}).Summaries())
	if string(e) != "[]" {
		t.Errorf("no candidates: %s", e)
	}
}

// TestReplayGroupMixedKeyForms: two candidates keyed on the same
// dimension, one with a name so long that its limit key takes the digest
// form. Whether the short-named one's key is found through its group's
// index must not depend on which candidates matched the record: the
// long-named one (first by name) matches only searches, so the group's
// suffix is computed from its digest key for searches and from the short
// one's literal key for writes. The short one's counts equal its replay
// alone.
func TestReplayGroupMixedKeyForms(t *testing.T) {
	long := "a" + strings.Repeat("x", 63)
	limits := `"limits": [{"algorithm": "token_bucket", "rate": "1/s", "burst": 3}]`
	cands := []*policyT{
		mustPolicy(t, long, 1, `{"match": {"operation": "search"}, "key": ["user", "zone"], `+limits+`}`),
		mustPolicy(t, "b", 1, `{"match": {}, "key": ["user", "zone"], `+limits+`}`),
	}
	user, zone := strings.Repeat("u", 120), strings.Repeat("z", 120)
	var recs []usage.Record
	for i := range 12 {
		op := []string{"search", "write"}[i%2]
		recs = append(recs, rec(desc(t, "operation", op, "user", user, "zone", zone), int64(i), 1, true))
	}
	both, alone := NewReplay(Options{}), NewReplay(Options{})
	both.SetCandidates(cands)
	alone.SetCandidates(cands[1:])
	for i := range recs {
		both.Apply(&recs[i])
		alone.Apply(&recs[i])
	}
	got, _ := both.Summary("b")
	want, _ := alone.Summary("b")
	if got.WouldAllow != 3 || got.WouldDeny != 9 || !reflect.DeepEqual(got, want) {
		t.Fatalf("b with the long-named candidate: %+v\nalone: %+v", got, want)
	}
	if full, _ := cands[0].LimitKey(recs[0].Descriptor); !strings.Contains(full, "._") {
		t.Fatalf("the long-named candidate's key %q is not in the digest form", full)
	}
}
