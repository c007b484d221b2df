package integration

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh"
	"github.com/limitmesh/limitmesh/policies"
	"github.com/limitmesh/limitmesh/shadow"
	"github.com/limitmesh/limitmesh/usage"
)

// liveIsolationPolicies are the live policies of TestShadowCandidatesLeaveLiveAlone,
// put in this order in both runs (so their revisions are the same).
var liveIsolationPolicies = [][2]string{
	{"acme-search", `{"match": {"tenant": "acme", "operation": "search"}, "key": ["tenant", "user"],
		"limits": [{"algorithm": "token_bucket", "rate": "10/s", "burst": 30}]}`},
	{"writes", `{"match": {"operation": "write"}, "key": ["tenant"],
		"limits": [{"algorithm": "fixed_window", "limit": 120, "window": "1h"}]}`},
	{"tenants", `{"match": {"tenant": "*"}, "key": ["tenant", "plan"],
		"limits": [{"algorithm": "sliding_window", "limit": 60, "window": "1m"}]}`},
	{"cedar-search", `{"match": {"tenant": "cedar", "operation": "search"}, "key": ["tenant"],
		"limits": [{"name": "day", "algorithm": "quota", "limit": 50, "period": "day"},
		           {"name": "rate", "algorithm": "gcra", "rate": "100/s", "burst": 20}]}`},
}

// isolationCandidates are ten candidates over the same traffic: every
// algorithm, keys finer and coarser than the live ones, one that skips the
// records lacking its key dimension, and "regions", on descriptors no live
// policy matches.
var isolationCandidates = [][2]string{
	{"per-user", `{"match": {"tenant": "*"}, "key": ["tenant", "user"], "limits": [{"algorithm": "token_bucket", "rate": "5/s", "burst": 20}], "shadow": true}`},
	{"per-tenant", `{"match": {"tenant": "*"}, "key": ["tenant"], "limits": [{"algorithm": "gcra", "rate": "20/s", "burst": 150}], "shadow": true}`},
	{"search-window", `{"match": {"operation": "search"}, "key": ["tenant", "plan"], "limits": [{"algorithm": "fixed_window", "limit": 12, "window": "1m"}], "shadow": true}`},
	{"write-users", `{"match": {"operation": "write"}, "key": ["tenant", "user"], "limits": [{"algorithm": "sliding_window", "limit": 4, "window": "1s"}], "shadow": true}`},
	{"acme-log", `{"match": {"tenant": "acme"}, "key": ["user"], "limits": [{"algorithm": "sliding_log", "limit": 3, "window": "10s"}], "shadow": true}`},
	{"two-limits", `{"match": {"user": "*"}, "key": ["user"], "limits": [{"algorithm": "token_bucket", "rate": "2/s", "burst": 40}, {"name": "day", "algorithm": "fixed_window", "limit": 1000, "window": "24h"}], "shadow": true}`},
	{"by-operation", `{"match": {}, "key": ["operation"], "limits": [{"algorithm": "token_bucket", "rate": "1/s", "burst": 150}], "shadow": true}`},
	{"pro-quota", `{"match": {"plan": "pro"}, "key": ["tenant"], "limits": [{"algorithm": "quota", "limit": 20, "period": "day"}], "shadow": true}`},
	{"free-tenants", `{"match": {"tenant": "*", "plan": "free"}, "key": ["tenant"], "limits": [{"algorithm": "token_bucket", "rate": "1/h", "burst": 10}], "shadow": true}`},
	{"regions", `{"match": {"region": "*"}, "key": ["region", "user"], "limits": [{"algorithm": "token_bucket", "rate": "1/s", "burst": 3}], "shadow": true}`},
}

// isolationRequest is one request of the traffic.
type isolationRequest struct {
	desc map[string]string
	cost string
}

// isolationTraffic is a fixed sequence of n requests with explicit costs:
// three tenants' searches and writes (each matched by a live policy) and,
// one in six, descriptors with a region and no tenant, which no live
// policy matches.
func isolationTraffic(n int) []isolationRequest {
	costs := []string{"1", "2", "0.5", "3", "1.25", "1"}
	tenants := []string{"acme", "birch", "cedar"}
	out := make([]isolationRequest, n)
	for i := range out {
		d := map[string]string{"user": fmt.Sprintf("u%d", (i*7)%10)}
		if i%6 == 5 {
			d["region"] = []string{"eu", "us"}[(i/6)%2]
		} else {
			d["tenant"] = tenants[(i/2)%3]
			d["operation"] = []string{"search", "write"}[(i/3)%2]
			d["plan"] = []string{"free", "pro"}[(i/5)%2]
		}
		out[i] = isolationRequest{desc: d, cost: costs[i%len(costs)]}
	}
	return out
}

// isolationRun is what one run of the traffic left: the raw replies, the
// usage records by subject, the live state records by limit key and the
// node's decision metrics.
type isolationRun struct {
	replies [][]byte
	records map[string][]usage.Record // by subject, in stream order
	stream  []usage.Record            // every record, in stream order
	states  map[string][]byte
	metrics []string
	nc      *nats.Conn
	js      jetstream.JetStream
}

// runIsolation starts a fresh server and node whose clock stands still at
// frozen, puts the live policies (and the candidates when cands), sends
// the traffic one request at a time and collects what it left.
func runIsolation(t *testing.T, frozen time.Time, cands [][2]string, traffic []isolationRequest) *isolationRun {
	t.Helper()
	e := server(t, t.TempDir())
	tn := startNode(t, e, mesh.NodeConfig{Clock: func() time.Time { return frozen }, UsageInterval: 50 * time.Millisecond})
	for _, p := range liveIsolationPolicies {
		putPolicy(t, tn.nc, "rl_policies", p[0], p[1])
	}
	for _, p := range cands {
		putPolicy(t, tn.nc, "rl_policies", p[0], p[1])
	}
	// The node applies the bucket's entries in order: once it has the
	// last one, it has seen every candidate.
	rev := putPolicy(t, tn.nc, "rl_policies", "zz-marker", `{"match": {"marker": "x"}, "limits": [{"algorithm": "fixed_window", "limit": 1, "window": "1s"}]}`)
	waitApplied(t, "zz-marker", rev, tn)

	run := &isolationRun{nc: tn.nc, states: map[string][]byte{}}
	run.js, _ = jetstream.New(tn.nc)
	for i, r := range traffic {
		b, _ := json.Marshal(map[string]any{"descriptor": r.desc, "cost": r.cost})
		m, err := tn.nc.Request("rl.v1.decide", b, testTimeout)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		if code := m.Header.Get("Nats-Service-Error-Code"); code != "" {
			t.Fatalf("request %d %s: error %s %s", i, b, code, m.Data)
		}
		run.replies = append(run.replies, m.Data)
	}

	// Every record in the stream (one per request: no dry runs, no retries).
	waitWithin(t, 30*time.Second, "a usage record of every decision", func() bool {
		run.records, run.stream = streamRecords(t, run.js)
		return len(run.stream) == len(traffic)
	})
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	for _, r := range run.stream {
		if r.Key == "" || run.states[r.Key] != nil {
			continue
		}
		b, err := mesh.ReadStateRecord(ctx, run.js, "rl", r.Key)
		if err != nil {
			t.Fatalf("state of %s: %v", r.Key, err)
		}
		run.states[r.Key] = b
	}
	run.metrics = metric(t, tn, "limitmesh_decisions_total")
	return run
}

// streamRecords reads every record of the usage stream, in stream order
// and by subject.
func streamRecords(t *testing.T, js jetstream.JetStream) (map[string][]usage.Record, []usage.Record) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	s, err := js.Stream(ctx, usage.StreamName("rl"))
	if err != nil {
		t.Fatal(err)
	}
	bySubject := map[string][]usage.Record{}
	var all []usage.Record
	for seq := uint64(1); ; {
		m, err := s.GetMsg(ctx, seq, jetstream.WithGetMsgSubject(usage.Subjects("rl")))
		if err != nil {
			return bySubject, all
		}
		seq = m.Sequence + 1
		b, err := usage.DecodeBatch(m.Data)
		if err != nil {
			t.Fatalf("usage message %d: %v", m.Sequence, err)
		}
		bySubject[m.Subject] = append(bySubject[m.Subject], b.Records...)
		all = append(all, b.Records...)
	}
}

// TestShadowCandidatesLeaveLiveAlone: the same traffic (a fixed sequence of
// decisions with explicit costs on several keys, the node's clock standing
// still so that every reply is a function of the requests alone) against
// two fresh nodes, one without candidates and one with ten: byte for byte
// the same replies, the same live state records, the same usage records
// (but their ids) and the same decision metrics; no candidate has live
// state. The ten candidates' summaries then agree with a replay of the
// stream computed here, independently of the shadow package: among them
// "regions", evaluated from records no live policy matched.
func TestShadowCandidatesLeaveLiveAlone(t *testing.T) {
	if testing.Short() {
		t.Skip("two nodes and 1,200 decisions")
	}
	frozen := time.Now()
	traffic := isolationTraffic(600)
	plain := runIsolation(t, frozen, nil, traffic)
	with := runIsolation(t, frozen, isolationCandidates, traffic)

	denied := 0
	for i := range traffic {
		if string(plain.replies[i]) != string(with.replies[i]) {
			t.Fatalf("request %d %v: reply %s without candidates, %s with", i, traffic[i], plain.replies[i], with.replies[i])
		}
		var r reply
		json.Unmarshal(plain.replies[i], &r)
		if !r.Allowed {
			denied++
		}
		for _, c := range isolationCandidates {
			if r.Policy == c[0] {
				t.Fatalf("request %d decided by candidate %s: %s", i, c[0], plain.replies[i])
			}
		}
	}
	if denied == 0 || denied == len(traffic) {
		t.Fatalf("%d of %d requests denied: the traffic should see both", denied, len(traffic))
	}
	if !reflect.DeepEqual(plain.states, with.states) {
		for k, v := range plain.states {
			if string(with.states[k]) != string(v) {
				t.Errorf("state of %s: %x without candidates, %x with", k, v, with.states[k])
			}
		}
		t.Fatalf("live state differs (%d keys without candidates, %d with)", len(plain.states), len(with.states))
	}
	t.Logf("%d requests, %d denied live; %d live keys", len(traffic), denied, len(plain.states))
	if len(plain.states) < 8 {
		t.Fatalf("only %d live keys", len(plain.states))
	}
	if !slices.Equal(plain.metrics, with.metrics) {
		t.Errorf("decision metrics without candidates:\n%s\nwith:\n%s", strings.Join(plain.metrics, "\n"), strings.Join(with.metrics, "\n"))
	}
	for subj, recs := range plain.records {
		other := with.records[subj]
		if len(other) != len(recs) {
			t.Fatalf("%s: %d records without candidates, %d with", subj, len(recs), len(other))
		}
		for i := range recs {
			a, b := recs[i], other[i]
			a.ID, b.ID = "", ""
			if !reflect.DeepEqual(a, b) {
				t.Fatalf("%s record %d: %+v without candidates, %+v with", subj, i, a, b)
			}
		}
	}

	// No candidate has live state: its keys are nowhere in the state
	// bucket or the journals.
	cands := make([]*policies.Policy, len(isolationCandidates))
	candKeys := map[string]bool{}
	for i, c := range isolationCandidates {
		p, err := policies.Parse(c[0], []byte(c[1]))
		if err != nil {
			t.Fatal(err)
		}
		cands[i] = p
		for _, r := range with.stream {
			if key, err := p.LimitKey(r.Descriptor); err == nil {
				candKeys[key] = true
			}
		}
	}
	t.Logf("%d candidate keys", len(candKeys))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for key := range candKeys {
		if _, err := mesh.ReadStateRecord(ctx, with.js, "rl", key); !errors.Is(err, kvstate.ErrNotFound) {
			t.Fatalf("candidate key %s: live state read: %v, want none", key, err)
		}
	}

	// The summaries, once every record is evaluated, equal the replay.
	want := independentReplay(cands, with.stream)
	if w := want["regions"]; w.Evaluated == 0 || w.WouldDeny == 0 {
		t.Fatalf("regions should evaluate and deny unmatched records: %+v", w)
	}
	for _, r := range with.stream {
		if _, ok := r.Descriptor.Get("region"); ok && r.Key != "" {
			t.Fatalf("a region record was matched live: %+v", r)
		}
	}
	if want["by-operation"].Skipped == 0 {
		t.Fatal("by-operation should skip the records without an operation")
	}
	kv, err := with.js.KeyValue(ctx, shadow.Bucket("rl"))
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]shadow.Summary{}
	waitWithin(t, 60*time.Second, "the summaries to count every record", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
		defer cancel()
		for _, p := range cands {
			e, err := kv.Get(ctx, p.Name)
			if err != nil {
				return false
			}
			var s shadow.Summary
			if json.Unmarshal(e.Value(), &s) != nil {
				return false
			}
			got[p.Name] = s
			if s.Evaluated+s.Skipped != want[p.Name].Evaluated+want[p.Name].Skipped {
				return false
			}
		}
		return true
	})
	for _, p := range cands {
		g, w := got[p.Name], want[p.Name]
		t.Logf("%-14s evaluated %3d skipped %3d would deny %3d (live denied %3d, both %3d) keys %2d",
			p.Name, g.Evaluated, g.Skipped, g.WouldDeny, g.LiveDenied, g.BothDenied, g.Keys)
		w.Revision = g.Revision // the bucket's
		g.Series, g.UpdatedUs = nil, 0
		if !reflect.DeepEqual(g, w) {
			t.Errorf("%s:\nsummary %+v\nreplay  %+v", p.Name, g, w)
		}
	}
}

// independentReplay evaluates every candidate over recs (stream order)
// the plain way: a map of states per limit key, kvstate.DecideAll at each
// record's time, and counting as CONTRACT.md §7 says.
func independentReplay(cands []*policies.Policy, recs []usage.Record) map[string]shadow.Summary {
	out := map[string]shadow.Summary{}
	for _, p := range cands {
		s := shadow.Summary{Policy: p.Name, TopDenied: []shadow.TopKey{}}
		limits := make([]kvstate.Limit, len(p.Limits))
		for i, l := range p.Limits {
			limits[i] = l.Limit
		}
		states := map[string][]kvstate.State{}
		deniedBy := map[string]uint64{}
	records:
		for _, r := range recs {
			for _, m := range p.Match {
				v, ok := r.Descriptor.Get(m.Name)
				if !ok || m.Value != "*" && v != m.Value {
					continue records
				}
			}
			key, err := p.LimitKey(r.Descriptor)
			if err != nil {
				s.Skipped++
				continue
			}
			st := states[key]
			d, next := kvstate.DecideAll(limits, st, r.TimeUs*1000, r.Cost, nil)
			if d.Allowed {
				st = next
			}
			states[key] = st
			if s.Evaluated == 0 {
				s.SinceUs = r.TimeUs
			}
			s.Evaluated++
			s.LastUs = r.TimeUs
			if !r.Allowed {
				s.LiveDenied++
			}
			switch {
			case d.Allowed && r.Allowed:
				s.WouldAllow++
			case d.Allowed:
				s.WouldAllow++
				s.OnlyLiveDenied++
			case r.Allowed:
				s.WouldDeny++
				s.OnlyCandidateDenied++
			default:
				s.WouldDeny++
				s.BothDenied++
			}
			if !d.Allowed {
				s.WouldDenyUnits += shadow.Units(r.Cost)
				deniedBy[key]++
			}
		}
		for k, n := range deniedBy {
			s.TopDenied = append(s.TopDenied, shadow.TopKey{Key: k, WouldDeny: n})
		}
		slices.SortFunc(s.TopDenied, func(a, b shadow.TopKey) int {
			return cmp.Or(cmp.Compare(b.WouldDeny, a.WouldDeny), strings.Compare(a.Key, b.Key))
		})
		s.TopDenied = s.TopDenied[:min(len(s.TopDenied), shadow.TopN)]
		s.Keys = len(states)
		out[p.Name] = s
	}
	return out
}
