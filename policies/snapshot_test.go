package policies

import (
	"strconv"
	"testing"

	"github.com/limitmesh/limitmesh/kvstate"
	"pgregory.net/rapid"
)

var oneLimit = []NamedLimit{{Name: "gcra", Limit: kvstate.Limit{Algorithm: kvstate.GCRA, Rate: 1, Burst: 1}}}

// pol builds a valid policy from "name=value" match entries.
func pol(name string, match ...string) *Policy {
	p := &Policy{Name: name, Limits: oneLimit}
	for _, m := range match {
		for i := 0; i < len(m); i++ {
			if m[i] == '=' {
				p.Match = append(p.Match, Dim{m[:i], m[i+1:]})
				break
			}
		}
	}
	p.Match = sortDims(p.Match)
	for _, d := range p.Match {
		p.Key = append(p.Key, d.Name)
	}
	return p
}

func sortDims(ds []Dim) []Dim {
	for i := 1; i < len(ds); i++ {
		for j := i; j > 0 && ds[j].Name < ds[j-1].Name; j-- {
			ds[j], ds[j-1] = ds[j-1], ds[j]
		}
	}
	return ds
}

// naiveMatch is the reference: scan every policy, keep the best by the
// contract's precedence.
func naiveMatch(ps []*Policy, d Descriptor) *Policy {
	var best *Policy
	bestExact, bestN := -1, -1
	for _, p := range ps {
		exact, ok := 0, true
		for _, m := range p.Match {
			v, has := d.Get(m.Name)
			if !has || (m.Value != AnyValue && m.Value != v) {
				ok = false
				break
			}
			if m.Value != AnyValue {
				exact++
			}
		}
		if !ok {
			continue
		}
		if best == nil || exact > bestExact || exact == bestExact && (len(p.Match) > bestN || len(p.Match) == bestN && p.Name < best.Name) {
			best, bestExact, bestN = p, exact, len(p.Match)
		}
	}
	return best
}

func TestMatchPrecedence(t *testing.T) {
	ps := []*Policy{
		pol("everything"),
		pol("any-tenant", "tenant=*"),
		pol("acme", "tenant=acme"),
		pol("acme-any-op", "tenant=acme", "operation=*"),
		pol("acme-search", "tenant=acme", "operation=search"),
		pol("b-search", "operation=search"),
		pol("a-search", "operation=search"),       // same specificity as b-search, smaller name
		pol("acme-plan", "tenant=acme", "plan=*"), // same as acme-any-op, bigger name
		pol("three", "tenant=*", "operation=*", "plan=*"),
	}
	s := NewSnapshot(ps)
	tests := []struct {
		dims []Dim
		want string
	}{
		{[]Dim{{"user", "u"}}, "everything"},
		{[]Dim{{"tenant", "other"}}, "any-tenant"},
		{[]Dim{{"tenant", "acme"}}, "acme"},
		{[]Dim{{"tenant", "acme"}, {"operation", "list"}}, "acme-any-op"},              // 1 exact, 2 entries beats 1 exact, 1 entry
		{[]Dim{{"tenant", "acme"}, {"operation", "search"}}, "acme-search"},            // 2 exact
		{[]Dim{{"tenant", "other"}, {"operation", "search"}}, "a-search"},              // 1 exact beats 0 exact; name breaks the tie
		{[]Dim{{"operation", "search"}}, "a-search"},                                   //
		{[]Dim{{"tenant", "acme"}, {"plan", "v7"}}, "acme-plan"},                       //
		{[]Dim{{"tenant", "acme"}, {"plan", "v7"}, {"operation", "x"}}, "acme-any-op"}, // tie on (1, 2): smallest name
		{[]Dim{{"tenant", "zz"}, {"plan", "v7"}, {"operation", "x"}}, "three"},         // (0, 3) beats (0, 1)
		{[]Dim{{"tenant", "zz"}, {"plan", "v7"}, {"operation", "search"}}, "a-search"}, // (1, 1) beats (0, 3)
	}
	for _, tt := range tests {
		d := mustDescriptor(t, tt.dims...)
		got := s.Match(d)
		if got == nil || got.Name != tt.want {
			t.Errorf("Match(%v) = %v, want %s", d, got, tt.want)
		}
		if ref := naiveMatch(ps, d); ref == nil || ref.Name != tt.want {
			t.Errorf("reference Match(%v) = %v, want %s", d, ref, tt.want)
		}
	}
	if got := NewSnapshot(ps[1:]).Match(mustDescriptor(t, Dim{"user", "u"})); got != nil {
		t.Errorf("unmatched descriptor matched %s", got.Name)
	}
	var empty *Snapshot
	if empty.Match(mustDescriptor(t, Dim{"a", "b"})) != nil || empty.Get("x") != nil || empty.Len() != 0 || empty.Policies() != nil {
		t.Error("nil snapshot is not empty")
	}
}

func TestSnapshotWithWithout(t *testing.T) {
	s0 := NewSnapshot([]*Policy{pol("b", "tenant=acme"), pol("a")})
	d := mustDescriptor(t, Dim{"tenant", "acme"})
	if got := s0.Match(d); got.Name != "b" {
		t.Fatalf("Match = %s", got.Name)
	}
	s1 := s0.With(pol("b", "tenant=other"))
	if got := s1.Match(d); got.Name != "a" {
		t.Errorf("after replacing b: Match = %s, want a", got.Name)
	}
	if got := s0.Match(d); got.Name != "b" {
		t.Errorf("With changed the old snapshot: Match = %s", got.Name)
	}
	s2 := s1.Without("a")
	if got := s2.Match(d); got != nil {
		t.Errorf("after removing a: Match = %s, want none", got.Name)
	}
	if s1.Get("a") == nil || s2.Get("a") != nil || s2.Len() != 1 {
		t.Error("Without changed the old snapshot or kept the policy")
	}
	if s2.Without("nope") != s2 {
		t.Error("Without of an absent name made a copy")
	}
	s3 := (*Snapshot)(nil).With(pol("c", "x=*")).With(pol("a"))
	names := ""
	for _, p := range s3.Policies() {
		names += p.Name
	}
	if names != "ac" {
		t.Errorf("Policies() = %s, want a, c", names)
	}
}

// TestMatchAgainstReference checks the index against the naive scan on
// random policies and descriptors drawn from small alphabets.
func TestMatchAgainstReference(t *testing.T) {
	names := []string{"a", "b", "c", "d"}
	values := []string{"x", "y", "z", AnyValue}
	rapid.Check(t, func(t *rapid.T) {
		n := rapid.IntRange(0, 30).Draw(t, "n")
		var ps []*Policy
		for i := 0; i < n; i++ {
			dims := rapid.SliceOfNDistinct(rapid.SampledFrom(names), 0, 4, rapid.ID[string]).Draw(t, "dims")
			var match []string
			for _, dn := range dims {
				match = append(match, dn+"="+rapid.SampledFrom(values).Draw(t, "value"))
			}
			ps = append(ps, pol("p"+strconv.Itoa(rapid.IntRange(0, 40).Draw(t, "name")), match...))
		}
		s := NewSnapshot(ps)
		// Of duplicate names the last wins in the snapshot: mirror that.
		byName := map[string]*Policy{}
		for _, p := range ps {
			byName[p.Name] = p
		}
		var uniq []*Policy
		for _, p := range byName {
			uniq = append(uniq, p)
		}
		for range 5 {
			dn := rapid.SliceOfNDistinct(rapid.SampledFrom(names), 1, 4, rapid.ID[string]).Draw(t, "ddims")
			var dims []Dim
			for _, x := range dn {
				dims = append(dims, Dim{x, rapid.SampledFrom(values[:3]).Draw(t, "dvalue")})
			}
			d, err := NewDescriptor(dims)
			if err != nil {
				t.Fatal(err)
			}
			got, want := s.Match(d), naiveMatch(uniq, d)
			if got != want {
				t.Fatalf("Match(%v) = %v, reference %v", d, got, want)
			}
		}
	})
}

// benchSnapshot builds n policies in a few realistic shapes: per tenant,
// per tenant and operation, per tenant with any plan, and a catch-all.
func benchSnapshot(n int) *Snapshot {
	ps := []*Policy{pol("default")}
	for i := 0; len(ps) < n; i++ {
		t := "tenant-" + strconv.Itoa(i)
		ps = append(ps,
			pol(t, "tenant="+t),
			pol(t+"-search", "tenant="+t, "operation=search"),
			pol(t+"-plans", "tenant="+t, "plan=*"),
		)
	}
	return NewSnapshot(ps[:n])
}

func BenchmarkMatch10k(b *testing.B) {
	s := benchSnapshot(10_000)
	ds := []Descriptor{
		mustDescriptor(b, Dim{"tenant", "tenant-1234"}, Dim{"operation", "search"}, Dim{"plan", "v7"}, Dim{"user", "u-1"}),
		mustDescriptor(b, Dim{"tenant", "tenant-77"}, Dim{"operation", "list"}),
		mustDescriptor(b, Dim{"tenant", "unknown"}, Dim{"operation", "search"}),
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		if s.Match(ds[i%len(ds)]) == nil {
			b.Fatal("no match")
		}
		i++
	}
}

func BenchmarkSnapshotWith10k(b *testing.B) {
	s := benchSnapshot(10_000)
	p := pol("new-policy", "tenant=new")
	b.ReportAllocs()
	for b.Loop() {
		_ = s.With(p)
	}
}
