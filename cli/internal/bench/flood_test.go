package bench

import (
	"testing"

	"github.com/limitmesh/limitmesh/policies"
)

// TestBenchFloodConfig: the flood's rate is F times its key's rate and
// its policy parses.
func TestBenchFloodConfig(t *testing.T) {
	for _, tc := range []struct {
		f    FloodConfig
		want float64
	}{
		{FloodConfig{Factor: 10, Rate: "1000/s", Burst: "100"}, 10000},
		{FloodConfig{Factor: 2.5, Rate: "60/m", Burst: "1"}, 2.5},
		{FloodConfig{Factor: 10, Rate: "36/h", Burst: "1"}, 0.1},
	} {
		got, err := tc.f.perSecond()
		if err != nil || got < tc.want*0.999999 || got > tc.want*1.000001 {
			t.Errorf("%+v: %v/s, %v; want %v/s", tc.f, got, err, tc.want)
		}
		p, err := policies.Parse("bench-flood-r", tc.f.policyDoc("r", "async"))
		if err != nil || p.Mode != policies.ModeAsync || len(p.Match) != 2 {
			t.Errorf("%+v: policy %+v, %v", tc.f, p, err)
		}
	}
	if maxKeysJSON(0) != "" || maxKeysJSON(100000) != `,"max_keys":100000` {
		t.Errorf("maxKeysJSON: %q %q", maxKeysJSON(0), maxKeysJSON(100000))
	}
}
