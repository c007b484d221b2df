package shadow

import (
	"cmp"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/policies"
	"github.com/limitmesh/limitmesh/usage"
	"pgregory.net/rapid"
)

// limitDocs are the limits the generated candidates draw from: every
// algorithm, small enough that denials are common.
var limitDocs = []string{
	`{"algorithm": "token_bucket", "rate": "2/s", "burst": 3}`,
	`{"algorithm": "gcra", "rate": "1/s", "burst": 2}`,
	`{"algorithm": "fixed_window", "limit": 3, "window": "2s"}`,
	`{"algorithm": "sliding_window", "limit": 4, "window": "3s"}`,
	`{"algorithm": "sliding_log", "limit": 3, "window": "2s"}`,
	`{"algorithm": "concurrency", "limit": 2, "window": "1500ms"}`,
	`{"algorithm": "token_bucket", "rate": "0.5/s", "burst": 1.5}`,
}

// dimValues are the descriptor values of the generated records. The long
// user value escapes to 204 bytes: its limit keys are in the literal form
// under a short candidate name and in the digest form under a long one
// (over policies.MaxKeyLen bytes).
var dimValues = map[string][]string{
	"tenant": {"acme", "birch", "cedar"},
	"op":     {"search", "write"},
	"user":   {"u1", "u2", "u3", "u4", "u5", "u6", strings.Repeat("a", 90) + strings.Repeat(".", 38)},
}

var dimNames = []string{"op", "tenant", "user"}

// genCandidates draws 1..4 candidate policies, some with long names.
func genCandidates(t *rapid.T) []*policies.Policy {
	n := rapid.IntRange(1, 4).Draw(t, "candidates")
	out := make([]*policies.Policy, 0, n)
	for i := 0; i < n; i++ {
		var match, key []string
		for _, d := range dimNames {
			switch rapid.IntRange(0, 3).Draw(t, "match."+d) {
			case 1:
				match = append(match, fmt.Sprintf("%q: %q", d, rapid.SampledFrom(dimValues[d]).Draw(t, "value")))
			case 2:
				match = append(match, fmt.Sprintf("%q: \"*\"", d))
			}
			if rapid.Bool().Draw(t, "key."+d) {
				key = append(key, fmt.Sprintf("%q", d))
			}
		}
		nl := rapid.IntRange(1, 2).Draw(t, "limits")
		var limits []string
		for j := 0; j < nl; j++ {
			l := rapid.SampledFrom(limitDocs).Draw(t, "limit")
			limits = append(limits, strings.Replace(l, "{", fmt.Sprintf(`{"name": "l%d", `, j), 1))
		}
		doc := fmt.Sprintf(`{"match": {%s}, "key": [%s], "limits": [%s], "shadow": true}`,
			strings.Join(match, ","), strings.Join(key, ","), strings.Join(limits, ","))
		name := fmt.Sprintf("cand-%d", i) + rapid.SampledFrom([]string{"", "", "-" + strings.Repeat("x", 40)}).Draw(t, "name")
		p, err := policies.Parse(name, []byte(doc))
		if err != nil {
			t.Fatalf("generated %s: %v", doc, err)
		}
		p.Revision = uint64(10 + i)
		out = append(out, p)
	}
	return out
}

// genRecords draws up to n records: descriptors over a few values
// (sometimes lacking a dimension), times mostly forward with some steps
// back, costs of 0.5 to 3 units, random live results, and some released
// reservations (CONTRACT.md §10: allowed, cost 0).
func genRecords(t *rapid.T, n int) []usage.Record {
	count := rapid.IntRange(0, n).Draw(t, "records")
	out := make([]usage.Record, 0, count)
	at := t0
	for i := 0; i < count; i++ {
		var dims []policies.Dim
		for _, d := range dimNames {
			if rapid.IntRange(0, 5).Draw(t, "has."+d) > 0 {
				dims = append(dims, policies.Dim{Name: d, Value: rapid.SampledFrom(dimValues[d]).Draw(t, d)})
			}
		}
		if len(dims) == 0 {
			dims = append(dims, policies.Dim{Name: "tenant", Value: "acme"})
		}
		d, err := policies.NewDescriptor(dims)
		if err != nil {
			t.Fatal(err)
		}
		at += rapid.OneOf(rapid.Just(int64(0)), rapid.Int64Range(0, 400_000), rapid.Int64Range(-300_000, 0), rapid.Int64Range(0, 5_000_000)).Draw(t, "gap")
		cost := rapid.SampledFrom([]int64{0, unit / 2, unit, unit, unit, 2 * unit, 3 * unit}).Draw(t, "cost")
		r := usage.Record{TimeUs: at, Descriptor: d, Cost: cost, Allowed: rapid.Bool().Draw(t, "live")}
		if cost == 0 {
			r.Allowed, r.Reservation = true, fmt.Sprintf("r.%d", i)
		}
		out = append(out, r)
	}
	return out
}

// naiveReplay is the straightforward evaluation the Replay must agree
// with: every candidate, every record, unbounded maps, nothing clever.
func naiveReplay(cands []*policies.Policy, recs []usage.Record) map[string]Summary {
	out := map[string]Summary{}
	for _, p := range cands {
		s := Summary{Policy: p.Name, Revision: p.Revision}
		states := map[string][]kvstate.State{}
		denied := map[string]uint64{}
		limits := make([]kvstate.Limit, len(p.Limits))
		for i, l := range p.Limits {
			limits[i] = l.Limit
		}
		for _, r := range recs {
			if r.Cost == 0 {
				continue // a released reservation: no request
			}
			ok := true
			for _, m := range p.Match {
				v, has := r.Descriptor.Get(m.Name)
				if !has || m.Value != "*" && m.Value != v {
					ok = false
				}
			}
			if !ok {
				continue
			}
			key, err := p.LimitKey(r.Descriptor)
			if err != nil {
				s.Skipped++
				continue
			}
			d, ns := kvstate.DecideAll(limits, states[key], r.TimeUs*1000, r.Cost, nil)
			if d.Allowed {
				states[key] = ns
			}
			if s.Evaluated == 0 {
				s.SinceUs = r.TimeUs
			}
			s.Evaluated++
			s.LastUs = r.TimeUs
			if !r.Allowed {
				s.LiveDenied++
			}
			if d.Allowed {
				s.WouldAllow++
				if !r.Allowed {
					s.OnlyLiveDenied++
				}
				continue
			}
			s.WouldDeny++
			s.WouldDenyUnits += Units(r.Cost)
			denied[key]++
			if r.Allowed {
				s.OnlyCandidateDenied++
			} else {
				s.BothDenied++
			}
		}
		s.TopDenied = []TopKey{}
		for k, n := range denied {
			s.TopDenied = append(s.TopDenied, TopKey{Key: k, WouldDeny: n})
		}
		slices.SortFunc(s.TopDenied, func(a, b TopKey) int {
			if c := cmp.Compare(b.WouldDeny, a.WouldDeny); c != 0 {
				return c
			}
			return strings.Compare(a.Key, b.Key)
		})
		if len(s.TopDenied) > TopN {
			s.TopDenied = s.TopDenied[:TopN]
		}
		s.Keys = len(states)
		out[p.Name] = s
	}
	return out
}

// TestReplayAgreesWithNaive: with room for every key, the Replay's
// summaries equal the naive replay's, top keys included, whatever the
// number of keys tracked for the ranking.
func TestReplayAgreesWithNaive(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		cands := genCandidates(t)
		recs := genRecords(t, 300)
		r := NewReplay(Options{TopTracked: rapid.SampledFrom([]int{1, 2, 5, 20, 1000}).Draw(t, "tracked")})
		r.SetCandidates(cands)
		for i := range recs {
			r.Apply(&recs[i])
		}
		want := naiveReplay(cands, recs)
		tracked := r.opt.TopTracked
		for _, got := range r.Summaries() {
			w := want[got.Policy]
			if len(w.TopDenied) > tracked {
				w.TopDenied = w.TopDenied[:tracked]
			}
			got.Series = nil
			if got.Keys < w.Keys {
				t.Fatalf("%s: %d keys, the naive replay has %d", got.Policy, got.Keys, w.Keys)
			}
			got.Keys = w.Keys // the Replay may keep never-admitted keys
			if !reflect.DeepEqual(got, w) {
				t.Fatalf("%s:\n got %+v\nwant %+v", got.Policy, got, w)
			}
		}
	})
}

// TestCheckpointResumes: a Replay restored from a checkpoint taken after
// any prefix of the records, fed the rest, ends exactly where an
// uninterrupted Replay ends (also with few keys allowed: overflow and
// sweeps), and the checkpoint reports the sequence it was written at.
func TestCheckpointResumes(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		cands := genCandidates(t)
		recs := genRecords(t, 200)
		opt := Options{MaxKeys: rapid.SampledFrom([]int{2, 5, 1000}).Draw(t, "max keys"),
			TopTracked: rapid.SampledFrom([]int{2, 1000}).Draw(t, "tracked")}
		cut := rapid.IntRange(0, len(recs)).Draw(t, "cut")

		whole := NewReplay(opt)
		whole.SetCandidates(cands)
		first := NewReplay(opt)
		first.SetCandidates(cands)
		for i := range recs {
			whole.Apply(&recs[i])
			if i < cut {
				first.Apply(&recs[i])
			}
		}
		b := appendCheckpoint(nil, uint64(cut)+41, first)
		second := NewReplay(opt)
		second.SetCandidates(cands)
		info, err := second.Restore(b)
		if err != nil {
			t.Fatal(err)
		}
		if info.Seq != uint64(cut)+41 || info.Restored != len(cands) {
			t.Fatalf("restore: %+v", info)
		}
		for i := cut; i < len(recs); i++ {
			second.Apply(&recs[i])
		}
		if got, want := second.Summaries(), whole.Summaries(); !reflect.DeepEqual(got, want) {
			t.Fatalf("resumed:\n got %+v\nwant %+v", got, want)
		}
		// A checkpoint of the restored Replay restores it again, equal.
		again := NewReplay(opt)
		again.SetCandidates(cands)
		if _, err := again.Restore(appendCheckpoint(nil, 1, second)); err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(again.Summaries(), second.Summaries()) {
			t.Fatal("second restore differs")
		}
	})
}

// TestRestoreOnlyMatchingRevisions: a checkpointed candidate whose
// revision changed, or that is no longer a candidate, is not restored.
func TestRestoreOnlyMatchingRevisions(t *testing.T) {
	a := mustPolicy(t, "a", 1, acmeV2)
	b := mustPolicy(t, "b", 1, acmeV2)
	r := NewReplay(Options{})
	r.SetCandidates([]*policyT{a, b})
	x := rec(desc(t, "tenant", "acme", "operation", "search"), 0, 1, true)
	r.Apply(&x)
	ck := appendCheckpoint(nil, 9, r)

	next := NewReplay(Options{})
	next.SetCandidates([]*policyT{mustPolicy(t, "a", 2, acmeV2), mustPolicy(t, "c", 1, acmeV2)})
	info, err := next.Restore(ck)
	if err != nil || info.Restored != 0 || info.Candidates != 2 || info.Seq != 9 {
		t.Fatalf("restore: %+v, %v", info, err)
	}
	for _, s := range next.Summaries() {
		if s.Evaluated != 0 {
			t.Errorf("%s restored: %+v", s.Policy, s)
		}
	}
}

// TestRestoreRejectsCorrupt: every truncation and a sample of bit flips of
// a valid checkpoint either restore or fail with ErrCorrupt, and a failed
// restore leaves the Replay as it was.
func TestRestoreRejectsCorrupt(t *testing.T) {
	p := mustPolicy(t, "a", 1, acmeV2)
	r := NewReplay(Options{})
	r.SetCandidates([]*policyT{p})
	for i := int64(0); i < 20; i++ {
		x := rec(desc(t, "tenant", "acme", "operation", "search", "user", fmt.Sprint(i%4)), i*100_000, 1, i%3 != 0)
		r.Apply(&x)
	}
	ck := appendCheckpoint(nil, 5, r)
	fresh := func() *Replay {
		n := NewReplay(Options{})
		n.SetCandidates([]*policyT{p})
		return n
	}
	for i := 0; i < len(ck); i++ {
		n := fresh()
		if _, err := n.Restore(ck[:i]); err == nil {
			t.Fatalf("truncated to %d bytes: restored", i)
		} else if !isCorrupt(err) {
			t.Fatalf("truncated to %d: %v does not match ErrCorrupt", i, err)
		}
		if s, _ := n.Summary("a"); s.Evaluated != 0 {
			t.Fatal("a failed restore changed the replay")
		}
	}
	if _, err := fresh().Restore(append(slices.Clone(ck), 0)); !isCorrupt(err) {
		t.Fatalf("trailing byte: %v", err)
	}
	bad := slices.Clone(ck)
	bad[4] = 2
	if _, err := fresh().Restore(bad); !isCorrupt(err) {
		t.Fatalf("version 2: %v", err)
	}
}
