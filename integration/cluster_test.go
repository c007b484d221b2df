package integration

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/mesh"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// freePorts picks n loopback ports nobody listens on now. They are closed
// again before use, so they come from below the kernel's ephemeral range
// (32768 and up on Linux): an outgoing connection of this or another test
// process, which takes an ephemeral port, can then never grab one between
// the pick and the bind. Nor can another copy of this test binary (two
// suites at once): each process picks from a range of its own (portRange).
//
// A port is not handed out again for portReuseAfter: a test often picks
// several sets of ports (routes, then gateways) before it binds any, and
// the probe cannot see a port picked but not yet bound.
func freePorts(t *testing.T, n int) []int {
	t.Helper()
	lo, size := portRange()
	handedMu.Lock()
	defer handedMu.Unlock()
	now := time.Now()
	ports := make([]int, 0, n)
	for tries := 0; len(ports) < n; tries++ {
		if tries > 10000 {
			t.Fatal("no free loopback ports")
		}
		p := lo + rand.IntN(size)
		if at, ok := handed[p]; ok && now.Sub(at) < portReuseAfter {
			continue
		}
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p))
		if err != nil {
			continue
		}
		l.Close()
		handed[p] = now
		ports = append(ports, p)
	}
	return ports
}

const portReuseAfter = 5 * time.Minute

var (
	handedMu sync.Mutex
	handed   = map[int]time.Time{} // port -> when freePorts last handed it out
)

// Port ranges of the test processes: slot k is [20000+k*1500, +1500),
// held by the process that listens on 127.0.0.1:19900+k for its lifetime
// (a listener is a lock the kernel releases when the process dies). A
// supercluster's ports are picked seconds before its last server binds
// them; with one range per process, another process's pick meanwhile
// cannot take one.
const (
	portSlots    = 8
	portSlotSize = 1500
)

var portRange = sync.OnceValues(func() (lo, size int) {
	for k := range portSlots {
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", 19900+k))
		if err != nil {
			continue
		}
		portSlotLock = l // held until the process exits
		return 20000 + k*portSlotSize, portSlotSize
	}
	return 20000, portSlots * portSlotSize // every slot taken: share the whole range
})

var portSlotLock net.Listener

// TestReplicatedCluster: three embedded servers in one JetStream cluster,
// buckets with three replicas, nodes on two different servers: a burst of
// 80 over connections to every server admits exactly the burst of 40
// (each request with a request_id, a 503 retried with it).
func TestReplicatedCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("cluster test")
	}
	servers := embeddedCluster(t, 3)
	n0 := startNodeRetry(t, mesh.NodeConfig{Replicas: 3}, servers[0].ClientURL())
	n1 := startNode(t, servers[1], mesh.NodeConfig{Replicas: 3})
	js, _ := jetstream.New(n0.nc)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	st, err := js.Stream(ctx, "KV_rl_state")
	if err != nil {
		t.Fatal(err)
	}
	if r := st.CachedInfo().Config.Replicas; r != 3 {
		t.Fatalf("state bucket replicas = %d, want 3", r)
	}
	rev := putPolicy(t, n0.nc, "rl_policies", "slow", slowPolicy)
	d := map[string]string{"tenant": "r3"}
	waitApplied(t, "slow", rev, n0, n1)

	conns := []*nats.Conn{n0.nc, n1.nc}
	for i := 0; i < 4; i++ {
		conns = append(conns, connect(t, servers[i%3]))
	}
	replies, failed := burstDecisions(t, conns, d, 80)
	if admitted := admittedOf(replies); admitted != 40 {
		t.Fatalf("R3 cluster admitted %d of 80 (%d attempts retried after a 503 or no reply), want exactly the burst 40",
			admitted, failed)
	}
	t.Logf("retried %d", failed)
}
