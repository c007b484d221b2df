package policies

import "testing"

func TestParseUnits(t *testing.T) {
	for s, want := range map[string]int64{"0": 0, "0.0": 0, "0.000000": 0, "2.5": 2_500_000, "0.000001": 1,
		"1000000000000": 1_000_000_000_000_000_000} {
		if got, err := ParseUnits(s); err != nil || got != want {
			t.Errorf("ParseUnits(%q) = %d, %v; want %d", s, got, err, want)
		}
	}
	for _, s := range []string{"", "-1", "01", "1e3", "0.0000001", "00", "0.", "x"} {
		if v, err := ParseUnits(s); err == nil {
			t.Errorf("ParseUnits(%q) = %d, want an error", s, v)
		}
	}
}
