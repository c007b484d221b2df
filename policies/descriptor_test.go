package policies

import (
	"errors"
	"strings"
	"testing"
)

func TestNewDescriptor(t *testing.T) {
	d, err := NewDescriptor([]Dim{{"tenant", "acme"}, {"operation", "search"}, {"plan", "v7 gold ü 😀"}})
	if err != nil {
		t.Fatal(err)
	}
	want := Descriptor{{"operation", "search"}, {"plan", "v7 gold ü 😀"}, {"tenant", "acme"}}
	if !equalDims(d, want) {
		t.Errorf("got %v, want %v", d, want)
	}
	if v, ok := d.Get("plan"); !ok || v != "v7 gold ü 😀" {
		t.Errorf("Get(plan) = %q, %v", v, ok)
	}
	if _, ok := d.Get("user"); ok {
		t.Error("Get(user) found")
	}
	max := make([]Dim, 16)
	for i := range max {
		max[i] = Dim{Name: "d" + strings.Repeat("x", i), Value: strings.Repeat("v", 128)}
	}
	max[3].Name = strings.Repeat("z", 32)
	if _, err := NewDescriptor(max); err != nil {
		t.Errorf("16 dims of 128 bytes: %v", err)
	}
}

func TestNewDescriptorRejects(t *testing.T) {
	seventeen := make([]Dim, 17)
	for i := range seventeen {
		seventeen[i] = Dim{Name: "d" + strings.Repeat("x", i), Value: "v"}
	}
	tests := []struct {
		dims []Dim
		want string
	}{
		{nil, `descriptor: has no dimensions (needs 1..16)`},
		{seventeen, `descriptor: has 17 dimensions (at most 16)`},
		{[]Dim{{"", "v"}}, `descriptor: dimension name "" is not [a-z][a-z0-9_]{0,31}`},
		{[]Dim{{"Tenant", "v"}}, `descriptor: dimension name "Tenant" is not [a-z][a-z0-9_]{0,31}`},
		{[]Dim{{"_t", "v"}}, `descriptor: dimension name "_t" is not [a-z][a-z0-9_]{0,31}`},
		{[]Dim{{"t-x", "v"}}, `descriptor: dimension name "t-x" is not [a-z][a-z0-9_]{0,31}`},
		{[]Dim{{strings.Repeat("a", 33), "v"}}, `descriptor: dimension name "` + strings.Repeat("a", 33) + `" is not [a-z][a-z0-9_]{0,31}`},
		{[]Dim{{"tenant", ""}}, `descriptor.tenant: value is empty`},
		{[]Dim{{"tenant", strings.Repeat("v", 129)}}, `descriptor.tenant: value is 129 bytes (at most 128)`},
		{[]Dim{{"tenant", "a\x00b"}}, `descriptor.tenant: value has a control character`},
		{[]Dim{{"tenant", "a\nb"}}, `descriptor.tenant: value has a control character`},
		{[]Dim{{"tenant", "a\x7fb"}}, `descriptor.tenant: value has a control character`},
		{[]Dim{{"tenant", "a\u0085b"}}, `descriptor.tenant: value has a control character`},
		{[]Dim{{"tenant", "a\xffb"}}, `descriptor.tenant: value is not valid UTF-8`},
		{[]Dim{{"tenant", "\xc3"}}, `descriptor.tenant: value is not valid UTF-8`},
		{[]Dim{{"tenant", "\xed\xa0\x80"}}, `descriptor.tenant: value is not valid UTF-8`}, // a surrogate
		{[]Dim{{"tenant", "a"}, {"plan", "b"}, {"tenant", "c"}}, `descriptor.tenant: duplicate dimension`},
	}
	for _, tt := range tests {
		_, err := NewDescriptor(tt.dims)
		if err == nil {
			t.Errorf("NewDescriptor(%q) accepted, want %s", tt.dims, tt.want)
			continue
		}
		var pe *Error
		if err.Error() != tt.want || !errors.Is(err, ErrInvalid) || !errors.As(err, &pe) {
			t.Errorf("NewDescriptor(%q)\n got  %v\n want %s", tt.dims, err, tt.want)
		}
	}
}

func TestNewDescriptorAllocs(t *testing.T) {
	dims := []Dim{{"user", "u-1"}, {"tenant", "acme"}, {"operation", "search"}, {"plan", "v7"}}
	n := testing.AllocsPerRun(100, func() {
		if _, err := NewDescriptor(dims); err != nil {
			t.Fatal(err)
		}
	})
	if n != 0 {
		t.Errorf("NewDescriptor allocates %v times", n)
	}
}

func BenchmarkNewDescriptor(b *testing.B) {
	dims := []Dim{{"user", "user-12345"}, {"tenant", "acme"}, {"operation", "search"}, {"plan", "v7"}}
	b.ReportAllocs()
	for b.Loop() {
		dims[0], dims[3] = dims[3], dims[0] // unsort
		if _, err := NewDescriptor(dims); err != nil {
			b.Fatal(err)
		}
	}
}

func FuzzNewDescriptor(f *testing.F) {
	f.Add("tenant", "acme", "plan", "v7")
	f.Add("tenant", "a\x00b", "tenant", "x")
	f.Add("Tenant", "ü", "a_b", "\xff")
	f.Add("a", strings.Repeat("v", 129), "b", " ")
	f.Fuzz(func(t *testing.T, n1, v1, n2, v2 string) {
		d, err := NewDescriptor([]Dim{{n1, v1}, {n2, v2}})
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error %v does not match ErrInvalid", err)
			}
			return
		}
		if len(d) != 2 || d[0].Name >= d[1].Name {
			t.Fatalf("not sorted or duplicate: %q", d)
		}
		for _, x := range d {
			if !validDimName(x.Name) || valueProblem(x.Value) != "" {
				t.Fatalf("accepted invalid %q", x)
			}
			if v, ok := d.Get(x.Name); !ok || v != x.Value {
				t.Fatalf("Get(%q) = %q, %v", x.Name, v, ok)
			}
		}
		// A valid descriptor re-validates unchanged.
		again, err := NewDescriptor(append([]Dim(nil), d...))
		if err != nil || !equalDims(again, d) {
			t.Fatalf("re-validation: %v, %v", again, err)
		}
	})
}
