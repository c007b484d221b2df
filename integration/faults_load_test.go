package integration

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
)

// The fault tests drive one hot key with a policy whose burst is far
// larger than anything a test can spend and which refills less than one
// unit during a test. Every admission must then be visible in the stored
// state afterwards, whatever failed in between:
//
//	admitted by clients <= units spent in the stored state
//
// (0 overshoot, nothing forgotten). A strict limiter that admitted from a
// stale cache, or a failover that lost or forgot state (a fresh burst),
// breaks it. The units spent beyond the admissions (writes that landed
// while the client got a 503 or no reply, or a request decided again after
// a write whose outcome the node could not know) are logged: they are
// under-admission, which the contract allows.
const (
	hotBurst  = 1_000_000
	hotPolicy = `{"match": {"tenant": "hot"}, "key": ["tenant"],
 "limits": [{"name": "rate", "algorithm": "token_bucket", "rate": "1/h", "burst": 1000000}]}`
)

var hotDesc = map[string]string{"tenant": "hot"}

// faultRequestTimeout is a load client's request timeout (nodes answer 503
// after their 500 ms decision deadline, so a timeout means no node got
// or answered the request: a connection that went away).
const faultRequestTimeout = 2 * time.Second

// loadStats counts the outcomes of a load's requests.
type loadStats struct {
	admitted, denied int
	unavailable      int      // 503 replies
	transport        int      // no reply: timeout, no responders, connection closed
	unexpected       []string // any other reply
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
	var r reply
	if err := json.Unmarshal(m.Data, &r); err != nil {
		l.st.unexpected = append(l.st.unexpected, "bad reply: "+string(m.Data))
		return
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
// the snapshot from have been answered.
func (l *load) waitDecisions(t *testing.T, from loadStats, n int, within time.Duration, what string) {
	t.Helper()
	deadline := time.Now().Add(within)
	for l.stats().ok()-from.ok() < n {
		if time.Now().After(deadline) {
			t.Fatalf("%s: fewer than %d decisions within %s (%v)", what, n, within, l.stats().sub(from))
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

// checkAccounting spends one more unit through nc (retrying 503s, bounded
// like the recovery after a heal: a server cut off from the others may
// keep a stale stream leader, whose answers fail the hot key's claims, up
// to the raft's lost-quorum interval) and checks the admissions against
// the stored state that decision reports. failed is the number of load
// requests without a 200 reply.
func checkAccounting(t *testing.T, nc *nats.Conn, admitted, failed int) {
	t.Helper()
	var r reply
	waitWithin(t, 4*testTimeout, "a decision to read the stored state", func() bool {
		m, err := nc.Request("rl.v1.decide", []byte(req(hotDesc, "")), faultRequestTimeout)
		if err != nil {
			return false
		}
		r = reply{}
		if json.Unmarshal(m.Data, &r) != nil || m.Header.Get(micro.ErrorCodeHeader) != "" {
			return false
		}
		return r.Allowed
	})
	// remaining = burst - spent - 1 (this probe) + refill, refill < 1 unit.
	spent := int(math.Ceil(hotBurst - r.Remaining - 1 - 1e-6))
	t.Logf("accounting: admitted %d, spent in the store %d (%d not admitted), requests without a decision %d",
		admitted, spent, spent-admitted, failed)
	if admitted > spent {
		t.Errorf("OVERSHOOT: clients were admitted %d units but the stored state spent only %d (%d admitted and forgotten or never written)",
			admitted, spent, admitted-spent)
	}
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
