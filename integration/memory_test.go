package integration

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
)

// TestMemoryDistinctKeys measures a node's resident memory under a flood
// of distinct limit keys (CONTRACT.md §9 max_keys). It runs only when
// LIMITMESH_MEMORY_KEYS is set to the number of distinct keys (e.g.
// 2000000); LIMITMESH_MEMORY_MAX_KEYS sets the policy's max_keys (unset:
// the default). The node is one `limitmesh serve --nats-url` process (its
// own memory only: NATS and JetStream run in this test's process); each
// key gets one request, at most memoryWindow in flight. It logs the
// process's VmRSS (/proc/<pid>/status) before and as the keys come, the
// keys it holds and the overflow count; it checks only that the keys held
// stay within max_keys (plus the overflow key).
func TestMemoryDistinctKeys(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("LIMITMESH_MEMORY_KEYS"))
	if n <= 0 {
		t.Skip("set LIMITMESH_MEMORY_KEYS to the number of distinct keys to measure with")
	}
	maxKeys, _ := strconv.Atoi(os.Getenv("LIMITMESH_MEMORY_MAX_KEYS"))
	const memoryWindow = 1000
	e := server(t, t.TempDir())
	p := startProcs(t, procSpec{n: 1, natsURL: e.ClientURL(), replicas: 1})[0]
	nc := connect(t, e)
	doc := `{"match": {"tenant": "*"}, "key": ["tenant"],
 "limits": [{"name": "rate", "algorithm": "token_bucket", "rate": "1/s", "burst": 10}]`
	if maxKeys > 0 {
		doc += fmt.Sprintf(`, "max_keys": %d`, maxKeys)
	}
	rev := putPolicy(t, nc, "rl_policies", "mem", doc+"}")
	waitProcsApplied(t, "mem", rev, p)
	pid := p.cmd.Process.Pid
	report := func(what string, start time.Time) {
		t.Logf("%-12s VmRSS %7.1f MB, limitmesh_cached_keys %8.0f, overflow %8.0f, %6.1fs",
			what, float64(vmRSS(t, pid))/(1<<20), procMetric(t, p, "limitmesh_cached_keys"),
			procMetric(t, p, `limitmesh_overflow_total{policy="mem"}`), time.Since(start).Seconds())
	}
	start := time.Now()
	report("before", start)

	var replies, failed atomic.Int64
	var firstFailure atomic.Value
	inbox := nc.NewInbox()
	sub, err := nc.Subscribe(inbox, func(m *nats.Msg) {
		if m.Header.Get("Nats-Service-Error-Code") != "" || !bytes.Contains(m.Data, []byte(`"policy":"mem"`)) {
			failed.Add(1)
			firstFailure.CompareAndSwap(nil, string(m.Data))
		}
		replies.Add(1)
	})
	if err != nil {
		t.Fatal(err)
	}
	_ = sub.SetPendingLimits(-1, -1)
	body := make([]byte, 0, 64)
	for i := range n {
		for int64(i)-replies.Load() >= memoryWindow {
			time.Sleep(100 * time.Microsecond)
		}
		body = append(body[:0], `{"descriptor":{"tenant":"t`...)
		body = strconv.AppendInt(body, int64(i), 10)
		body = append(body, `"}}`...)
		if err := nc.PublishRequest("rl.v1.decide", inbox, body); err != nil {
			t.Fatal(err)
		}
		if (i+1)%(max(n/10, 1)) == 0 {
			report(fmt.Sprintf("%d keys", i+1), start)
		}
	}
	waitFor(t, "every reply", func() bool { return replies.Load() == int64(n) })
	report("after", start)
	if f := failed.Load(); f > 0 {
		t.Logf("%d of %d requests failed (503 or another reply); the first: %s", f, n, firstFailure.Load())
	}
	if held := procMetric(t, p, "limitmesh_cached_keys"); maxKeys > 0 && held > float64(maxKeys+1) {
		t.Fatalf("the node holds %v keys, more than max_keys %d and the overflow key", held, maxKeys)
	}
}

// vmRSS returns the resident set size of process pid, in bytes.
func vmRSS(t *testing.T, pid int) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "VmRSS:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return kb << 10
		}
	}
	t.Fatalf("no VmRSS in /proc/%d/status", pid)
	return 0
}
