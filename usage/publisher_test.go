package usage

import (
	"context"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// streamBatches returns every message of the usage stream, decoded, with
// its Nats-Msg-Id.
type storedBatch struct {
	seq   uint64
	subj  string
	msgID string
	b     Batch
}

func readStream(t *testing.T, js jetstream.JetStream, prefix string) []storedBatch {
	t.Helper()
	ctx := testCtx(t)
	s, err := js.Stream(ctx, StreamName(prefix))
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var out []storedBatch
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if err != nil {
			t.Fatalf("seq %d: %v", seq, err)
		}
		b, err := DecodeBatch(m.Data)
		if err != nil {
			t.Fatalf("seq %d: %v", seq, err)
		}
		out = append(out, storedBatch{seq: seq, subj: m.Subject, msgID: m.Header.Get(jetstream.MsgIDHeader), b: b})
	}
	return out
}

func ensureStream(t *testing.T, js jetstream.JetStream) {
	t.Helper()
	if _, err := EnsureStream(testCtx(t), js, StreamConfig{Prefix: "rl"}); err != nil {
		t.Fatal(err)
	}
}

func counterValue(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) float64 {
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
			sum += metricValue(m)
		}
	}
	return sum
}

func metricValue(m *dto.Metric) float64 {
	switch {
	case m.Counter != nil:
		return m.Counter.GetValue()
	case m.Gauge != nil:
		return m.Gauge.GetValue()
	}
	return 0
}

func testRecord(t testing.TB, policy string, i int) Record {
	key := ""
	rev := uint64(0)
	if policy != "" {
		key = "p." + policy + ".tenant=t" + strconv.Itoa(i%7)
		rev = 3
	}
	return Record{
		TimeUs: 1764752400000000 + int64(i), Revision: rev, Key: key,
		Descriptor: desc(t, "tenant", "t"+strconv.Itoa(i%7), "op", "search"),
		Cost:       int64(i%5+1) * 500_000, Allowed: i%3 != 0,
	}
}

// Records reach the stream once each, in Add order per subject, with the
// ids they were given or their message's (<Nats-Msg-Id>.<index>), and
// unique Nats-Msg-Ids.
func TestPublisherOrderAndIDs(t *testing.T) {
	ts := startServer(t)
	_, js := connect(t, ts)
	ensureStream(t, js)
	reg := prometheus.NewRegistry()
	p, err := NewPublisher(js, PublisherConfig{Node: "n1", Boot: "b0", Interval: 10 * time.Millisecond, MaxBatch: 100, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	policies := []string{"acme", "birch", ""}
	want := map[string][]Record{}
	for i := 0; i < 3000; i++ {
		pol := policies[i%3]
		r := testRecord(t, pol, i)
		if pol == "birch" {
			r.ID = p.JournalID(uint64(100+i/10), uint32(i%10))
		}
		if !p.Add(pol, r) {
			t.Fatal("Add refused")
		}
		want[pol] = append(want[pol], r)
	}
	if err := p.Sync(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	got := map[string][]Record{}
	msgIDs := map[string]bool{}
	for _, sb := range readStream(t, js, "rl") {
		if msgIDs[sb.msgID] || sb.msgID == "" {
			t.Fatalf("Nats-Msg-Id %q missing or repeated", sb.msgID)
		}
		msgIDs[sb.msgID] = true
		if sb.subj != Subject("rl", sb.b.Policy) || sb.b.Node != "n1" {
			t.Fatalf("message on %s: %+v", sb.subj, sb.b)
		}
		if len(sb.b.Records) > 100 {
			t.Fatalf("%d records in one message", len(sb.b.Records))
		}
		for i, r := range sb.b.Records {
			w := want[sb.b.Policy][len(got[sb.b.Policy])]
			if w.ID == "" {
				w.ID = sb.msgID + "." + strconv.Itoa(i)
			}
			if !reflect.DeepEqual(r, w) {
				t.Fatalf("policy %q record %d: got %+v, want %+v", sb.b.Policy, len(got[sb.b.Policy]), r, w)
			}
			got[sb.b.Policy] = append(got[sb.b.Policy], r)
		}
	}
	for _, pol := range policies {
		if len(got[pol]) != len(want[pol]) {
			t.Fatalf("policy %q: got %d records, want %d", pol, len(got[pol]), len(want[pol]))
		}
	}
	if v := counterValue(t, reg, "limitmesh_usage_records_total", map[string]string{"policy": "acme", "result": "denied"}); v != 1000 {
		t.Fatalf("records_total{acme,denied} = %v, want 1000", v)
	}
	if v := counterValue(t, reg, "limitmesh_usage_records_total", nil); v != 3000 {
		t.Fatalf("records_total = %v", v)
	}
	if err := p.Close(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if p.Add("acme", testRecord(t, "acme", 1)) {
		t.Fatal("Add after Close accepted")
	}
}

// JetStream unreachable for seconds (the server restarted on the same
// port and store): Add keeps returning at once, and every record reaches
// the stream exactly once afterwards.
func TestPublisherOutage(t *testing.T) {
	ts := startServer(t)
	_, js := connect(t, ts)
	ensureStream(t, js)
	reg := prometheus.NewRegistry()
	p, err := NewPublisher(js, PublisherConfig{Node: "n1", Interval: 20 * time.Millisecond, MaxBatch: 50, Timeout: 500 * time.Millisecond, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	total := 0
	add := func(n int) {
		for i := 0; i < n; i++ {
			if !p.Add("acme", testRecord(t, "acme", total)) {
				t.Fatal("Add refused")
			}
			total++
		}
	}
	add(500)
	ts.Stop()
	// While the server is down: Adds complete, and records pile up.
	for k := 0; k < 20; k++ {
		add(100)
		time.Sleep(100 * time.Millisecond)
	}
	if ts.Running() {
		t.Fatal("server came back by itself")
	}
	if p.Held() == 0 {
		t.Fatal("nothing held while JetStream was unreachable")
	}
	ts.Restart()
	add(500)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := p.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	seen := map[string]int{}
	for _, sb := range readStream(t, js, "rl") {
		for _, r := range sb.b.Records {
			seen[r.ID]++
		}
	}
	if len(seen) != total {
		t.Fatalf("%d distinct records in the stream, want %d", len(seen), total)
	}
	for id, n := range seen {
		if n != 1 {
			t.Fatalf("record %s stored %d times", id, n)
		}
	}
	if v := counterValue(t, reg, "limitmesh_usage_publish_retries_total", nil); v == 0 {
		t.Fatal("no publish was retried")
	}
	if err := p.Close(testCtx(t)); err != nil {
		t.Fatal(err)
	}
}

// Beyond MaxBuffered, records are dropped and counted; Close gives up on
// what it cannot publish by its deadline.
func TestPublisherOverflow(t *testing.T) {
	ts := startServer(t)
	_, js := connect(t, ts) // no stream: every publish fails
	reg := prometheus.NewRegistry()
	p, err := NewPublisher(js, PublisherConfig{Node: "n1", Interval: 10 * time.Millisecond, MaxBuffered: 100, Timeout: 100 * time.Millisecond, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	accepted := 0
	for i := 0; i < 150; i++ {
		if p.Add("acme", testRecord(t, "acme", i)) {
			accepted++
		}
	}
	if accepted != 100 {
		t.Fatalf("accepted %d, want 100", accepted)
	}
	if v := counterValue(t, reg, "limitmesh_usage_dropped_total", map[string]string{"reason": "overflow"}); v != 50 {
		t.Fatalf("dropped{overflow} = %v", v)
	}
	if v := counterValue(t, reg, "limitmesh_usage_pending_records", nil); v != 100 {
		t.Fatalf("pending = %v", v)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if err := p.Close(ctx); err == nil {
		t.Fatal("Close succeeded without a stream")
	}
	if v := counterValue(t, reg, "limitmesh_usage_dropped_total", map[string]string{"reason": "failed"}); v != 100 {
		t.Fatalf("dropped{failed} = %v", v)
	}
	if err := p.Sync(context.Background()); err != ErrClosed {
		t.Fatalf("Sync after Close: %v", err)
	}
}

// Close publishes everything buffered, long before the interval.
func TestPublisherCloseFlushes(t *testing.T) {
	ts := startServer(t)
	_, js := connect(t, ts)
	ensureStream(t, js)
	p, err := NewPublisher(js, PublisherConfig{Node: "n1", Interval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2500; i++ {
		p.Add([]string{"acme", ""}[i%2], testRecord(t, []string{"acme", ""}[i%2], i))
	}
	if err := p.Close(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, sb := range readStream(t, js, "rl") {
		n += len(sb.b.Records)
	}
	if n != 2500 {
		t.Fatalf("%d records in the stream after Close, want 2500", n)
	}
}

func TestPublisherConfig(t *testing.T) {
	for _, c := range []PublisherConfig{{Node: ""}, {Node: "a.b"}, {Node: "n", Boot: "j12"}, {Node: "n", Boot: "a b"}} {
		if _, err := NewPublisher(nil, c); err == nil {
			t.Errorf("%+v accepted", c)
		}
	}
}

// BenchmarkAdd measures the hot path, one Add per decision. Every 4096
// records the timer stops while the publisher publishes them to an
// embedded server (Sync), so the figure is Add's own cost with the
// buffers at their steady-state capacity, not the stream's.
func BenchmarkAdd(b *testing.B) {
	ts := startServer(b)
	_, js := connect(b, ts)
	if _, err := EnsureStream(testCtx(b), js, StreamConfig{Prefix: "rl"}); err != nil {
		b.Fatal(err)
	}
	p, err := NewPublisher(js, PublisherConfig{Node: "n1", MaxBatch: 4096})
	if err != nil {
		b.Fatal(err)
	}
	defer p.Close(context.Background())
	recs := make([]Record, 64)
	for i := range recs {
		recs[i] = testRecord(b, "acme", i)
	}
	for k := 0; k < 8; k++ { // warm up the buffers
		for i := 0; i < 4096; i++ {
			p.Add("acme", recs[i%64])
		}
		_ = p.Sync(context.Background())
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		p.Add("acme", recs[i%64])
		if i%4096 == 4095 {
			b.StopTimer()
			if err := p.Sync(context.Background()); err != nil {
				b.Fatal(err)
			}
			b.StartTimer()
		}
	}
}

// AddJournal queues each journalled record once per origin: a journal
// read again from its mark offers records queued already, which are
// skipped, so every origin's records reach the stream once each, in
// increasing position; a record refused (overflow) does not count as
// queued.
func TestPublisherAddJournal(t *testing.T) {
	ts := startServer(t)
	_, js := connect(t, ts)
	ensureStream(t, js)
	reg := prometheus.NewRegistry()
	p, err := NewPublisher(js, PublisherConfig{Node: "n2", Boot: "b2", Interval: 10 * time.Millisecond, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	add := func(node string, jseq uint64, idx uint32) {
		t.Helper()
		if !p.AddJournal("acme", node, "bx", JournalPos{JSeq: jseq, Idx: idx}, testRecord(t, "acme", int(jseq))) {
			t.Fatalf("AddJournal(%s, %d, %d) refused", node, jseq, idx)
		}
	}
	// Origin n1.bx: its writer's records, then a read of its journal from
	// the mark (jseq 1) that overlaps them, then more.
	add("n1", 1, 0)
	add("n1", 1, 1)
	add("n1", 2, 0)
	add("n3", 7, 0) // another origin: its own positions
	add("n1", 1, 0)
	add("n1", 1, 1)
	add("n1", 2, 0)
	add("n1", 3, 0)
	add("n3", 5, 0) // n3's journal read again from an earlier mark
	add("n3", 7, 0)
	add("n3", 8, 2)
	if err := p.Sync(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, sb := range readStream(t, js, "rl") {
		for _, r := range sb.b.Records {
			got = append(got, r.ID)
		}
	}
	want := "n1.bx.j1.0 n1.bx.j1.1 n1.bx.j2.0 n3.bx.j7.0 n1.bx.j3.0 n3.bx.j8.2"
	if strings.Join(got, " ") != want {
		t.Fatalf("stream ids\n%s\nwant\n%s", strings.Join(got, " "), want)
	}
	if err := p.Close(testCtx(t)); err != nil {
		t.Fatal(err)
	}

	// Refused for overflow: the position is not taken, a later offer of it
	// is tried again.
	_, js2 := connect(t, ts)
	q, err := NewPublisher(js2, PublisherConfig{Node: "n2", Interval: time.Hour, MaxBuffered: 1})
	if err != nil {
		t.Fatal(err)
	}
	if !q.AddJournal("acme", "n1", "bx", JournalPos{JSeq: 1}, testRecord(t, "acme", 1)) {
		t.Fatal("first record refused")
	}
	if q.AddJournal("acme", "n1", "bx", JournalPos{JSeq: 2}, testRecord(t, "acme", 2)) {
		t.Fatal("a record beyond MaxBuffered accepted")
	}
	if err := q.Sync(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if !q.AddJournal("acme", "n1", "bx", JournalPos{JSeq: 2}, testRecord(t, "acme", 2)) {
		t.Fatal("the refused record refused again with room")
	}
	if err := q.Close(testCtx(t)); err != nil {
		t.Fatal(err)
	}
}
