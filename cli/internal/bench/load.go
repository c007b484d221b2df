package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
)

// benchRun is one run's shared parts.
type benchRun struct {
	c        *Config
	plan     *benchPlan
	dist     *keyDist
	load     []*inboxConn
	progress io.Writer
	// base is the instant the tallies' times count from: one for the whole
	// run, taken before the first slice, so that a key's span may cross
	// slices.
	base time.Time
}

// keyTally is what bench saw of one key in the decide phase, over all its
// slices: admitted cost (micro-units), the send time of the first admitted
// request and the receive time of the last (ns since benchRun.base,
// bench's monotonic clock). Workers update it with atomics.
type keyTally struct {
	admitted atomic.Int64
	first    atomic.Int64 // math.MaxInt64 until the first admission
	last     atomic.Int64
}

func (k *keyTally) add(cost, sent, received int64) {
	k.admitted.Add(cost)
	for {
		f := k.first.Load()
		if sent >= f || k.first.CompareAndSwap(f, sent) {
			break
		}
	}
	for {
		l := k.last.Load()
		if received <= l || k.last.CompareAndSwap(l, received) {
			break
		}
	}
}

// worker is one request in flight: it sends, waits for the reply and sends
// the next. Only done and errs are read while it runs; a phase's slices run
// it one after the other (each on a goroutine of its own, started after the
// previous one ended), so the other fields need no synchronisation.
type worker struct {
	done, errs atomic.Int64 // replies, errors so far

	slot *inboxSlot
	pick *keyPicker
	body []byte
	hist *latencyHist

	admitted, denied int64
	timeouts         int64 // no reply within --timeout
	unavailable      int64 // 503 replies
	failed           int64 // other error replies and send errors
	unmatched        int64 // decisions not made with the bench policy

	res *resWorker // the reserve modes (reserve.go)
}

// phaseResult is one phase's merged figures.
type phaseResult struct {
	elapsed  time.Duration // the phase's slices' time, summed
	replies  int64         // successful replies (decisions: admitted + denied)
	hist     latencyHist
	admitted int64
	denied   int64
	errors   int64
	timeouts int64
	unavail  int64
	failed   int64
	unmatch  int64
}

func (p *phaseResult) perSec() float64 {
	if p.elapsed <= 0 {
		return 0
	}
	return float64(p.replies) / p.elapsed.Seconds()
}

// phase is the echo or the decide phase. Its workers outlive its slices:
// each keeps its reply slot, key picker, histogram and counters, so the
// slices together measure what one phase would, without the gaps.
type phase struct {
	name    string
	subject string
	tally   []keyTally // nil: the echo phase (replies are not parsed)
	// loop, when set, is a worker's loop in place of work (the reserve
	// modes, reserve.go).
	loop    func(w *worker, stop *atomic.Bool)
	workers []*worker
	elapsed time.Duration // summed over the slices run so far
	cpu     time.Duration // CPU time of this process during the slices (cpu.go)
}

// newPhase makes --concurrency workers against subject, spread over the
// load connections; worker i draws keys from stream i of --seed in either
// phase, so both phases send the same key sequence. With tally nil it is
// the echo phase; otherwise every reply is a decision, counted and, when
// admitted, added to its key's tally.
func (r *benchRun) newPhase(name, subject string, tally []keyTally) *phase {
	c := r.c
	p := &phase{name: name, subject: subject, tally: tally, workers: make([]*worker, c.Concurrency)}
	next := make([]int, len(r.load))
	for i := range p.workers {
		conn := i % len(r.load)
		p.workers[i] = &worker{
			slot: r.load[conn].slots[next[conn]],
			pick: r.dist.picker(c.Seed, uint64(i)),
			hist: new(latencyHist),
		}
		next[conn]++
	}
	return p
}

// sum is the phase's replies and errors so far (safe while workers run).
func (p *phase) sum() (done, errs int64) {
	for _, w := range p.workers {
		done += w.done.Load()
		errs += w.errs.Load()
	}
	return done, errs
}

// runSlice runs the phase's workers for sl.d, then stops them and waits for
// their requests in flight; the slice's time, to that end, is added to the
// phase's. The other phase's workers are idle meanwhile, so the two never
// share the reply slots.
func (r *benchRun) runSlice(ctx context.Context, p *phase, sl benchSlice) error {
	var stop atomic.Bool
	var wg sync.WaitGroup
	start, cpu0 := time.Now(), processCPU()
	for _, w := range p.workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if p.loop != nil {
				p.loop(w, &stop)
				return
			}
			r.work(w, p.subject, &stop, p.tally)
		}()
	}
	finished := make(chan struct{})
	go func() { wg.Wait(); close(finished) }()

	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	end := time.NewTimer(sl.d)
	defer end.Stop()
	lastDone, _ := p.sum()
	interrupted := false
wait:
	for {
		select {
		case <-tick.C:
			done, errs := p.sum()
			el := p.elapsed + time.Since(start)
			logf(r.progress, "  %-6s %d/%d %5.1fs  %9.0f/s (last second %9d/s)  errors %d",
				p.name, sl.round, r.c.Rounds, el.Seconds(), float64(done)/el.Seconds(), done-lastDone, errs)
			lastDone = done
		case <-end.C:
			stop.Store(true)
		case <-ctx.Done():
			stop.Store(true)
			interrupted = true
		case <-finished:
			break wait
		}
	}
	p.elapsed += time.Since(start)
	p.cpu += processCPU() - cpu0
	if interrupted {
		return ctx.Err()
	}
	return nil
}

// result merges the workers' figures; call it once no slice runs.
func (p *phase) result() *phaseResult {
	res := &phaseResult{elapsed: p.elapsed}
	for _, w := range p.workers {
		res.replies += w.done.Load()
		res.errors += w.errs.Load()
		res.hist.merge(w.hist)
		res.admitted += w.admitted
		res.denied += w.denied
		res.timeouts += w.timeouts
		res.unavail += w.unavailable
		res.failed += w.failed
		res.unmatch += w.unmatched
	}
	return res
}

// work is one worker's loop until stop (one slice).
func (r *benchRun) work(w *worker, subject string, stop *atomic.Bool, tally []keyTally) {
	timeout, base := r.c.Timeout, r.base
	for !stop.Load() {
		k := w.pick.next()
		w.body = r.plan.appendBody(w.body[:0], k)
		t0 := time.Now()
		msg, err := w.slot.request(subject, w.body, timeout)
		t1 := time.Now()
		if err != nil {
			w.errs.Add(1)
			if errors.Is(err, nats.ErrTimeout) {
				w.timeouts++
				continue
			}
			// No responders or a broken connection fail at once: pause
			// rather than spin.
			w.failed++
			time.Sleep(10 * time.Millisecond)
			continue
		}
		if code := msg.Header.Get("Nats-Service-Error-Code"); code != "" {
			if code == "503" {
				w.unavailable++
			} else {
				w.failed++
			}
			w.errs.Add(1)
			continue
		}
		if tally != nil {
			allowed, ok := r.plan.scanReply(msg.Data)
			if !ok {
				w.unmatched++
				w.errs.Add(1)
				continue
			}
			if allowed {
				w.admitted++
				// Wall-clock spans, as nodes decide on the wall clock (a
				// monotonic span differs when the wall clock is slewed).
				tally[k].add(r.plan.cost, t0.UnixNano()-base.UnixNano(), t1.UnixNano()-base.UnixNano())
			} else {
				w.denied++
			}
		}
		w.hist.record(int64(t1.Sub(t0)))
		w.done.Add(1)
	}
}

// scanReply reads "allowed" from a decide reply and checks that the bench
// policy made the decision; ok is false for any other reply (a node that has
// not applied the policy yet answers unmatched descriptors with policy "").
// It looks for the fields as the node writes them and falls back to
// encoding/json for any other layout and for replies of other policies.
func (p *benchPlan) scanReply(b []byte) (allowed, ok bool) {
	const af, pf = `"allowed":`, `"policy":`
	i := bytes.Index(b, []byte(af))
	j := bytes.Index(b, []byte(pf))
	if i >= 0 && j >= 0 {
		a := b[i+len(af):]
		pol := b[j+len(pf):]
		if bytes.HasPrefix(pol, p.quotedPolicy) {
			switch {
			case bytes.HasPrefix(a, []byte("true")):
				return true, true
			case bytes.HasPrefix(a, []byte("false")):
				return false, true
			}
		}
	}
	var r decideReply
	if json.Unmarshal(b, &r) != nil || r.Policy != p.policyName {
		return false, false
	}
	return r.Allowed, true
}

// inboxConn is a load connection: one wildcard subscription on an inbox of
// its own, and one reply subject per slot (a worker) under it, so a request
// is a publish plus a delivery.
type inboxConn struct {
	nc     *nats.Conn
	prefix string // "<inbox>."
	slots  []*inboxSlot
}

// inboxSlot is one worker's reply subject <inbox>.<slot>.<generation>; the
// generation changes after a timeout so that a late reply is never taken for
// the next request's.
type inboxSlot struct {
	c     *inboxConn
	idx   int
	gen   atomic.Uint32
	reply string
	ch    chan *nats.Msg
	timer *time.Timer
}

func newInboxConn(nc *nats.Conn, slots int) (*inboxConn, error) {
	c := &inboxConn{nc: nc, prefix: nc.NewInbox() + "."}
	for i := range slots {
		s := &inboxSlot{c: c, idx: i, ch: make(chan *nats.Msg, 4), timer: time.NewTimer(time.Hour)}
		s.timer.Stop()
		s.reply = c.prefix + strconv.Itoa(i) + ".0"
		c.slots = append(c.slots, s)
	}
	sub, err := nc.Subscribe(c.prefix+"*.*", c.dispatch)
	if err != nil {
		return nil, err
	}
	if err := sub.SetPendingLimits(-1, -1); err != nil {
		return nil, err
	}
	return c, nc.Flush()
}

// dispatch hands a reply to its slot (on the connection's delivery
// goroutine). Replies of an old generation are dropped.
func (c *inboxConn) dispatch(m *nats.Msg) {
	rest := m.Subject[min(len(c.prefix), len(m.Subject)):]
	dot := strings.IndexByte(rest, '.')
	if dot < 0 {
		return
	}
	idx, err1 := strconv.Atoi(rest[:dot])
	gen, err2 := strconv.ParseUint(rest[dot+1:], 10, 32)
	if err1 != nil || err2 != nil || idx < 0 || idx >= len(c.slots) {
		return
	}
	s := c.slots[idx]
	if uint32(gen) != s.gen.Load() {
		return
	}
	select {
	case s.ch <- m:
	default:
	}
}

// request publishes body to subject and waits up to timeout for the reply.
// Only the slot's worker calls it.
func (s *inboxSlot) request(subject string, body []byte, timeout time.Duration) (*nats.Msg, error) {
	if err := s.c.nc.PublishRequest(subject, s.reply, body); err != nil {
		return nil, err
	}
	s.timer.Reset(timeout)
	for {
		select {
		case m := <-s.ch:
			if m.Subject != s.reply {
				continue // a late reply to an earlier generation
			}
			s.timer.Stop()
			if len(m.Data) == 0 && m.Header.Get("Status") == "503" {
				return nil, nats.ErrNoResponders
			}
			return m, nil
		case <-s.timer.C:
			g := s.gen.Add(1)
			s.reply = s.c.prefix + strconv.Itoa(s.idx) + "." + strconv.FormatUint(uint64(g), 10)
			return nil, nats.ErrTimeout
		}
	}
}

// decideReply is what bench reads of a decide reply.
type decideReply struct {
	Allowed   bool        `json:"allowed"`
	Policy    string      `json:"policy"`
	Revision  uint64      `json:"revision"`
	Remaining json.Number `json:"remaining"`
}
