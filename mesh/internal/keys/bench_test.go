package keys

import (
	"strconv"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
)

// countCalls counts the calls finished.
type countCalls struct{ n int }

func (c *countCalls) Finish(*Call) { c.n++ }

// BenchmarkSubmit measures the hot path of a decision through the table
// (Table.Submit to the call finished) over a store that completes at once:
// one key or many, in each mode that goes through the table.
func BenchmarkSubmit(b *testing.B) {
	for _, mode := range []string{"strict", "async", "local"} {
		for _, nkeys := range []int{1, 1024} {
			b.Run(mode+"/keys="+strconv.Itoa(nkeys), func(b *testing.B) {
				p := tbPolicy(b, "p", 1, "1000000/s", 1000, `,"mode":"`+mode+`"`)
				rt := &manualRuntime{now: time.Unix(1000, 0)}
				tbl := New(Config{Env: newFakeEnv(p), Store: &nullStore{}, Runtime: rt, TTL: time.Hour})
				keys := make([]string, nkeys)
				for i := range keys {
					keys[i] = "p.p.tenant=k" + strconv.Itoa(i)
				}
				var done countCalls
				now := rt.now.UnixNano()
				b.ReportAllocs()
				b.ResetTimer()
				for i := range b.N {
					now += int64(time.Microsecond)
					c := &Call{Policy: p, Cost: kvstate.Unit, Deadline: now + int64(time.Second), Done: &done}
					tbl.Submit(keys[i%nkeys], c, now, nil)
				}
				b.StopTimer()
				if done.n != b.N {
					b.Fatalf("%d calls finished, want %d", done.n, b.N)
				}
			})
		}
	}
}
