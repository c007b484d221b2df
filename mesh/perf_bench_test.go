package mesh_test

import (
	"bytes"
	"context"
	"os"
	"strings"
	"testing"

	"github.com/limitmesh/limitmesh/cli"
)

// BenchmarkLimitmeshBench runs `limitmesh bench` (embedded node) once per
// iteration, so the node's hot path can be profiled with -cpuprofile:
//
//	LIMITMESH_PERF_ARGS="--keys 10000 --zipf 1.1" go test ./mesh -run X -bench LimitmeshBench -benchtime 1x -cpuprofile cpu.out
//
// The bench's JSON line is logged.
func BenchmarkLimitmeshBench(b *testing.B) {
	args := []string{"bench", "--duration", "5s", "--echo-duration", "1s", "--json", "--quiet"}
	if extra := os.Getenv("LIMITMESH_PERF_ARGS"); extra != "" {
		args = append(args, strings.Fields(extra)...)
	}
	for b.Loop() {
		var out, errb bytes.Buffer
		code := cli.Main(context.Background(), args, nil, strings.NewReader(""), &out, &errb)
		if code != 0 {
			b.Fatalf("bench exited %d: %s", code, errb.String())
		}
		lines := strings.Split(strings.TrimSpace(out.String()), "\n")
		b.Log(lines[len(lines)-1])
	}
}
