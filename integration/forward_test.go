package integration

import (
	"errors"
	"math"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/mesh"
	"github.com/nats-io/nats.go"
)

// TestForwardLostReplyDecidedOnce: a node forwards a request to the key's
// owner, the owner decides it, and the forwarder's connection fails before
// the reply comes back. The client may get a 503, but the request is
// spent exactly once: the forwarder must not hand it to the owner again as
// a new request.
//
// Both nodes reach the server through proxies the test controls, so the
// reply is lost every time: the owner receives nothing until the test has
// seen the forwarded request and held back everything sent to the
// forwarder; then the owner decides and replies, the test sees the reply
// pass, and cuts the forwarder's connection with the reply still held.
func TestForwardLostReplyDecidedOnce(t *testing.T) {
	e := server(t, t.TempDir())
	opx := newProxy(t, e.Server().Addr().String())
	fpx := newProxy(t, e.Server().Addr().String())
	owner := proxiedNode(t, opx, mesh.NodeConfig{NodeID: "owner", LeaseTime: time.Hour})
	fwd := proxiedNode(t, fpx, mesh.NodeConfig{NodeID: "fwd", LeaseTime: time.Hour})
	rev := putPolicy(t, owner.nc, "rl_policies", "slow", slowPolicy)
	waitApplied(t, "slow", rev, owner, fwd)
	nodes := []*testNode{owner, fwd}
	waitExclusive(t, nodes)
	tenant := tenantOwnedBy(t, nodes, 0)
	desc := map[string]string{"tenant": tenant}
	p := partitionOf(slowKey(tenant))
	q := -1 // a partition the forwarder serves
	for i, o := range owners(t, nodes) {
		if len(o) == 1 && o[0] == 1 {
			q = i
			break
		}
	}

	// The test sees the forwarded request on the owner's shard subject,
	// with the subject its reply goes to.
	client := connect(t, e)
	forwarded := make(chan string, 1)
	sub, err := client.Subscribe("rl.v1.shard."+strconv.Itoa(p), func(m *nats.Msg) {
		if m.Header.Get(mesh.HopHeader) != "" {
			select {
			case forwarded <- m.Reply:
			default:
			}
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	if err := client.Flush(); err != nil {
		t.Fatal(err)
	}
	opx.Hold() // the owner receives nothing for now
	done := make(chan reply, 1)
	go func() {
		// Sent to the forwarder's shard subject: it forwards to the owner.
		m, err := client.Request("rl.v1.shard."+strconv.Itoa(q), []byte(req(desc, `"cost":10`)), testTimeout)
		if err != nil {
			done <- reply{Code: "no reply: " + err.Error()}
			return
		}
		r, _ := decodeReply(m)
		done <- r
	}()
	var inbox string
	select {
	case inbox = <-forwarded:
	case <-time.After(testTimeout):
		t.Fatal("the forwarder never forwarded")
	}
	fpx.Hold() // the owner's reply will wait in the proxy
	replied, err := client.SubscribeSync(inbox)
	if err != nil {
		t.Fatal(err)
	}
	defer replied.Unsubscribe()
	if err := client.Flush(); err != nil {
		t.Fatal(err)
	}
	opx.Release()
	if _, err := replied.NextMsg(testTimeout); err != nil {
		t.Fatalf("the owner never replied to the forwarded request: %v", err)
	}
	fpx.Cut() // the reply is lost with the connection
	fpx.Release()
	fpx.Heal()
	r := <-done
	// A dry run's remaining is what a request of cost 1 would leave.
	after := decide(t, owner.nc, "rl.v1.decide", req(desc, `"dry_run":true`))
	credit := after.Remaining
	if after.Allowed {
		credit++
	}
	spent := 40 - int(math.Floor(credit))
	t.Logf("the client got %+v; the key has %v left (%d spent)", r, credit, spent)
	if spent != 10 {
		t.Fatalf("one request of cost 10, decided once by the owner, spent %d units (reply %+v)", spent, r)
	}
}

// proxiedNode starts a node whose connection to the server passes through
// px and reconnects at once when px cuts it.
func proxiedNode(t *testing.T, px *proxy, cfg mesh.NodeConfig) *testNode {
	t.Helper()
	nc, err := nats.Connect("nats://"+px.Addr(), nats.MaxReconnects(-1), nats.ReconnectWait(5*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return runNode(t, nc, cfg)
}

// TestForwardHandOverDecidedOnce: while a partition changes hands, two
// nodes are subscribed to its subject for a moment, the old owner
// answering "not owner". The test holds that moment open: a subscriber of
// its own answers "not owner" at once on the owner's shard subject, as
// the old owner would. Each forwarded request must still be decided once:
// with plain subscriptions both got every request, the "not owner" answer
// came first, the forwarder sent the request again, and the owner decided
// it twice (an admission no client saw, spent and billed).
func TestForwardHandOverDecidedOnce(t *testing.T) {
	e := server(t, t.TempDir())
	owner := startNode(t, e, mesh.NodeConfig{NodeID: "owner", LeaseTime: time.Hour})
	fwd := startNode(t, e, mesh.NodeConfig{NodeID: "fwd", LeaseTime: time.Hour})
	rev := putPolicy(t, owner.nc, "rl_policies", "slow", slowPolicy)
	nodes := []*testNode{owner, fwd}
	waitApplied(t, "slow", rev, nodes...)
	waitExclusive(t, nodes)
	tenant := tenantOwnedBy(t, nodes, 0)
	desc := map[string]string{"tenant": tenant}
	p := partitionOf(slowKey(tenant))
	q := -1 // a partition the forwarder serves
	for i, o := range owners(t, nodes) {
		if len(o) == 1 && o[0] == 1 {
			q = i
			break
		}
	}
	if q < 0 {
		t.Fatal("the forwarder serves no partition")
	}

	client := connect(t, e)
	var stale atomic.Int64
	sub, err := client.QueueSubscribe("rl.v1.shard."+strconv.Itoa(p), mesh.PartitionQueue, func(m *nats.Msg) {
		stale.Add(1)
		resp := nats.NewMsg(m.Reply)
		resp.Header.Set(mesh.NotOwnerHeader, strconv.Itoa(p))
		resp.Header.Set("Nats-Service-Error-Code", "503")
		resp.Header.Set("Nats-Service-Error", "not the owner")
		_ = m.RespondMsg(resp)
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	if err := client.Flush(); err != nil {
		t.Fatal(err)
	}
	const n = 30
	admitted := 0
	for i := range n {
		var m *nats.Msg
		var err error
		// "no responders": the forwarder's subscription of q has not
		// reached the server yet (nobody got the request).
		waitFor(t, "the forwarder's subscription", func() bool {
			m, err = client.Request("rl.v1.shard."+strconv.Itoa(q), []byte(req(desc, "")), testTimeout)
			return !errors.Is(err, nats.ErrNoResponders)
		})
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		r, err := decodeReply(m)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		if !r.Allowed {
			t.Fatalf("request %d: %+v, want an admission (burst 40)", i, r)
		}
		admitted++
	}
	after := decide(t, owner.nc, "rl.v1.decide", req(desc, `"dry_run":true`))
	credit := after.Remaining
	if after.Allowed {
		credit++
	}
	spent := 40 - int(math.Floor(credit))
	t.Logf("%d admitted, %d spent; the stale subscriber answered %d forwarded requests", admitted, spent, stale.Load())
	if stale.Load() == 0 {
		t.Fatal("the stale subscriber got no request: the test shows nothing")
	}
	if spent != admitted {
		t.Fatalf("DOUBLE SPEND: %d admissions spent %d units", admitted, spent)
	}
}
