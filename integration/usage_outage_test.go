package integration

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/limitmesh/limitmesh/mesh"
	"github.com/limitmesh/limitmesh/usage"
)

// edgePolicy is a local policy (no state in JetStream) no test exhausts,
// on a dimension billedPolicy does not match.
const edgePolicy = `{"match": {"site": "*"}, "key": ["site"], "mode": "local",
 "limits": [{"name": "rate", "algorithm": "token_bucket", "rate": "1/h", "burst": 1000000}]}`

// TestUsageStreamUnreachable: the usage stream has one replica, on one of
// three servers (routes through TCP proxies); the node is connected to
// another. That server is cut off from the others until the node has
// retried its usage publishes for seconds: meanwhile decisions go on
// (local ones, and strict ones once the state's streams have leaders on the
// other two servers), their records held by the publisher; after the heal
// the records arrive, and every decision clients saw is in the stream and
// the ledger, or counted as dropped (overflow) by the publisher.
func TestUsageStreamUnreachable(t *testing.T) {
	if testing.Short() {
		t.Skip("cluster test")
	}
	pc := startProxiedCluster(t, 3)
	for k := range pc.servers {
		waitFor(t, "full mesh", func() bool { return pc.peersConnected(k) })
	}
	admin := connectURLs(t, pc.URL(0), pc.URL(1), pc.URL(2))
	js, _ := jetstream.New(admin)
	var x int
	retryJS(t, "a usage stream of one replica", func(ctx context.Context) error {
		s, err := usage.EnsureStream(ctx, js, usage.StreamConfig{Replicas: 1, Retention: time.Hour})
		if err != nil {
			return err
		}
		info, err := s.Info(ctx)
		if err != nil {
			return err
		}
		if info.Cluster == nil || len(info.Cluster.Leader) < 2 {
			return fmt.Errorf("no leader yet: %+v", info.Cluster)
		}
		x, err = strconv.Atoi(info.Cluster.Leader[1:]) // servers are p0, p1, p2
		return err
	})
	a := (x + 1) % 3
	t.Logf("RL_USAGE lives on p%d; the node is connected to p%d", x, a)
	reg := prometheus.NewRegistry()
	tn := startNodeRetry(t, mesh.NodeConfig{Replicas: 3, UsageInterval: 100 * time.Millisecond, Registry: reg}, pc.URL(a))
	metric := func(name string, labels map[string]string) float64 { return regValue(t, reg, name, labels) }
	pending := func() (int64, error) { return int64(metric("limitmesh_usage_pending_records", nil)), nil }

	rev := putPolicy(t, admin, "rl_policies", "billed", billedPolicy)
	rev2 := putPolicy(t, admin, "rl_policies", "edge", edgePolicy)
	waitApplied(t, "billed", rev, tn)
	waitApplied(t, "edge", rev2, tn)
	conns := []*nats.Conn{connectURLs(t, pc.URL(a)), connectURLs(t, pc.URL(a))}
	strict := startLoadBody(t, conns, req(map[string]string{"tenant": "u1"}, `"cost":"0.5"`))
	local := startLoadBody(t, conns, req(map[string]string{"site": "s1"}, `"cost":"0.25"`))
	localDenied := startLoadBody(t, conns[:1], req(map[string]string{"site": "s2"}, `"cost":2000000`))
	loads := []*load{strict, local, localDenied}
	for _, l := range loads {
		l.waitAnswered(t, loadStats{}, 100, 3*testTimeout, "before the cut")
	}
	waitFor(t, "records in the stream", func() bool {
		st, err := streamUsage(t, js)
		return err == nil && len(st.sums) > 0
	})

	retries0 := metric("limitmesh_usage_publish_retries_total", nil)
	pc.Isolate(t, x)
	cutAt := time.Now()
	snap := map[*load]loadStats{}
	for _, l := range loads {
		snap[l] = l.stats()
	}
	// Cut off for as long as the publisher takes to fail and retry 30
	// times over its three subjects (each subject's sender backs off from
	// 20 ms, doubling to 1 s: about 10 retries each take 5 s), with records
	// held.
	var held float64
	waitWithin(t, 2*time.Minute, "usage publishes failing and retried", func() bool {
		held = max(held, metric("limitmesh_usage_pending_records", nil))
		return metric("limitmesh_usage_publish_retries_total", nil) >= retries0+30 && held > 0
	})
	// Decisions are answered meanwhile: local ones at once, strict ones
	// once the state's streams have leaders on the two connected servers.
	local.waitAnswered(t, snap[local], 200, 3*testTimeout, "local decisions while the usage stream is cut off")
	localDenied.waitDecisions(t, snap[localDenied], 100, 3*testTimeout, "local denials while the usage stream is cut off")
	strict.waitAnswered(t, snap[strict], 100, 6*testTimeout, "strict decisions while the usage stream is cut off")
	held = max(held, metric("limitmesh_usage_pending_records", nil))
	t.Logf("cut off for %v: %d local, %d strict decisions answered meanwhile; up to %v records held; %v publish retries",
		time.Since(cutAt).Round(time.Millisecond), local.stats().ok()-snap[local].ok(), strict.stats().ok()-snap[strict].ok(),
		held, metric("limitmesh_usage_publish_retries_total", nil)-retries0)

	pc.Heal(t, x)
	snap = map[*load]loadStats{}
	for _, l := range loads {
		snap[l] = l.stats()
	}
	for _, l := range loads {
		l.waitAnswered(t, snap[l], 50, 6*testTimeout, "after the heal")
	}
	for _, l := range loads {
		l.stop()
	}
	overflow := func() int64 {
		return int64(metric("limitmesh_usage_dropped_total", map[string]string{"reason": "overflow"}))
	}
	// Every decision is in the stream (or dropped and counted), once in
	// the ledger.
	enough := func(st ledgerCaughtUp) string {
		got := byKey(st.stream.sums)
		if g, s := got[billedKey("u1")].allowed, strict.stats().admitted; g+overflow() < int64(s) {
			return fmt.Sprintf("strict: %d records, %d dropped, clients saw %d admitted", g, overflow(), s)
		}
		if g, s := got["p.edge.site=s1"].allowed, local.stats().admitted; g+overflow() < int64(s) {
			return fmt.Sprintf("local: %d records, %d dropped, clients saw %d admitted", g, overflow(), s)
		}
		if g, s := got["p.edge.site=s2"].denied, localDenied.stats().denied; g+overflow() < int64(s) {
			return fmt.Sprintf("local denials: %d records, %d dropped, clients saw %d denied", g, overflow(), s)
		}
		return ""
	}
	st := waitCaughtUp(t, 3*time.Minute, js, pending, enough, "billed", "edge")
	got := byKey(st.stream.sums)
	drop := overflow()
	t.Logf("records: %d in the stream (published again: %v); dropped: overflow %d, failed %v", st.stream.records, st.stream.again, drop,
		metric("limitmesh_usage_dropped_total", map[string]string{"reason": "failed"}))
	for _, c := range []struct {
		name     string
		l        *load
		recorded int64
		saw      int
		unit     int64
		units    int64
	}{
		{"strict", strict, got[billedKey("u1")].allowed, strict.stats().admitted, 500_000, got[billedKey("u1")].allowedU},
		{"local", local, got["p.edge.site=s1"].allowed, local.stats().admitted, 250_000, got["p.edge.site=s1"].allowedU},
		{"local denials", localDenied, got["p.edge.site=s2"].denied, localDenied.stats().denied, 2_000_000_000_000, got["p.edge.site=s2"].deniedU},
	} {
		s := c.l.stats()
		t.Logf("%s: clients %v; records %d", c.name, s, c.recorded)
		if c.recorded > int64(c.saw+s.failed()) {
			t.Errorf("%s: %d records, clients saw %d decisions and %d requests without one", c.name, c.recorded, c.saw, s.failed())
		}
		if c.units != c.recorded*c.unit {
			t.Errorf("%s: %s units in %d records", c.name, usage.FormatMicro(c.units), c.recorded)
		}
	}
	if f := metric("limitmesh_usage_dropped_total", map[string]string{"reason": "failed"}); f != 0 {
		t.Errorf("%v records abandoned by the publisher", f)
	}
}
