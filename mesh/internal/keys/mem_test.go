package keys

import (
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
)

// nullStore answers every load "absent" and every write "done", keeping
// nothing: the memory of a table on it is the table's own.
type nullStore struct{ rev uint64 }

func (s *nullStore) GetAsync(_ string, _ time.Duration, done func([]byte, uint64, error)) {
	done(nil, 0, kvstate.ErrNotFound)
}

func (s *nullStore) UpdateAsync(_ string, _ []byte, _ []keyrec.Usage, _ uint64, _ time.Duration, done func(uint64, error)) {
	s.rev++
	done(s.rev, nil)
}

// BenchmarkKeyMemory reports the heap a key held in the table costs
// (bytes/key): one admission each of b.N distinct strict keys (with usage
// descriptors, as the node records them), measured after a GC.
func BenchmarkKeyMemory(b *testing.B) {
	p := tbPolicy(b, "p", 1, "10/s", 40, "")
	rt := &manualRuntime{now: time.Unix(1000, 0)}
	tbl := New(Config{Env: newFakeEnv(p), Store: &nullStore{}, Runtime: rt, TTL: time.Hour})
	keys := make([]string, b.N)
	for i := range keys {
		keys[i] = "p.p.tenant=k" + strconv.Itoa(i)
	}
	var done doneCalls
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	b.ResetTimer()
	now := rt.now.UnixNano()
	for _, k := range keys {
		c := &Call{Policy: p, Cost: kvstate.Unit, Deadline: now + int64(time.Second), Done: &done}
		tbl.Submit(k, c, now, nil)
		done.list = done.list[:0]
	}
	b.StopTimer()
	runtime.GC()
	runtime.ReadMemStats(&after)
	if tbl.Len() != b.N {
		b.Fatalf("%d keys held, want %d", tbl.Len(), b.N)
	}
	b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/float64(b.N), "bytes/key")
	runtime.KeepAlive(keys)
}
