package mesh

import (
	"strconv"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
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
	n := offlineNode(b, kvstate.NewMemStore(), time.Second, p)
	reqs := make([]nopRequest, 10000)
	for i := range reqs {
		reqs[i].data = []byte(`{"descriptor":{"tenant":"k` + strconv.Itoa(i) + `"},"cost":"1"}`)
	}
	for i := range reqs {
		n.handleDecide(&reqs[i])
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		n.handleDecide(&reqs[i%len(reqs)])
		i++
	}
}
