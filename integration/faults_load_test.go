package integration

import (
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
)

// The fault tests drive one hot key whose limit denies most of the load
// all along: a token bucket of hotBurst units refilled at hotRate units/s,
// emptied by one request of hotBurst units (prespend) before the load
// starts. From then on the load (hundreds to thousands of requests a
// second) is admitted at about hotRate/s, more right after a gap, and
// denied otherwise: during every fault, a node that decided from a stale or
// forgotten state would admit beyond the limit, and the accounting shows
// it.
//
// The bucket needs hotBurst/hotRate = 400 s without admissions to fill up
// again, far longer than any test waits, so it never caps its refill, and
// the units spent between two decisions follow exactly from the credit
// each reports (its remaining) and the refill between them:
//
//	spent = credit(start) + hotRate × (t(end) - t(start)) - credit(end)
//
// A test samples the credit before its load starts and after it ended
// (sampleHot) and checks (checkAccounting):
//
//	admitted by clients <= spent in the stored state   (nothing forgotten, no overshoot)
//	spent <= admitted + requests without a decision    (no unit spent twice)
//
// The second bound counts a 503 or an unanswered request as possibly spent
// (its write may have landed); a unit spent beyond that is a double spend.
// Each decision's instant is known to within its round trip on the wall
// clock (nodes decide with it); the samples are taken from decisions with
// short round trips, so the refill between them is known to a fraction of
// a unit.
const (
	hotBurst  = 20000
	hotRate   = 50 // units per second
	hotPolicy = `{"match": {"tenant": "hot"}, "key": ["tenant"],
 "limits": [{"name": "rate", "algorithm": "token_bucket", "rate": "50/s", "burst": 20000}]}`
)

var hotDesc = map[string]string{"tenant": "hot"}

// faultRequestTimeout is a load client's request timeout. Nodes answer 503
// after their 500 ms decision deadline, so a timeout means no node got or
// answered the request (a connection that went away), or a machine so
// loaded that a node could not run for seconds: 10× the deadline leaves
// room for that.
const faultRequestTimeout = 5 * time.Second

// loadStats counts the outcomes of a load's requests.
type loadStats struct {
	admitted, denied int
	unavailable      int      // 503 replies
	transport        int      // no reply: timeout, no responders, connection closed
	unexpected       []string // any other reply
	partitions       []int    // the decisions' "partition" hints (-1: none)
	maxGap           time.Duration
	maxGapEnd        time.Time
}

// ok is the number of decisions (200 replies).
func (s loadStats) ok() int { return s.admitted + s.denied }

// failed is the number of requests without a 200 reply.
func (s loadStats) failed() int { return s.unavailable + s.transport + len(s.unexpected) }

func (s loadStats) String() string {
	return fmt.Sprintf("admitted %d, denied %d, 503 %d, no reply %d, unexpected %d, longest gap between decisions %s",
		s.admitted, s.denied, s.unavailable, s.transport, len(s.unexpected), s.maxGap.Round(time.Millisecond))
}

// sub returns the counts of s since an earlier snapshot; the longest gap
// is s's (measured since the last resetGap).
func (s loadStats) sub(o loadStats) loadStats {
	return loadStats{
		admitted:    s.admitted - o.admitted,
		denied:      s.denied - o.denied,
		unavailable: s.unavailable - o.unavailable,
		transport:   s.transport - o.transport,
		unexpected:  s.unexpected[len(o.unexpected):],
		partitions:  s.partitions,
		maxGap:      s.maxGap,
		maxGapEnd:   s.maxGapEnd,
	}
}

// load sends decide requests for one descriptor from a few workers, each
// with its own connection, back to back, until stop.
type load struct {
	stopc chan struct{}
	wg    sync.WaitGroup

	mu      sync.Mutex
	st      loadStats
	lastOK  time.Time // instant of the last 200 reply (or of the start)
	gapFrom time.Time // gaps are measured from here on
}

// startLoad starts one worker per connection; it stops at cleanup if the
// test does not stop it first.
func startLoad(t *testing.T, conns []*nats.Conn, desc map[string]string) *load {
	t.Helper()
	l := &load{stopc: make(chan struct{}), lastOK: time.Now()}
	l.gapFrom = l.lastOK
	body := []byte(req(desc, ""))
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
				m, err := nc.Request("rl.v1.decide", body, faultRequestTimeout)
				l.record(m, err)
				if err != nil {
					// Connection down: do not spin while it reconnects.
					time.Sleep(10 * time.Millisecond)
				}
			}
		}()
	}
	t.Cleanup(l.stop)
	return l
}

func (l *load) record(m *nats.Msg, err error) {
	now := time.Now()
	l.mu.Lock()
	defer l.mu.Unlock()
	if err != nil {
		if errors.Is(err, nats.ErrTimeout) || errors.Is(err, nats.ErrNoResponders) ||
			errors.Is(err, nats.ErrConnectionClosed) || errors.Is(err, nats.ErrConnectionDraining) ||
			errors.Is(err, nats.ErrConnectionReconnecting) || errors.Is(err, nats.ErrDisconnected) {
			l.st.transport++
		} else {
			l.st.unexpected = append(l.st.unexpected, "request error: "+err.Error())
		}
		return
	}
	if code := m.Header.Get(micro.ErrorCodeHeader); code != "" {
		if code == "503" {
			l.st.unavailable++
		} else {
			l.st.unexpected = append(l.st.unexpected, code+": "+string(m.Data))
		}
		return
	}
	r, err := decodeReply(m)
	if err != nil {
		l.st.unexpected = append(l.st.unexpected, "bad reply: "+string(m.Data))
		return
	}
	if !slices.Contains(l.st.partitions, r.Partition) {
		l.st.partitions = append(l.st.partitions, r.Partition)
	}
	if r.Allowed {
		l.st.admitted++
	} else {
		l.st.denied++
	}
	l.noteGap(now)
	l.lastOK = now
}

// noteGap records the gap since the last decision if it is the longest.
func (l *load) noteGap(now time.Time) {
	from := l.lastOK
	if from.Before(l.gapFrom) {
		from = l.gapFrom
	}
	if g := now.Sub(from); g > l.st.maxGap {
		l.st.maxGap, l.st.maxGapEnd = g, now
	}
}

// stats returns a snapshot; while the load runs, the gap still open at
// this instant counts.
func (l *load) stats() loadStats {
	l.mu.Lock()
	defer l.mu.Unlock()
	select {
	case <-l.stopc:
	default:
		l.noteGap(time.Now())
	}
	st := l.st
	st.unexpected = append([]string(nil), st.unexpected...)
	st.partitions = slices.Clone(st.partitions)
	return st
}

// resetGap starts measuring gaps afresh (from now).
func (l *load) resetGap() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.st.maxGap = 0
	l.gapFrom = time.Now()
}

// waitDecisions waits (bounded by within) until n more decisions than in
// the snapshot from have been answered, at least one of them a denial: the
// load exceeds the hot key's limit, so the limit binds again after a fault
// once the credit gathered during the gap is spent.
func (l *load) waitDecisions(t *testing.T, from loadStats, n int, within time.Duration, what string) {
	t.Helper()
	l.waitUntil(t, from, n, true, within, what)
}

// waitAnswered is waitDecisions for a load its limit need not deny (a
// metered key): n more decisions, denied or not.
func (l *load) waitAnswered(t *testing.T, from loadStats, n int, within time.Duration, what string) {
	t.Helper()
	l.waitUntil(t, from, n, false, within, what)
}

func (l *load) waitUntil(t *testing.T, from loadStats, n int, denial bool, within time.Duration, what string) {
	t.Helper()
	start := time.Now()
	for st := l.stats(); st.ok()-from.ok() < n || denial && st.denied == from.denied; st = l.stats() {
		if time.Since(start) > within {
			if denial {
				t.Fatalf("%s: fewer than %d decisions or no denial within %s (%v)", what, n, within, st.sub(from))
			}
			t.Fatalf("%s: fewer than %d decisions within %s (%v)", what, n, within, st.sub(from))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// stop stops the workers and waits for them (at most one request timeout).
func (l *load) stop() {
	select {
	case <-l.stopc:
	default:
		close(l.stopc)
	}
	l.wg.Wait()
}

// hotSample is the hot key's credit at one decision.
type hotSample struct {
	credit     float64   // units left at the decision, before its own spend
	allowed    bool      // the decision
	sent, recv time.Time // the request's send and the reply's receive instants
	// Of the requests sampleHot sent before this one and this one: units
	// admitted, and requests without a decision (503 or no reply).
	admitted, failed int
}

// rtt is the sample's round trip: the uncertainty of its decision's
// instant.
func (s hotSample) rtt() time.Duration { return s.recv.Sub(s.sent) }

// hotSampleRTT is the round trip sampleHot aims for: the refill during it
// (0.1 unit at hotRate) is the accounting's uncertainty.
const hotSampleRTT = 2 * time.Millisecond

// sampleHot decides requests of cost 1 for the hot key through nc, one at
// a time, until one has a round trip of at most hotSampleRTT, and at most
// 20 decisions (requests without a decision are retried, bounded by
// faultTimeout), and returns the last decision's sample.
func sampleHot(t *testing.T, nc *nats.Conn) hotSample {
	t.Helper()
	var s hotSample
	body := []byte(req(hotDesc, ""))
	decisions := 0
	waitWithin(t, faultTimeout, "a decision of the hot key", func() bool {
		sent := time.Now()
		m, err := nc.Request("rl.v1.decide", body, faultRequestTimeout)
		recv := time.Now()
		if err != nil {
			s.failed++
			return false
		}
		r, err := decodeReply(m)
		if err == nil && r.Code == "503" {
			s.failed++
			return false
		}
		if err != nil || r.Code != "" {
			t.Fatalf("sample: %q (%v)", m.Data, err)
		}
		decisions++
		s.sent, s.recv, s.credit, s.allowed = sent, recv, r.Remaining, r.Allowed
		if r.Allowed {
			s.admitted++
			s.credit++
		}
		return s.rtt() <= hotSampleRTT || decisions == 20
	})
	return s
}

// hotAccount is a fault test's accounting of the hot key: the prespend and
// the credit sampled before the load starts.
type hotAccount struct {
	prespent time.Time // the prespend's first attempt sent
	failed   int       // prespend attempts without a decision
	start    hotSample
}

// prespend spends the hot key's whole burst in one request (its first
// decision: the key starts full), retried with its request_id on a 503 or
// no reply, so that it spends once; then it samples the credit through nc
// (sampleHot): the start of the test's accounting.
func prespend(t *testing.T, nc *nats.Conn) hotAccount {
	t.Helper()
	a := hotAccount{prespent: time.Now()}
	body := []byte(req(hotDesc, fmt.Sprintf(`"cost":%d,"request_id":"prespend-%x"`, hotBurst, time.Now().UnixNano())))
	var r reply
	waitWithin(t, faultTimeout, "the prespend's decision", func() bool {
		m, err := nc.Request("rl.v1.decide", body, faultRequestTimeout)
		if err != nil {
			a.failed++
			return false
		}
		r, err = decodeReply(m)
		if err == nil && r.Code == "503" {
			a.failed++
			return false
		}
		if err != nil || r.Code != "" {
			t.Fatalf("prespend: %q (%v)", m.Data, err)
		}
		return true
	})
	if !r.Allowed || r.Remaining >= 1 {
		t.Fatalf("prespend of the whole burst: %+v, want admitted with nothing left", r)
	}
	a.start = sampleHot(t, nc)
	return a
}

// wallSeconds is the time from a to b on the wall clock, the clock nodes
// decide with. Time.Sub would use the monotonic clock, whose rate differs
// from the wall clock's while the system clock is slewed or stepped (on a
// VM, by as much as 0.5% for minutes), which would count as refill a node
// never saw or miss some it did.
func wallSeconds(a, b time.Time) float64 {
	return float64(b.UnixNano()-a.UnixNano()) / 1e9
}

// checkAccounting samples the hot key's credit through nc once more
// (retrying failures, bounded like the recovery after a heal: a server cut
// off from the others may keep a stale stream leader, whose answers fail
// the hot key's claims, up to the raft's lost-quorum interval) and checks
// the load's admissions against the units spent since the start sample
// (see hotPolicy). admitted and failed count the load's requests admitted
// and without a decision; every request the load sent has ended.
func checkAccounting(t *testing.T, nc *nats.Conn, a hotAccount, admitted, failed int) {
	t.Helper()
	end := sampleHot(t, nc)
	// Between the two samples' decisions: the load, and the end sample's
	// requests before its last. Failed requests of the prespend and the
	// start sample may have been decided late: count them too.
	admittedIn := admitted + end.admitted
	if end.allowed {
		admittedIn-- // the last sample's own spend comes after its credit
	}
	failedIn := failed + a.failed + a.start.failed + end.failed
	refillMin := hotRate * wallSeconds(a.start.recv, end.sent)
	refillMax := hotRate * wallSeconds(a.start.sent, end.recv)
	const eps = 0.01 // units: micro-unit rounding of remaining, nothing more
	spentMin := int(math.Ceil(a.start.credit + refillMin - end.credit - eps))
	spentMax := int(math.Floor(a.start.credit + refillMax - end.credit + eps))
	t.Logf("accounting: admitted %d units, %d requests without a decision; the stored state spent %d..%d units (%d..%d not admitted; sample round trips %s and %s)",
		admittedIn, failedIn, spentMin, spentMax, spentMin-admittedIn, spentMax-admittedIn,
		a.start.rtt().Round(time.Microsecond), end.rtt().Round(time.Microsecond))
	if admittedIn > spentMax {
		t.Errorf("OVERSHOOT: clients were admitted %d units but the stored state spent at most %d (%d admitted and forgotten, or decided from a stale state)",
			admittedIn, spentMax, admittedIn-spentMax)
	}
	if spentMin > admittedIn+failedIn {
		t.Errorf("DOUBLE SPEND: the stored state spent at least %d units, but only %d were admitted and %d requests got no decision (%d units spent twice)",
			spentMin, admittedIn, failedIn, spentMin-admittedIn-failedIn)
	}
	// The contract as clients alone see it: after the prespend emptied the
	// bucket, at most rate × span.
	all := admitted + a.start.admitted + end.admitted
	span := wallSeconds(a.prespent, end.recv)
	if allowed := hotRate * span; float64(all) > allowed+eps {
		t.Errorf("CONTRACT: %d units admitted after the burst within %.3fs, more than rate × span = %.2f",
			all, span, allowed)
	}
}

// faultLog returns a logger for a fault test's node (Info and above, each
// line prefixed with name) whose lines the test prints if it fails.
func faultLog(t *testing.T, name string) *slog.Logger {
	t.Helper()
	buf := &syncBuffer{}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("log of node %s (last 8 kB):\n%s", name, tail(buf.String(), 8<<10))
		}
	})
	return slog.New(slog.NewTextHandler(buf, &slog.HandlerOptions{Level: slog.LevelInfo}))
}

// requireClean fails on replies other than decisions, 503s and (when
// allowed) requests that got no reply.
func requireClean(t *testing.T, what string, st loadStats, allowNoReply bool) {
	t.Helper()
	if len(st.unexpected) > 0 {
		n := min(len(st.unexpected), 5)
		t.Errorf("%s: %d replies other than a decision or 503, e.g. %q", what, len(st.unexpected), st.unexpected[:n])
	}
	if !allowNoReply && st.transport > 0 {
		t.Errorf("%s: %d requests got no reply (want a decision or a 503)", what, st.transport)
	}
}
