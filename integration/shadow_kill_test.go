package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"reflect"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/limitmesh/limitmesh/policies"
	"github.com/limitmesh/limitmesh/shadow"
)

// killCandidates are the candidates of TestShadowKillEvaluatorNode: one on
// the live policy's descriptors with a finer key, one coarser, and one on
// descriptors no live policy matches.
var killCandidates = [][2]string{
	{"per-user", `{"match": {"tenant": "*"}, "key": ["tenant", "user"], "limits": [{"algorithm": "sliding_window", "limit": 5, "window": "1s"}], "shadow": true}`},
	{"per-tenant", `{"match": {"tenant": "*"}, "key": ["tenant"], "limits": [{"algorithm": "token_bucket", "rate": "40/s", "burst": 20}], "shadow": true}`},
	{"regions", `{"match": {"region": "*"}, "key": ["region"], "limits": [{"algorithm": "gcra", "rate": "10/s", "burst": 5}], "shadow": true}`},
}

// shadowLeader returns the node id in the evaluator's lease entry ("" when
// there is none or it cannot be read).
func shadowLeader(js jetstream.JetStream) string {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	kv, err := js.KeyValue(ctx, shadow.Bucket("rl"))
	if err != nil {
		return ""
	}
	e, err := kv.Get(ctx, shadow.LeaderKey)
	if err != nil {
		return ""
	}
	var v struct {
		Node string `json:"node"`
	}
	if json.Unmarshal(e.Value(), &v) != nil {
		return ""
	}
	return v.Node
}

// storedSummaries reads the summaries of names ("" for a missing one).
func storedSummaries(js jetstream.JetStream, names []string) map[string]shadow.Summary {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	out := map[string]shadow.Summary{}
	kv, err := js.KeyValue(ctx, shadow.Bucket("rl"))
	if err != nil {
		return out
	}
	for _, n := range names {
		e, err := kv.Get(ctx, n)
		if err != nil {
			continue
		}
		var s shadow.Summary
		if json.Unmarshal(e.Value(), &s) == nil {
			out[n] = s
		}
	}
	return out
}

// TestShadowKillEvaluatorNode: three serve processes (a JetStream cluster,
// R3), a live policy and three candidates, decide traffic on many keys
// through every process. The process whose node runs the shadow evaluator
// gets SIGKILL mid-stream (its embedded server dies with it); another node
// takes the evaluation over from the last checkpoint while the traffic
// goes on. Once the traffic has stopped and the stream is consumed, every
// candidate's summary equals a backtest of it over the whole stream (one
// uninterrupted evaluation of the same records): nothing lost, nothing
// counted twice.
func TestShadowKillEvaluatorNode(t *testing.T) {
	if testing.Short() {
		t.Skip("kill test with three processes")
	}
	procs := startProcs(t, procSpec{n: 3})
	urls := clientURLs(procs)
	admin := connectURLs(t, urls...)
	js, _ := jetstream.New(admin)
	rev := putPolicy(t, admin, "rl_policies", "tenants",
		`{"match": {"tenant": "*"}, "key": ["tenant", "user"], "limits": [{"algorithm": "token_bucket", "rate": "20/s", "burst": 10}]}`)
	var cands []*policies.Policy
	var names []string
	for _, c := range killCandidates {
		r := putPolicy(t, admin, "rl_policies", c[0], c[1])
		p, err := policies.Parse(c[0], []byte(c[1]))
		if err != nil {
			t.Fatal(err)
		}
		p.Revision = r
		cands, names = append(cands, p), append(names, c[0])
	}
	waitProcsApplied(t, "tenants", rev, procs...)
	// A candidate counts what is evaluated after the evaluator took it
	// up (CONTRACT.md §7): traffic starts once it has all three, so that
	// the backtests of the whole stream below are the uninterrupted
	// evaluation.
	waitWithin(t, 60*time.Second, "the evaluator to take the candidates up", func() bool {
		sums := storedSummaries(js, names)
		for _, p := range cands {
			if sums[p.Name].Revision != p.Revision {
				return false
			}
		}
		return true
	})

	// Traffic: two requests in flight per process, on 5 tenants x 20
	// users and, one in five, on regions (matched by no live policy).
	var sent atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for i := range procs {
		rot := append(slices.Clone(urls[i:]), urls[:i]...)
		for j := range 2 {
			nc := connectURLs(t, rot...)
			wg.Add(1)
			go func() {
				defer wg.Done()
				for n := 0; ; n++ {
					select {
					case <-stop:
						return
					default:
					}
					k := n*7 + j*3 + i*11
					d := map[string]string{"tenant": fmt.Sprintf("t%d", k%5), "user": fmt.Sprintf("u%d", k%20)}
					if n%5 == 4 {
						d = map[string]string{"region": []string{"eu", "us", "ap"}[k%3]}
					}
					b, _ := json.Marshal(map[string]any{"descriptor": d, "cost": 1 + k%3})
					if _, err := nc.Request("rl.v1.decide", b, 2*time.Second); err != nil {
						time.Sleep(10 * time.Millisecond) // its server is gone: reconnecting
						continue
					}
					sent.Add(1)
				}
			}()
		}
	}
	stopTraffic := sync.OnceFunc(func() { close(stop); wg.Wait() })
	t.Cleanup(stopTraffic)

	// The evaluator's node, once it has evaluated and checkpointed some of
	// the traffic.
	var victim *proc
	var victimID string
	waitWithin(t, 60*time.Second, "an evaluator that evaluated and checkpointed traffic", func() bool {
		victimID = shadowLeader(js)
		sums := storedSummaries(js, names)
		if victimID == "" || sums["per-user"].Evaluated < 200 || sums["regions"].Evaluated == 0 {
			return false
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		kv, err := js.KeyValue(ctx, shadow.Bucket("rl"))
		if err != nil {
			return false
		}
		_, err = kv.Get(ctx, shadow.CheckpointKey)
		return err == nil
	})
	for _, p := range procs {
		if p.nodeID(t) == victimID {
			victim = p
		}
	}
	if victim == nil {
		t.Fatalf("the evaluator's node %s is none of the processes", victimID)
	}
	before := sent.Load()
	victim.kill()
	t.Logf("killed %s (node %s, the evaluator's) after %d decisions", victim.name, victimID, before)
	var successor string
	waitWithin(t, 90*time.Second, "another node to take the evaluation over", func() bool {
		successor = shadowLeader(js)
		return successor != "" && successor != victimID
	})
	// Traffic goes on until the successor has evaluated some of it.
	waitWithin(t, 60*time.Second, "more decisions after the takeover", func() bool { return sent.Load() > before+1000 })
	stopTraffic()
	t.Logf("node %s evaluates; %d decisions in all", successor, sent.Load())

	// Records of the killed node's partitions arrive late (their next
	// owner publishes them), and the nodes publish their last batches
	// after the traffic stopped: compare once the summaries, the
	// backtests of the stream as it stands and a replay computed here of
	// the stream read after them all agree (the stream no longer grew
	// meanwhile), or fail with the last difference.
	var diff string
	deadline := time.Now().Add(2 * time.Minute)
	for {
		diff = shadowVsBacktest(js, cands)
		if diff == "" {
			diff = shadowVsReplay(t, js, cands, names)
		}
		if diff == "" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the summaries never equalled one uninterrupted evaluation of the stream: %s", diff)
		}
		time.Sleep(200 * time.Millisecond)
	}
	sums := storedSummaries(js, names)
	for _, n := range names {
		s := sums[n]
		t.Logf("%-10s evaluated %5d would deny %5d live denied %5d", n, s.Evaluated, s.WouldDeny, s.LiveDenied)
	}
}

// shadowVsReplay compares the stored summaries' totals with a replay
// computed here (independentReplay) of the stream as it stands: "" when
// they agree, else the difference.
func shadowVsReplay(t *testing.T, js jetstream.JetStream, cands []*policies.Policy, names []string) string {
	_, stream := streamRecords(t, js)
	want := independentReplay(cands, stream)
	sums := storedSummaries(js, names)
	for _, n := range names {
		s, w := sums[n], want[n]
		if s.Evaluated != w.Evaluated || s.WouldAllow != w.WouldAllow || s.WouldDeny != w.WouldDeny ||
			s.WouldDenyUnits != w.WouldDenyUnits || s.LiveDenied != w.LiveDenied || s.BothDenied != w.BothDenied {
			return fmt.Sprintf("%s: summary %+v\nreplay of the %d records %+v", n, s, len(stream), w)
		}
	}
	return ""
}

// shadowVsBacktest compares every candidate's stored summary with a
// backtest of it over the stream as it stands: "" when they are equal, else
// the difference.
func shadowVsBacktest(js jetstream.JetStream, cands []*policies.Policy) string {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	names := make([]string, len(cands))
	for i, p := range cands {
		names[i] = p.Name
	}
	got := storedSummaries(js, names)
	for _, p := range cands {
		res, err := shadow.Backtest(ctx, js, p, shadow.BacktestConfig{Prefix: "rl"})
		if err != nil {
			return err.Error()
		}
		g, want := got[p.Name], res.Summary
		if g.Revision != p.Revision {
			return fmt.Sprintf("%s: summary of revision %d, want %d", p.Name, g.Revision, p.Revision)
		}
		// since_us of a backtest is the first record replayed, of any policy.
		want.SinceUs, want.Revision = g.SinceUs, g.Revision
		g.UpdatedUs = 0
		if !reflect.DeepEqual(g, want) {
			return fmt.Sprintf("%s:\nsummary  %+v\nbacktest %+v", p.Name, g, want)
		}
	}
	return ""
}
