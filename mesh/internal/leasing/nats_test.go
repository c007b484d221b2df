package leasing

import (
	"context"
	"encoding/json"
	"sync"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/jstest"

	"github.com/limitmesh/limitmesh/mesh/internal/ownership"
	"github.com/limitmesh/limitmesh/mesh/internal/policyset"
	"github.com/limitmesh/limitmesh/mesh/internal/route"
	"github.com/limitmesh/limitmesh/mesh/internal/rt"
	"github.com/limitmesh/limitmesh/policies"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
)

// startNATS starts an embedded nats-server (shut down at cleanup) and
// returns a connection to it.
func startNATS(t *testing.T) *nats.Conn {
	t.Helper()
	return jstest.Connect(t, jstest.Start(t, jstest.NoJetStream).Server)
}

// testOwner answers holder nodes on a partition's owner subject in place
// of a key's owner core: its first answer is not_owner (a partition
// moving), then it grants what is asked for (ttl 2 s) and takes reports
// and returns. It keeps the requests it answered.
type testOwner struct {
	mu    sync.Mutex
	reqs  []ownerRequest
	grant uint64
}

func (o *testOwner) handle(m *nats.Msg) {
	var req ownerRequest
	if err := decode(m.Data, &req); err != nil {
		respond(msgRequest{m}, reply{Result: resBadRequest})
		return
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	o.reqs = append(o.reqs, req)
	switch {
	case len(o.reqs) == 1:
		respond(msgRequest{m}, reply{Result: resNotOwner})
	case req.Op == opAcquire:
		o.grant++
		respond(msgRequest{m}, reply{Result: resGranted, Policy: req.Policy, Grant: o.grant, Epoch: 41, Units: req.Want, TTL: int64(2 * time.Second)})
	default:
		respond(msgRequest{m}, reply{Result: resOK})
	}
}

func (o *testOwner) requests() []ownerRequest {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]ownerRequest(nil), o.reqs...)
}

// TestLeasingOverNATS: a node's holder and gateway sides against an
// owner on a real server. A plain decision goes to the owner while the
// pool asks for a grant (again after not_owner), then is spent here; a
// gateway's acquire is carved from the node's grant; its return reaches
// the pool; Stop returns the grant with everything spent on it.
func TestLeasingOverNATS(t *testing.T) {
	nc := startNATS(t)
	const prefix, parts = "t", 4
	p, err := policies.Parse("acme", []byte(`{"match":{"tenant":"*"},"limits":[{"algorithm":"token_bucket","rate":"10/s","burst":40}],"mode":"leased","lease":{"size":10,"max_outstanding":40}}`))
	if err != nil {
		t.Fatal(err)
	}
	set := policyset.New()
	set.Put(p, time.Now().UnixNano())
	desc, _ := descriptorOf(map[string]string{"tenant": "a"})
	key, err := p.LimitKey(desc)
	if err != nil {
		t.Fatal(err)
	}
	part := ownership.PartitionOf(key, parts)
	owner := &testOwner{}
	if _, err := nc.Subscribe(OwnerSubject(prefix, part), owner.handle); err != nil {
		t.Fatal(err)
	}
	l, err := New(Config{Conn: nc, Prefix: prefix, Self: "n1", Policies: set, Route: route.New(prefix, parts, rt.Real, time.Now()),
		Runtime: rt.Real, Timeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := nc.Subscribe(NodeSubject(prefix, "n1"), l.HandleNode); err != nil {
		t.Fatal(err)
	}
	svc, err := micro.AddService(nc, micro.Config{Name: "leasing-test", Version: "0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = svc.Stop() })
	if err := svc.AddEndpoint("lease", micro.HandlerFunc(l.HandleGateway), micro.WithEndpointSubject(GatewaySubject(prefix))); err != nil {
		t.Fatal(err)
	}

	if _, ok := l.Spend(p, key, part, u, time.Now()); ok {
		t.Fatal("spent before any grant")
	}
	e := l.lookup(p, key, part)
	e.mu.Lock()
	done := e.done
	e.mu.Unlock()
	if done == nil {
		t.Fatal("no acquire started")
	}
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the acquire did not end")
	}
	if d, ok := l.Spend(p, key, part, u, time.Now()); !ok || !d.Allowed || d.Remaining != 9*u {
		t.Fatalf("spend from the grant: %+v %v", d, ok)
	}

	ask := func(subject string, req any) reply {
		t.Helper()
		b, _ := json.Marshal(req)
		m, err := nc.Request(subject, b, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		var r reply
		if err := json.Unmarshal(m.Data, &r); err != nil {
			t.Fatal(err)
		}
		return r
	}
	g := ask(GatewaySubject(prefix), gatewayRequest{Op: opAcquire, Descriptor: map[string]string{"tenant": "a"}, Holder: "gw-1", Min: u})
	if g.Result != resGranted || g.Units != 9*u || g.Epoch != 41 || g.ReportTo != NodeSubject(prefix, "n1") || g.TTL <= 0 || g.TTL > int64(1800*time.Millisecond) {
		t.Fatalf("gateway acquire: %+v", g)
	}
	if r := ask(GatewaySubject(prefix), gatewayRequest{Op: opAcquire, Descriptor: map[string]string{"other": "a"}, Holder: "gw-1"}); r.Result != resNotLeased {
		t.Fatalf("acquire of no leased policy: %+v", r)
	}
	if r := ask(g.ReportTo, gatewayRequest{Op: opReturn, Grant: g.Grant, Epoch: g.Epoch, Spent: 2 * u}); r.Result != resOK {
		t.Fatalf("gateway return: %+v", r)
	}
	if r := ask(g.ReportTo, gatewayRequest{Op: opReturn, Grant: g.Grant, Epoch: g.Epoch, Spent: 2 * u}); r.Result != resUnknown {
		t.Fatalf("gateway return, again: %+v", r)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	l.Stop(ctx)
	reqs := owner.requests()
	last := reqs[len(reqs)-1]
	if last.Op != opReturn || last.Key != key || last.Grant != 1 || last.Epoch != 41 || last.Spent != 3*u {
		t.Fatalf("requests to the owner %+v: want the return of grant 1 with 3 units spent last", reqs)
	}
	if _, ok := l.Spend(p, key, part, u, time.Now()); ok {
		t.Fatal("spent after Stop")
	}
}
