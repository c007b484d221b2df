package bench

import (
	"testing"

	"github.com/limitmesh/limitmesh/policies"
)

// TestBenchCandidateDocs: every candidate document is a valid candidate on
// the run's descriptors.
func TestBenchCandidateDocs(t *testing.T) {
	for i := range 10 {
		name := benchShadowName("0badf00d", i)
		p, err := policies.Parse(name, benchCandidateDoc("0badf00d", i))
		if err != nil {
			t.Fatalf("candidate %d: %v", i, err)
		}
		if !p.Shadow || len(p.Match) != 1 || p.Match[0].Name != "bench_run" || p.Match[0].Value != "0badf00d" {
			t.Errorf("candidate %d: %+v", i, p)
		}
	}
}
