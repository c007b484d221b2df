package integration

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/usage"
)

// Helpers of the usage fault tests: what the stream holds (deduplicated by
// record id), what the ledger holds, and waiting until the two agree.

// usageSums is what a set of records adds up to: counts and micro-units,
// allowed and denied.
type usageSums struct {
	allowed, allowedU, denied, deniedU int64
}

func (s usageSums) String() string {
	return fmt.Sprintf("allowed %d (%s units), denied %d (%s units)",
		s.allowed, usage.FormatMicro(s.allowedU), s.denied, usage.FormatMicro(s.deniedU))
}

func (s *usageSums) add(o usageSums) {
	s.allowed += o.allowed
	s.allowedU += o.allowedU
	s.denied += o.denied
	s.deniedU += o.deniedU
}

// keyDay names a limit key of a policy in a UTC day.
type keyDay struct{ policy, key, day string }

func (k keyDay) String() string { return k.policy + "/" + k.key + "/" + k.day }

// byKey adds up sums over days, by limit key.
func byKey(m map[keyDay]usageSums) map[string]usageSums {
	out := map[string]usageSums{}
	for k, s := range m {
		v := out[k.key]
		v.add(s)
		out[k.key] = v
	}
	return out
}

// streamRead is what streamUsage read.
type streamRead struct {
	sums    map[keyDay]usageSums // the distinct records, per policy, key and day
	records int                  // every record, published again or not
	// again counts the records published more than once, by the node that
	// published the copy and the origin of the record ("n2 of n1.<boot>").
	again map[string]int
}

// streamUsage reads every record of the usage stream (prefix rl) with an
// ordered consumer, deduplicates them by id (a record published again
// must be the same record) and adds them up per policy, key and day. It
// returns an error, for the caller to poll again, when the stream cannot
// be read now.
func streamUsage(t *testing.T, js jetstream.JetStream) (streamRead, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := js.Stream(ctx, usage.StreamName("rl"))
	if err != nil {
		return streamRead{}, err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return streamRead{}, err
	}
	out := map[keyDay]usageSums{}
	again := map[string]int{}
	if info.State.Msgs == 0 {
		return streamRead{sums: out, again: again}, nil
	}
	last := info.State.LastSeq
	c, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		return streamRead{}, err
	}
	seen := map[string]usage.Record{}
	total := 0
	for done := false; !done; {
		b, err := c.Fetch(1000, jetstream.FetchMaxWait(2*time.Second))
		if err != nil {
			return streamRead{}, err
		}
		n := 0
		for m := range b.Messages() {
			n++
			meta, err := m.Metadata()
			if err != nil {
				return streamRead{}, err
			}
			batch, err := usage.DecodeBatch(m.Data())
			if err != nil {
				t.Fatalf("usage message %d on %s: %v", meta.Sequence.Stream, m.Subject(), err)
			}
			for _, r := range batch.Records {
				total++
				if prev, ok := seen[r.ID]; ok {
					origin, _, _ := usage.ParseJournalID(r.ID)
					again[batch.Node+" of "+origin]++
					if prev.Key != r.Key || prev.Cost != r.Cost || prev.Allowed != r.Allowed || prev.TimeUs != r.TimeUs {
						t.Fatalf("record %s published twice with different content: %+v and %+v", r.ID, prev, r)
					}
					continue
				}
				seen[r.ID] = r
				k := keyDay{batch.Policy, r.Key, usage.Day(r.TimeUs)}
				v := out[k]
				if r.Allowed {
					v.allowed++
					v.allowedU += r.Cost
				} else {
					v.denied++
					v.deniedU += r.Cost
				}
				out[k] = v
			}
			if meta.Sequence.Stream >= last {
				done = true
			}
		}
		if err := b.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) && !errors.Is(err, nats.ErrTimeout) {
			return streamRead{}, err
		}
		if n == 0 && !done {
			return streamRead{}, fmt.Errorf("the usage stream's messages up to %d could not be read", last)
		}
	}
	return streamRead{sums: out, records: total, again: again}, nil
}

// ledgerUsage reads the ledger's day entries of policy (prefix rl) per
// key and day.
func ledgerUsage(js jetstream.JetStream, policy string) (map[keyDay]usageSums, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	kv, err := js.KeyValue(ctx, usage.LedgerBucket("rl"))
	if err != nil {
		return nil, err
	}
	keys, err := kvstate.Keys(ctx, js, kv.Bucket(), usage.TotalsFilter(policy, "", "")) // not kv.ListKeys, which can miss a key being rewritten
	if err != nil {
		return nil, err
	}
	out := map[keyDay]usageSums{}
	for _, k := range keys {
		e, err := kv.Get(ctx, k)
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			continue
		} else if err != nil {
			return nil, err
		}
		tot, err := usage.ParseTotals(e.Value())
		if err != nil {
			return nil, fmt.Errorf("ledger entry %s: %w", k, err)
		}
		if len(tot.Period) != len("2006-01-02") {
			continue // a month entry
		}
		a, ok1 := usage.MicroUnits(&tot.AllowedUnits)
		d, ok2 := usage.MicroUnits(&tot.DeniedUnits)
		if !ok1 || !ok2 {
			return nil, fmt.Errorf("ledger entry %s: units are not whole micro-units", k)
		}
		out[keyDay{tot.Policy, tot.Key, tot.Period}] = usageSums{tot.Allowed, a, tot.Denied, d}
	}
	return out, nil
}

// diffSums describes where two sets of sums differ ("" when they are equal).
func diffSums(got, want map[keyDay]usageSums) string {
	var lines []string
	for k, w := range want {
		if g := got[k]; g != w {
			lines = append(lines, fmt.Sprintf("%s: ledger %v, stream %v", k, g, w))
		}
	}
	for k, g := range got {
		if _, ok := want[k]; !ok {
			lines = append(lines, fmt.Sprintf("%s: ledger %v, not in the stream", k, g))
		}
	}
	sort.Strings(lines)
	return strings.Join(lines, "\n")
}

// ledgerCaughtUp is the state the usage fault tests wait for: nothing
// waits in a publisher or in the stream, and the ledger's day totals of the
// policies equal the stream's records deduplicated by id.
type ledgerCaughtUp struct {
	ledger map[keyDay]usageSums
	stream streamRead
	why    string
}

// checkCaughtUp reads the state once; why says what is not caught up yet
// ("" when everything is). pending reports the records the nodes still
// hold.
func checkCaughtUp(t *testing.T, js jetstream.JetStream, pending func() (int64, error), policies ...string) ledgerCaughtUp {
	t.Helper()
	var st ledgerCaughtUp
	held, err := pending()
	switch {
	case err != nil:
		st.why = "pending records: " + err.Error()
		return st
	case held > 0:
		st.why = fmt.Sprintf("%d records not yet published", held)
		return st
	}
	lctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	lag, err := usage.MeasureLag(lctx, js, "rl", time.Now())
	cancel()
	switch {
	case err != nil:
		st.why = "lag: " + err.Error()
		return st
	case lag.Pending > 0:
		st.why = fmt.Sprintf("%d batches not yet in the ledger (oldest record %v old)", lag.Pending, lag.Oldest.Round(time.Millisecond))
		return st
	}
	st.stream, err = streamUsage(t, js)
	if err != nil {
		st.why = "stream: " + err.Error()
		return st
	}
	st.ledger = map[keyDay]usageSums{}
	for _, p := range policies {
		l, err := ledgerUsage(js, p)
		if err != nil {
			st.why = "ledger: " + err.Error()
			return st
		}
		for k, v := range l {
			st.ledger[k] = v
		}
	}
	if d := diffSums(st.ledger, st.stream.sums); d != "" {
		st.why = "the ledger differs from the stream:\n" + d
	}
	return st
}

// waitCaughtUp polls checkCaughtUp (and extra, when not nil: more the
// caller waits for) until both hold, bounded by within, and returns the
// last state; it fails the test with the reason when the bound passes.
func waitCaughtUp(t *testing.T, within time.Duration, js jetstream.JetStream, pending func() (int64, error),
	extra func(ledgerCaughtUp) string, policies ...string) ledgerCaughtUp {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		st := checkCaughtUp(t, js, pending, policies...)
		if st.why == "" && extra != nil {
			st.why = extra(st)
		}
		if st.why == "" {
			return st
		}
		if time.Now().After(deadline) {
			t.Fatalf("the ledger did not catch up within %v: %s", within, st.why)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// procMetricErr is procMetricValue for a series that may be absent (0),
// for polls that retry an unreadable page.
func procMetricErr(p *proc, series string) (float64, error) {
	v, _, err := procMetricValue(p, series)
	return v, err
}

// procsPending is the records the processes' publishers hold, summed.
func procsPending(procs ...*proc) func() (int64, error) {
	return func() (int64, error) {
		var sum int64
		for _, p := range procs {
			v, err := procMetricErr(p, "limitmesh_usage_pending_records")
			if err != nil {
				return 0, fmt.Errorf("%s: %w", p.name, err)
			}
			sum += int64(v)
		}
		return sum, nil
	}
}

// regValue sums the samples of metric name in reg whose labels include
// labels.
func regValue(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metric:
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if want, ok := labels[lp.GetName()]; ok && want != lp.GetValue() {
					continue metric
				}
			}
			switch {
			case m.Counter != nil:
				sum += m.Counter.GetValue()
			case m.Gauge != nil:
				sum += m.Gauge.GetValue()
			}
		}
	}
	return sum
}

// startLoadBody is startLoad with a request body of its own (a cost, say).
func startLoadBody(t *testing.T, conns []*nats.Conn, body string) *load {
	t.Helper()
	l := &load{stopc: make(chan struct{}), lastOK: time.Now()}
	l.gapFrom = l.lastOK
	for _, nc := range conns {
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			for {
				select {
				case <-l.stopc:
					return
				default:
				}
				m, err := nc.Request("rl.v1.decide", []byte(body), faultRequestTimeout)
				l.record(m, err)
				if err != nil {
					time.Sleep(10 * time.Millisecond)
				}
			}
		}()
	}
	t.Cleanup(l.stop)
	return l
}

// ledgerLeader is the node id in the reconciler's lease entry (""
// when there is none or it cannot be read).
func ledgerLeader(js jetstream.JetStream) string {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	kv, err := js.KeyValue(ctx, usage.LedgerBucket("rl"))
	if err != nil {
		return ""
	}
	e, err := kv.Get(ctx, usage.LedgerLeaderKey)
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
