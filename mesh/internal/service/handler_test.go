package service

import (
	"encoding/json"
	"fmt"
	"math"
	"strconv"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/storetest"
	"github.com/nats-io/nats.go/micro"
)

// nopRequest is a micro.Request whose replies are dropped.
type nopRequest struct{ data []byte }

func (r *nopRequest) Respond([]byte, ...micro.RespondOpt) error                { return nil }
func (r *nopRequest) RespondJSON(any, ...micro.RespondOpt) error               { return nil }
func (r *nopRequest) Error(_, _ string, _ []byte, _ ...micro.RespondOpt) error { return nil }
func (r *nopRequest) Data() []byte                                             { return r.data }
func (r *nopRequest) Headers() micro.Headers                                   { return nil }
func (r *nopRequest) Subject() string                                          { return "rl.v1.decide" }
func (r *nopRequest) Reply() string                                            { return "_INBOX.x" }

// BenchmarkHandleDecideAsync is the node's own cost of one async decision
// (decode, policy match, limit key, owner core, reply encoding, metrics)
// over 10,000 keys, without NATS: what `limitmesh bench --mode async` adds
// to a raw request-reply.
func BenchmarkHandleDecideAsync(b *testing.B) {
	p := tbPolicy(b, "p", 4, "1000/s", 100, `,"mode":"async"`)
	n := offlineService(b, memStore{storetest.NewMem()}, time.Second, p)
	reqs := make([]nopRequest, 10000)
	for i := range reqs {
		reqs[i].data = []byte(`{"descriptor":{"tenant":"k` + strconv.Itoa(i) + `"},"cost":"1"}`)
	}
	for i := range reqs {
		n.Handle(&reqs[i])
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		n.Handle(&reqs[i%len(reqs)])
		i++
	}
}

// TestRoutedRecycled: requests decided concurrently on many keys, inline
// (async) and through the key runners (strict), each get exactly their own
// reply (a routed value reused too early would answer another request).
func TestRoutedRecycled(t *testing.T) {
	for _, mode := range []string{"async", "strict"} {
		t.Run(mode, func(t *testing.T) {
			p := tbPolicy(t, "p", 4, "1/h", 1000, `,"mode":"`+mode+`"`)
			n := offlineService(t, memStore{storetest.NewMem()}, 5*time.Second, p)
			const workers, each = 8, 200
			errs := make(chan error, workers)
			for w := range workers {
				go func() {
					body := []byte(`{"descriptor":{"tenant":"w` + strconv.Itoa(w) + `"}}`)
					for i := range each {
						r := &fakeRequest{data: body, out: make(chan fakeReply, 2)}
						n.Handle(r)
						rep := <-r.out
						// 1/h refills a few millionths of a unit meanwhile.
						var d struct{ Remaining float64 }
						if rep.code != "" || json.Unmarshal(rep.body, &d) != nil || math.Floor(d.Remaining) != float64(999-i) {
							errs <- fmt.Errorf("worker %d request %d: %s %s, want %d left", w, i, rep.code, rep.body, 999-i)
							return
						}
						if len(r.out) != 0 {
							errs <- fmt.Errorf("worker %d request %d: a second reply", w, i)
							return
						}
					}
					errs <- nil
				}()
			}
			for range workers {
				if err := <-errs; err != nil {
					t.Fatal(err)
				}
			}
		})
	}
}
