package policies

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"pgregory.net/rapid"
)

var kvKeyRE = regexp.MustCompile(`^[-/_=.a-zA-Z0-9]+$`)

// checkKVKey fails unless k is a valid JetStream KV key of bounded length.
func checkKVKey(t interface{ Fatalf(string, ...any) }, k string) {
	if !kvKeyRE.MatchString(k) || strings.HasPrefix(k, ".") || strings.HasSuffix(k, ".") || strings.Contains(k, "..") {
		t.Fatalf("%q is not a valid KV key", k)
	}
	if len(k) > MaxKeyLen {
		t.Fatalf("%q is %d bytes, over %d", k, len(k), MaxKeyLen)
	}
}

func mustDescriptor(t testing.TB, dims ...Dim) Descriptor {
	t.Helper()
	d, err := NewDescriptor(dims)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// TestLimitKeyGolden pins the version-1 key encoding (KEYS.md): a change
// here orphans every stored limiter state.
func TestLimitKeyGolden(t *testing.T) {
	dots := strings.Repeat(".", 128)
	tests := []struct {
		policy string
		key    []string
		dims   []Dim
		want   string
	}{
		{"acme-search", []string{"operation", "plan", "tenant"},
			[]Dim{{"tenant", "acme"}, {"operation", "search"}, {"plan", "v7"}},
			"p.acme-search.operation=search.plan=v7.tenant=acme"},
		{"global", nil, []Dim{{"tenant", "acme"}}, "p.global"},
		{"g_1", []string{}, []Dim{{"tenant", "acme"}}, "p.g_1"},
		{"t", []string{"tenant"}, []Dim{{"tenant", "acme.eu_1"}, {"user", "ignored"}}, "p.t.tenant=acme_2eeu_5f1"},
		{"t", []string{"tenant"}, []Dim{{"tenant", "a b=c/d"}}, "p.t.tenant=a_20b_3dc_2fd"},
		{"t", []string{"tenant"}, []Dim{{"tenant", "ü*"}}, "p.t.tenant=_c3_bc_2a"},
		{"t", []string{"tenant"}, []Dim{{"tenant", "A-Z-0-9"}}, "p.t.tenant=A-Z-0-9"},
		{"t", []string{"tenant"}, []Dim{{"tenant", "_5f"}}, "p.t.tenant=_5f5f"},
		// Over 256 bytes: the digest form, SHA-256 of the literal form
		// "p.p.a=" + "_2e"*128 (390 bytes).
		{"p", []string{"a"}, []Dim{{"a", dots}},
			"p.p._h1fef1f44af74870c6f11eaa09e670aa737d0d6e384fe607a34b7a183fcad72d5"},
	}
	for _, tt := range tests {
		p := &Policy{Name: tt.policy, Key: tt.key}
		d := mustDescriptor(t, tt.dims...)
		got, err := p.LimitKey(d)
		if err != nil || got != tt.want {
			t.Errorf("LimitKey(%s, %v) = %q, %v; want %q", tt.policy, tt.dims, got, err, tt.want)
		}
		checkKVKey(t, got)
		b, err := p.AppendLimitKey([]byte("prefix/"), d)
		if err != nil || string(b) != "prefix/"+tt.want {
			t.Errorf("AppendLimitKey = %q, %v", b, err)
		}
	}
	// The digest is over the literal form, computed independently here.
	lit := "p.p.a=" + strings.Repeat("_2e", 128)
	sum := sha256.Sum256([]byte(lit))
	if want := "p.p._h" + hex.EncodeToString(sum[:]); tests[len(tests)-1].want != want {
		t.Errorf("golden digest disagrees with SHA-256 of the literal form: %s", want)
	}
}

func TestLimitKeyMissingDimension(t *testing.T) {
	p := &Policy{Name: "acme", Key: []string{"plan", "tenant"}}
	d := mustDescriptor(t, Dim{"tenant", "acme"}, Dim{"user", "u"})
	b, err := p.AppendLimitKey([]byte("x"), d)
	if !errors.Is(err, ErrMissingDimension) || !errors.Is(err, ErrInvalid) {
		t.Fatalf("err = %v, want ErrMissingDimension", err)
	}
	if want := "descriptor.plan: missing; policy acme keys on it"; err.Error() != want {
		t.Errorf("err = %q, want %q", err, want)
	}
	if string(b) != "x" {
		t.Errorf("dst changed to %q", b)
	}
	if _, err := p.LimitKey(mustDescriptor(t, Dim{"plan", "v7"})); !errors.Is(err, ErrMissingDimension) || !strings.HasPrefix(err.Error(), "descriptor.tenant:") {
		t.Errorf("missing last dimension: %v", err)
	}
}

// decodeLiteralKey reverses the literal form, or reports false for the
// digest form.
func decodeLiteralKey(t *rapid.T, k string) (string, []Dim, bool) {
	toks := strings.Split(k, ".")
	if len(toks) < 2 || toks[0] != "p" {
		t.Fatalf("key %q lacks p.<policy>", k)
	}
	if len(toks) == 3 && strings.HasPrefix(toks[2], "_h") {
		return "", nil, false
	}
	var dims []Dim
	for _, tok := range toks[2:] {
		name, esc, ok := strings.Cut(tok, "=")
		if !ok {
			t.Fatalf("token %q of %q has no '='", tok, k)
		}
		var v []byte
		for i := 0; i < len(esc); i++ {
			if esc[i] != '_' {
				v = append(v, esc[i])
				continue
			}
			if i+3 > len(esc) {
				t.Fatalf("truncated escape in %q", k)
			}
			n, err := strconv.ParseUint(esc[i+1:i+3], 16, 8)
			if err != nil || strings.ToLower(esc[i+1:i+3]) != esc[i+1:i+3] {
				t.Fatalf("bad escape %q in %q", esc[i:i+3], k)
			}
			v = append(v, byte(n))
			i += 2
		}
		dims = append(dims, Dim{name, string(v)})
	}
	return toks[1], dims, true
}

// keyInput draws a policy with key dimensions and a descriptor holding them
// (and maybe more), from small alphabets so that near-collisions are likely.
func keyInput(t *rapid.T, label string) (*Policy, Descriptor) {
	name := rapid.SampledFrom([]string{"a", "a-b", "a_b", "ab", "b", "p0"}).Draw(t, label+"policy")
	allNames := []string{"a", "a_b", "ab", "b", "t", "tenant"}
	keyNames := rapid.SliceOfNDistinct(rapid.SampledFrom(allNames), 0, 4, rapid.ID[string]).Draw(t, label+"key")
	runes := rapid.RuneFrom([]rune{'a', 'A', '_', '.', '=', '5', 'f', '2', 'e', '-', '/', ' ', 'ü', '😀', '*'})
	value := rapid.OneOf(
		rapid.StringOfN(runes, 1, 6, MaxDimValueLen),
		rapid.StringOfN(runes, 40, 128, MaxDimValueLen),
	)
	var dims []Dim
	for _, n := range allNames {
		if slicesContains(keyNames, n) || rapid.Bool().Draw(t, label+"extra-"+n) {
			dims = append(dims, Dim{n, value.Draw(t, label+"value-"+n)})
		}
	}
	p := &Policy{Name: name, Key: sortedCopy(keyNames)}
	if len(dims) == 0 {
		dims = []Dim{{"z", "z"}}
	}
	d, err := NewDescriptor(dims)
	if err != nil {
		t.Fatalf("generated invalid descriptor: %v", err)
	}
	return p, d
}

func slicesContains(s []string, v string) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

func sortedCopy(s []string) []string {
	c := append([]string{}, s...)
	for i := 1; i < len(c); i++ {
		for j := i; j > 0 && c[j] < c[j-1]; j-- {
			c[j], c[j-1] = c[j-1], c[j]
		}
	}
	return c
}

// keyOf is the identity a limit key must encode: the policy name and the
// key dimensions' names and values.
func keyOf(p *Policy, d Descriptor) string {
	var b strings.Builder
	b.WriteString(strconv.Quote(p.Name))
	for _, k := range p.Key {
		v, _ := d.Get(k)
		b.WriteString(" " + strconv.Quote(k) + "=" + strconv.Quote(v))
	}
	return b.String()
}

func TestLimitKeyProperties(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		p1, d1 := keyInput(t, "1")
		p2, d2 := keyInput(t, "2")
		k1, err1 := p1.LimitKey(d1)
		k2, err2 := p2.LimitKey(d2)
		if err1 != nil || err2 != nil {
			t.Fatalf("errors: %v, %v", err1, err2)
		}
		checkKVKey(t, k1)
		checkKVKey(t, k2)
		if (keyOf(p1, d1) == keyOf(p2, d2)) != (k1 == k2) {
			t.Fatalf("inputs %s and %s give keys %q and %q", keyOf(p1, d1), keyOf(p2, d2), k1, k2)
		}
		// The literal form decodes back to exactly its input.
		if name, dims, ok := decodeLiteralKey(t, k1); ok {
			if name != p1.Name || len(dims) != len(p1.Key) {
				t.Fatalf("%q decodes to %s %v", k1, name, dims)
			}
			for i, k := range p1.Key {
				if v, _ := d1.Get(k); dims[i] != (Dim{k, v}) {
					t.Fatalf("%q decodes to %v, want %s=%q", k1, dims[i], k, v)
				}
			}
		} else if want := "p." + p1.Name + "._h"; !strings.HasPrefix(k1, want) || len(k1) != len(want)+64 {
			t.Fatalf("digest key %q is not %s<64 hex>", k1, want)
		}
	})
}

func TestLimitKeyAllocs(t *testing.T) {
	p := &Policy{Name: "acme-search", Key: []string{"operation", "plan", "tenant"}}
	d := mustDescriptor(t, Dim{"tenant", "acme"}, Dim{"operation", "search"}, Dim{"plan", "v7"})
	buf := make([]byte, 0, MaxKeyLen)
	if n := testing.AllocsPerRun(100, func() { buf, _ = p.AppendLimitKey(buf[:0], d) }); n != 0 {
		t.Errorf("AppendLimitKey allocates %v times", n)
	}
}

func BenchmarkAppendLimitKey(b *testing.B) {
	p := &Policy{Name: "acme-search", Key: []string{"operation", "plan", "tenant", "user"}}
	d := mustDescriptor(b, Dim{"tenant", "acme"}, Dim{"operation", "search"}, Dim{"plan", "v7"}, Dim{"user", "user.12345@example.com"})
	buf := make([]byte, 0, MaxKeyLen)
	b.ReportAllocs()
	for b.Loop() {
		buf, _ = p.AppendLimitKey(buf[:0], d)
	}
}

func BenchmarkAppendLimitKeyDigest(b *testing.B) {
	p := &Policy{Name: "acme-search", Key: []string{"user"}}
	d := mustDescriptor(b, Dim{"user", strings.Repeat("ü", 64)})
	buf := make([]byte, 0, 1024)
	b.ReportAllocs()
	for b.Loop() {
		buf, _ = p.AppendLimitKey(buf[:0], d)
	}
}

func FuzzLimitKey(f *testing.F) {
	f.Add("acme", "tenant", "acme", "plan", "v7", true)
	f.Add("p", "a", "x.y_z=", "b", "ü 😀", false)
	f.Add("p", "a", strings.Repeat(".", 128), "b", strings.Repeat("_", 128), true)
	f.Add("p", "a", "_2e", "a", ".", true)
	f.Fuzz(func(t *testing.T, policy, n1, v1, n2, v2 string, keyBoth bool) {
		if ValidateName(policy) != nil {
			return
		}
		d, err := NewDescriptor([]Dim{{n1, v1}, {n2, v2}})
		if err != nil {
			return
		}
		key := []string{d[0].Name}
		if keyBoth {
			key = append(key, d[1].Name)
		}
		p := &Policy{Name: policy, Key: key}
		k, err := p.LimitKey(d)
		if err != nil {
			t.Fatal(err)
		}
		checkKVKey(t, k)
		// Changing any key value changes the key.
		for i := range key {
			alt := append(Descriptor(nil), d...)
			alt[i].Value += "_"
			if len(alt[i].Value) > MaxDimValueLen {
				alt[i].Value = alt[i].Value[1:]
				if alt[i].Value == d[i].Value {
					continue
				}
			}
			if valueProblem(alt[i].Value) != "" {
				continue
			}
			if k2, err := p.LimitKey(alt); err != nil || k2 == k {
				t.Fatalf("%q and %q share key %q (%v)", d, alt, k, err)
			}
		}
		// A key dimension the descriptor lacks is an error, not a key.
		p2 := &Policy{Name: policy, Key: []string{"zz_missing"}}
		if _, err := p2.LimitKey(d); d[1].Name != "zz_missing" && d[0].Name != "zz_missing" && !errors.Is(err, ErrMissingDimension) {
			t.Fatalf("missing dimension: %v", err)
		}
	})
}

func TestDescriptorOfKeyRoundTrip(t *testing.T) {
	cases := []struct {
		policy string
		dims   []Dim
	}{
		{"acme-search", []Dim{{"tenant", "acme"}, {"operation", "search"}, {"plan", "v7"}}},
		{"t", []Dim{{"tenant", "acme.eu_1"}}},
		{"t", []Dim{{"tenant", "a b=c/d"}}},
		{"t", []Dim{{"tenant", "ü*"}}},
		{"j5", []Dim{{"k", "-"}}},
	}
	for _, c := range cases {
		d, err := NewDescriptor(append([]Dim(nil), c.dims...))
		if err != nil {
			t.Fatal(err)
		}
		key := "p." + c.policy
		for _, dim := range d {
			key += "." + dim.Name + "=" + string(appendEscaped(nil, dim.Value))
		}
		if !KeyCarries(key, c.policy, d) {
			t.Fatalf("KeyCarries(%q, %q, %v) = false", key, c.policy, d)
		}
		got, ok := DescriptorOfKey(key, c.policy)
		if !ok || len(got) != len(d) {
			t.Fatalf("DescriptorOfKey(%q) = %v, %v; want %v", key, got, ok, d)
		}
		for i := range d {
			if got[i] != d[i] {
				t.Fatalf("DescriptorOfKey(%q) = %v; want %v", key, got, d)
			}
		}
	}
	// Keys that carry no descriptor.
	for _, k := range []string{"p.t", "p.t._overflow", "p.t._h" + strings.Repeat("0", 64), "p.u.tenant=a",
		"p.t.tenant=", "p.t.tenant=a.", "p.t.tenant=_2", "p.t.tenant=_41", "p.t.tenant=_2E", "p.t.b=1.a=2", "p.t.a=1.a=2", "p.t.tenant=a_g1"} {
		if d, ok := DescriptorOfKey(k, "t"); ok {
			t.Errorf("DescriptorOfKey(%q) = %v, true; want false", k, d)
		}
	}
	// A descriptor with a dimension the key does not hold is not carried.
	d, _ := NewDescriptor([]Dim{{"tenant", "a"}, {"user", "u"}})
	if KeyCarries("p.t.tenant=a", "t", d) {
		t.Error("KeyCarries ignored a dimension outside the key")
	}
}

func FuzzDescriptorOfKey(f *testing.F) {
	f.Add("p.t.tenant=acme_2eeu_5f1", "t")
	f.Add("p.acme-search.operation=search.plan=v7.tenant=acme", "acme-search")
	f.Fuzz(func(t *testing.T, key, policy string) {
		d, ok := DescriptorOfKey(key, policy)
		if !ok {
			return
		}
		if !KeyCarries(key, policy, d) {
			t.Fatalf("DescriptorOfKey(%q, %q) = %v, but KeyCarries is false", key, policy, d)
		}
	})
}
