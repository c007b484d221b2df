package wire

import (
	"math"
	"math/big"
	"strings"
	"testing"
)

func TestAppendUnits(t *testing.T) {
	cases := []struct {
		v    int64
		want string
	}{
		{0, "0"}, {1, "0.000001"}, {10, "0.00001"}, {1_500_000, "1.5"}, {3_000_000, "3"},
		{2_500_001, "2.500001"}, {-1, "-0.000001"}, {-1_500_000, "-1.5"},
		{1_000_000_000_000 * unit, "1000000000000"},
		{math.MaxInt64, "9223372036854.775807"}, {math.MinInt64, "-9223372036854.775808"},
	}
	for _, c := range cases {
		if got := string(AppendUnits([]byte("x"), c.v)); got != "x"+c.want {
			t.Errorf("AppendUnits(%d) = %s, want x%s", c.v, got, c.want)
		}
		if got := FormatUnits(c.v); got != c.want {
			t.Errorf("FormatUnits(%d) = %s, want %s", c.v, got, c.want)
		}
	}
}

// FuzzAppendUnits: the text is v/1e6 exactly (as big.Rat reads it), with
// no trailing zero in the fraction and no '.' without one.
func FuzzAppendUnits(f *testing.F) {
	for _, v := range []int64{0, 1, -1, 1_500_000, 999_999, math.MaxInt64, math.MinInt64} {
		f.Add(v)
	}
	f.Fuzz(func(t *testing.T, v int64) {
		s := FormatUnits(v)
		got, ok := new(big.Rat).SetString(s)
		if !ok {
			t.Fatalf("FormatUnits(%d) = %q: not a decimal", v, s)
		}
		if want := big.NewRat(v, unit); got.Cmp(want) != 0 {
			t.Fatalf("FormatUnits(%d) = %q = %s, want %s", v, s, got.RatString(), want.RatString())
		}
		if i := strings.IndexByte(s, '.'); i >= 0 && (strings.HasSuffix(s, "0") || len(s)-i-1 > 6) {
			t.Fatalf("FormatUnits(%d) = %q: not the shortest fraction", v, s)
		}
		if strings.ContainsAny(s, "eE+") || strings.HasPrefix(strings.TrimPrefix(s, "-"), "00") {
			t.Fatalf("FormatUnits(%d) = %q", v, s)
		}
	})
}
