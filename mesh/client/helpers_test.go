package client

import (
	"encoding/json"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/jstest"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
)

// startServer starts a core nats-server (the SDK needs no JetStream) on a
// random port, shut down when the test ends.
func startServer(t testing.TB) *server.Server {
	t.Helper()
	return jstest.Start(t, jstest.NoJetStream).Server
}

// seenRequest is a decide request as the test responder decoded it, with
// encoding/json (an independent decoder of the client's hand-written JSON).
type seenRequest struct {
	Descriptor map[string]string `json:"descriptor"`
	Cost       json.RawMessage   `json:"cost"`
	RequestID  string            `json:"request_id"`
	DryRun     bool              `json:"dry_run"`
}

// answer is what the test responder replies: an error (Code != 0) or Reply.
type answer struct {
	Code    int    // 0: reply with Reply
	Symbol  string // error symbol
	Message string
	Reply   string // raw JSON reply body
	Silent  bool   // never answer
}

// responder is a decide service written for the tests: a NATS micro
// service on the contract's subject that answers per a function of the
// request. It records every request it received.
type responder struct {
	t   testing.TB
	svc micro.Service

	mu   sync.Mutex
	seen []seenRequest
}

// startResponder serves prefix.v1.decide on nc, answering with fn.
func startResponder(t testing.TB, nc *nats.Conn, prefix string, fn func(seenRequest) answer) *responder {
	t.Helper()
	r := &responder{t: t}
	svc, err := micro.AddService(nc, micro.Config{Name: "limitmesh", Version: "0.0.1", QueueGroup: "limitmesh"})
	if err != nil {
		t.Fatal(err)
	}
	r.svc = svc
	err = svc.AddGroup(prefix+".v1").AddEndpoint("decide", micro.HandlerFunc(func(req micro.Request) {
		var sr seenRequest
		if err := json.Unmarshal(req.Data(), &sr); err != nil {
			body, _ := json.Marshal(map[string]string{"error": "bad_request", "message": err.Error()})
			_ = req.Error("400", "bad request", body)
			return
		}
		r.mu.Lock()
		r.seen = append(r.seen, sr)
		r.mu.Unlock()
		a := fn(sr)
		switch {
		case a.Silent:
			return
		case a.Code != 0:
			body, _ := json.Marshal(map[string]string{"error": a.Symbol, "message": a.Message})
			_ = req.Error(strconv.Itoa(a.Code), a.Message, body)
		default:
			_ = req.Respond([]byte(a.Reply))
		}
	}))
	if err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = svc.Stop() })
	return r
}

// requests returns the requests received so far.
func (r *responder) requests() []seenRequest {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]seenRequest(nil), r.seen...)
}

// stop stops the service: its subscriptions are gone once it returns and
// the connection is flushed.
func (r *responder) stop(nc *nats.Conn) {
	r.t.Helper()
	if err := r.svc.Stop(); err != nil {
		r.t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		r.t.Fatal(err)
	}
}

// reply returns an answer with the JSON reply of the given fields.
func reply(allowed bool, policy string, revision uint64, remaining string, retryMs, resetMs int64) answer {
	return answer{Reply: `{"allowed":` + strconv.FormatBool(allowed) + `,"policy":` + strconv.Quote(policy) +
		`,"revision":` + strconv.FormatUint(revision, 10) + `,"remaining":` + remaining +
		`,"retry_after_ms":` + strconv.FormatInt(retryMs, 10) + `,"reset_after_ms":` + strconv.FormatInt(resetMs, 10) + `}`}
}

// fakeClock is a manually advanced clock, safe for concurrent use.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{now: time.Unix(1_700_000_000, 0)} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// newClient returns a Client on nc with opts, failing the test on error.
func newClient(t testing.TB, nc *nats.Conn, opts ...Option) *Client {
	t.Helper()
	c, err := New(nc, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return c
}
