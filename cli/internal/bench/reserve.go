package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/limitmesh/limitmesh/cli/internal/clitext"
	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/policies"
)

// `limitmesh bench --mode reserve` and `--mode concurrency` (CONTRACT §10)
// measure reservations the way the other modes measure decisions: the
// same run (policy, embedded node or deployment, echo and measured phases
// in alternating rounds, --concurrency closed-loop workers over --conns
// connections, --keys with --zipf), with operations in place of decisions.
//
// The operations. In reserve mode a worker reserves --cost (with
// --random-cost a cost drawn uniformly from 0.000001 up to --cost) on
// <prefix>.v1.reserve with ttl --ttl, and when admitted settles a random
// part of it (uniform over 0..the reserved cost, in micro-units) on
// <prefix>.v1.settle. The policy is a token_bucket of --rate and --burst
// per key, as the strict bench's, in strict mode. In concurrency mode the
// policy has one concurrency limit of --slots units per key (default:
// --concurrency / --keys / 2, at least 1, so that the hot keys of the
// default load deny some acquires); a worker acquires --cost (a reserve),
// holds it for a random time up to --hold (uniform, in ns), and releases
// it on <prefix>.v1.release. These are the requests the SDK's Reserve and
// Settle, Acquire and Release send. An operation is a reserve with its
// settle or release when admitted, or a denied reserve alone:
// decisions/decisions_per_sec count operations, admitted and denied their
// outcomes, and p50/p99 are those of an admitted pair (its two round
// trips, the hold left out). A settle or release that gets no answer is
// sent again (at most endAttempts times in all; the node answers a repeat
// with the first outcome).
//
// The echo phase runs the same loop against two raw NATS responders that
// answer as large a reply as a real reserve and a real settle (or
// release), with the holds, so the echo baseline is an echo operation:
// echo_requests and echo_per_sec count those, and ratio compares like with
// like.
//
// CPU. cpu_us_per_decision is this process's CPU time per operation, as in
// the other modes; cpu_us_per_pair is twice the CPU time per request sent
// to the node (a reserve and its settle are two requests; a denied reserve
// is one, so a run with many denials does not look cheaper per pair), and
// is what compares with --mode strict's cpu_us_per_decision on the same
// machine: the target is a pair at most 2.2 times a strict decision.
//
// Overshoot. Reserve mode: the node's contract for reservations is that
// the units that stay spent of the reservations admitted in any [t1, t2]
// are at most burst + rate × (t2 - t1) (CONTRACT §10, keys'
// TestReservationProperty). Each key's tally adds up the settled units of
// its admitted reservations, as the clients saw them, at their reserve's
// instant: the span runs from the send of the first admitted reserve to
// the reply of the last, as in strict mode (bench.go), and the same check
// applies. A reservation the worker abandons (--abandon) or that expired
// before its settle (a 404) counts at its reserved cost, which it stays
// spent at; a settle whose outcome bench never learned counts at the part
// it asked to keep, the least the node may have kept spent, so a correct
// node never shows overshoot. Concurrency mode: each key counts the units
// its clients hold, adding a slot's cost once its acquire's reply is read
// and taking it away before its release is sent: the node held that slot
// all along between (it admitted it before the reply and frees it after
// the release arrives), so whenever the count is above --slots more than
// --slots units were held at once on the node. overshoot is the sum over
// keys of the largest excess seen (a hold that outlives --ttl, which the
// ttl makes impossible unless the process stalls for that long, would be
// counted although the node freed it: --ttl is far above --hold).
//
// Leaks (reserve_check.go): after the last slice bench waits until
// every key a reserve was sent for is back to full and no reservation of
// the bench policy is open on the node, or --leak-wait passes.

// endAttempts bounds the sends of one settle or release.
const endAttempts = 3

// ReserveConfig is the reservation modes' settings.
type ReserveConfig struct {
	TTL         time.Duration // the reservations' ttl
	LeakWait    time.Duration // the leak check's longest wait; 0: the default (leakWaitFor)
	Hold        time.Duration // Concurrency: the longest a worker holds a slot
	Slots       string        // Concurrency: units each key may hold at once; "": see Config.Slots
	RandomCost  bool          // each reserve's cost is uniform in 0.000001..Cost
	Abandon     float64       // the fraction of admitted reservations never ended
	MetricsURLs []string      // with Dial: the nodes' /metrics URLs
}

func (f *ReserveConfig) validate(c *Config) error {
	switch {
	case f.TTL < time.Millisecond || f.TTL > policies.MaxReservationTTL:
		return fmt.Errorf("--ttl %v: must be 1ms..%v", f.TTL, policies.MaxReservationTTL)
	case f.LeakWait < 0:
		return fmt.Errorf("--leak-wait %v: must not be negative", f.LeakWait)
	case f.Hold < 0:
		return fmt.Errorf("--hold %v: must not be negative", f.Hold)
	case f.Hold >= f.TTL:
		return fmt.Errorf("--hold %v: must be below --ttl %v (a slot would expire while held)", f.Hold, f.TTL)
	case f.Abandon < 0 || f.Abandon > 1:
		return fmt.Errorf("--abandon %v: must be 0..1", f.Abandon)
	case c.Candidates > 0 || c.Flood.Factor > 0:
		return fmt.Errorf("--candidates and --flood are for the decide modes, not --mode %s", c.Mode)
	case len(f.MetricsURLs) > 0 && !c.external():
		return errors.New("--metrics-url is for a deployment (--nats-url); bench reads the embedded node's metrics itself")
	}
	for _, u := range f.MetricsURLs {
		if !strings.HasPrefix(u, "http://") && !strings.HasPrefix(u, "https://") {
			return fmt.Errorf("--metrics-url %q: want http:// or https:// URLs", u)
		}
	}
	if f.Slots != "" {
		if _, err := policies.ParseCost(f.Slots); err != nil {
			return fmt.Errorf("--slots %q: %v", f.Slots, err)
		}
	}
	return nil
}

// Slots returns the concurrency limit of a Concurrency run: Reserve.Slots,
// or Concurrency / Keys / 2, at least 1.
func (c *Config) Slots() string {
	if c.Reserve.Slots != "" {
		return c.Reserve.Slots
	}
	return strconv.Itoa(max(1, c.Concurrency/c.Keys/2))
}

// resPlan is the reservation part of a run's plan.
type resPlan struct {
	concurrency bool
	endSubj     string // settle (reserve mode) or release (concurrency mode)
	echoEndSubj string
	ttl         time.Duration
	capacity    int64 // micro-units of a full key: the burst, or the slots
	hold        time.Duration
	randomCost  bool
	abandon     float64
	// A reserve body is bodyPre + key number + costPre + cost + costPost.
	costPre, costPost []byte
}

// reserveLimits returns the limits of the bench policy in a reserve mode
// as a JSON array, and the flags they come from (for errors).
func reserveLimits(c *Config) (string, string) {
	if c.Mode == "concurrency" {
		slots := c.Slots()
		return fmt.Sprintf(`[{"name":"slots","algorithm":"concurrency","limit":%s}]`, clitext.NumberJSON(slots)),
			fmt.Sprintf("--slots %q", slots)
	}
	rate, _ := json.Marshal(c.Rate)
	return fmt.Sprintf(`[{"name":"rate","algorithm":"token_bucket","rate":%s,"burst":%s}]`, rate, clitext.NumberJSON(c.Burst)),
		fmt.Sprintf("--rate %q / --burst %q", c.Rate, c.Burst)
}

// planReservations completes p for a reserve mode: the measured phase's
// first request is a reserve.
func (p *benchPlan) planReservations(c *Config) error {
	rp := &resPlan{
		concurrency: c.Mode == "concurrency",
		endSubj:     c.Prefix + ".v1.settle",
		echoEndSubj: p.echoSubj + ".end",
		ttl:         c.Reserve.TTL,
		capacity:    p.limit.Burst,
		randomCost:  c.Reserve.RandomCost,
		abandon:     c.Reserve.Abandon,
	}
	if rp.concurrency {
		rp.endSubj, rp.capacity, rp.hold = c.Prefix+".v1.release", p.limit.Limit, c.Reserve.Hold
		if p.limit.Limit < p.cost {
			return fmt.Errorf("--slots %s is below --cost %s: every acquire would be denied", c.Slots(), c.Cost)
		}
	}
	p.decideSubj = c.Prefix + ".v1.reserve"
	rp.costPre = []byte(`"},"cost":"`)
	rp.costPost = fmt.Appendf(nil, `","ttl":%q}`, c.Reserve.TTL.String())
	p.res = rp
	return nil
}

// appendReserve appends the reserve body of key k for cost micro-units.
func (p *benchPlan) appendReserve(dst []byte, k int, cost int64) []byte {
	dst = append(dst, p.bodyPre...)
	dst = strconv.AppendInt(dst, int64(k), 10)
	dst = append(dst, p.res.costPre...)
	dst = kvstate.AppendUnits(dst, cost)
	return append(dst, p.res.costPost...)
}

// appendEnd appends the settle body of reservation id (a JSON string
// token, quotes included) keeping units micro-units spent, or, in
// concurrency mode, its release body.
func (p *benchPlan) appendEnd(dst, id []byte, units int64) []byte {
	dst = append(dst, `{"reservation":`...)
	dst = append(dst, id...)
	if !p.res.concurrency {
		dst = append(dst, `,"cost":"`...)
		dst = kvstate.AppendUnits(dst, units)
		dst = append(dst, '"')
	}
	return append(dst, '}')
}

// scanReservation returns the "reservation" of a reserve reply as its JSON
// string token, quotes included (copied into a settle body as it is, it
// names the same id whatever its escapes); ok is false without one.
func scanReservation(b []byte) (id []byte, ok bool) {
	const f = `"reservation":`
	if i := bytes.Index(b, []byte(f)); i >= 0 {
		s := b[i+len(f):]
		if len(s) > 0 && s[0] == '"' {
			for j := 1; j < len(s); j++ {
				switch s[j] {
				case '\\':
					j++
				case '"':
					return s[:j+1], true
				}
			}
		}
	}
	var r struct {
		Reservation string `json:"reservation"`
	}
	if json.Unmarshal(b, &r) != nil || r.Reservation == "" {
		return nil, false
	}
	id, _ = json.Marshal(r.Reservation)
	return id, true
}

// endConfirmed reports whether a settle or release reply confirms the end
// bench asked for: outcome settled with the units bench asked to keep
// (formatted as the node formats them), or released.
func (p *benchPlan) endConfirmed(b []byte, units int64) bool {
	if p.res.concurrency {
		return bytes.Contains(b, []byte(`"outcome":"released"`))
	}
	const sf = `"settled":`
	i := bytes.Index(b, []byte(sf))
	if i < 0 || !bytes.Contains(b, []byte(`"outcome":"settled"`)) {
		return false
	}
	var buf [24]byte
	want := kvstate.AppendUnits(buf[:0], units)
	rest := b[i+len(sf):]
	return bytes.HasPrefix(rest, want) && len(rest) > len(want) && (rest[len(want)] == ',' || rest[len(want)] == '}')
}

// slotTally is what the clients hold of one concurrency key: units
// (micro-units) and the largest excess over the limit seen.
type slotTally struct {
	held   atomic.Int64
	excess atomic.Int64
}

// resWorker is a worker's state in a reserve mode; like the rest of a
// worker, only its goroutine of the moment touches it.
type resWorker struct {
	rng      *rand.Rand
	end      []byte // the settle or release body
	id       []byte
	requests int64 // requests sent (to the node, or to echo)
	// Ends bench never saw confirmed after endAttempts sends, ends
	// answered 404 (the reservation expired first), and reservations
	// left open on purpose (--abandon).
	endUnknown, expired, abandoned int64
}

// resBench is a reserve-mode run's shared parts.
type resBench struct {
	r       *benchRun
	plan    *benchPlan
	rp      *resPlan
	tally   []keyTally  // admitted units per key: settled (reserve mode) or acquired (concurrency)
	slots   []slotTally // concurrency mode
	touched []atomic.Bool
	// echoID is a real reservation id (its JSON token) and echoReplies
	// the echo responders' replies by subject: a real reserve's and a
	// real settle's (or release's).
	echoID      []byte
	echoReplies map[string][]byte
}

// newResBench probes one reservation (reserved and settled at 0, or
// released), on a key of its own outside the run's, for the echo
// replies: the dry-run reply the policy wait got has no reservation in it.
func newResBench(ctx context.Context, nc *nats.Conn, r *benchRun) (*resBench, error) {
	p, c := r.plan, r.c
	rb := &resBench{r: r, plan: p, rp: p.res, slots: make([]slotTally, c.Keys), touched: make([]atomic.Bool, c.Keys)}
	body := append(fmt.Appendf(nil, `{"descriptor":{"bench_run":%q,"key":"probe`, p.run), p.res.costPre...)
	body = append(kvstate.AppendUnits(body, p.cost), p.res.costPost...)
	msg, err := nc.RequestWithContext(ctx, p.decideSubj, body)
	if err != nil {
		return nil, fmt.Errorf("probe reservation: %v", err)
	}
	allowed, ok := p.scanReply(msg.Data)
	id, idOK := scanReservation(msg.Data)
	if !allowed || !ok || !idOK {
		return nil, fmt.Errorf("probe reservation of --cost %s on an unused key: not admitted: %s", c.Cost, msg.Data)
	}
	end, err := nc.RequestWithContext(ctx, p.res.endSubj, p.appendEnd(nil, id, 0))
	if err != nil {
		return nil, fmt.Errorf("probe reservation's end: %v", err)
	}
	if !p.endConfirmed(end.Data, 0) {
		return nil, fmt.Errorf("probe reservation's end: %s", end.Data)
	}
	rb.echoID = bytes.Clone(id)
	rb.echoReplies = map[string][]byte{p.echoSubj: bytes.Clone(msg.Data), p.res.echoEndSubj: bytes.Clone(end.Data)}
	return rb, nil
}

// attach gives the phases their loops and the workers their state;
// worker i of either phase draws the same costs, settles and holds.
func (rb *resBench) attach(echo, measured *phase, tally []keyTally) {
	rb.tally = tally
	for _, ph := range []*phase{echo, measured} {
		for i, w := range ph.workers {
			w.res = &resWorker{rng: rand.New(rand.NewPCG(rb.r.c.Seed, uint64(i)<<32|0xa5a5))}
		}
	}
	echo.loop = rb.echoLoop
	measured.loop = rb.work
	measured.name = "reserve"
	if rb.rp.concurrency {
		measured.name = "acquire"
	}
}

// drawCost returns a reserve's cost: --cost, or uniform in 1..--cost
// micro-units with --random-cost.
func (rb *resBench) drawCost(rw *resWorker) int64 {
	if rb.rp.randomCost {
		return 1 + rw.rng.Int64N(rb.plan.cost)
	}
	return rb.plan.cost
}

// drawHold returns a hold's time (concurrency mode), uniform in 0..--hold.
func (rb *resBench) drawHold(rw *resWorker) time.Duration {
	if !rb.rp.concurrency || rb.rp.hold <= 0 {
		return 0
	}
	return time.Duration(rw.rng.Int64N(int64(rb.rp.hold) + 1))
}

// drawEnd returns the units a settle keeps spent (uniform in 0..cost; 0
// for a release) and whether the reservation is abandoned instead.
func (rb *resBench) drawEnd(rw *resWorker, cost int64) (units int64, abandon bool) {
	if rb.rp.abandon > 0 && rw.rng.Float64() < rb.rp.abandon {
		return 0, true
	}
	if rb.rp.concurrency {
		return 0, false
	}
	return rw.rng.Int64N(cost + 1), false
}

// request sends body to subject and counts what goes wrong as work does;
// code is the service error code of an error reply ("" for none).
func (rb *resBench) request(w *worker, subject string, body []byte) (msg *nats.Msg, code string, ok bool) {
	w.res.requests++
	msg, err := w.slot.request(subject, body, rb.r.c.Timeout)
	if err != nil {
		w.errs.Add(1)
		if errors.Is(err, nats.ErrTimeout) {
			w.timeouts++
			return nil, "", false
		}
		// No responders or a broken connection fail at once: pause
		// rather than spin.
		w.failed++
		time.Sleep(10 * time.Millisecond)
		return nil, "", false
	}
	if code = msg.Header.Get("Nats-Service-Error-Code"); code != "" {
		return msg, code, false
	}
	return msg, "", true
}

// countError counts an error reply of code.
func countError(w *worker, code string) {
	w.errs.Add(1)
	if code == "503" {
		w.unavailable++
	} else {
		w.failed++
	}
}

// work is a worker's loop in the measured phase of a reserve mode until
// stop (one slice). A pair in progress is finished, so no reservation is
// left open by the end of a slice.
func (rb *resBench) work(w *worker, stop *atomic.Bool) {
	rw, base := w.res, rb.r.base.UnixNano()
	for !stop.Load() {
		k := w.pick.next()
		cost := rb.drawCost(rw)
		w.body = rb.plan.appendReserve(w.body[:0], k, cost)
		if !rb.touched[k].Load() {
			rb.touched[k].Store(true)
		}
		t0 := time.Now()
		msg, code, ok := rb.request(w, rb.plan.decideSubj, w.body)
		t1 := time.Now()
		if !ok {
			if msg != nil {
				countError(w, code)
			}
			continue
		}
		allowed, matched := rb.plan.scanReply(msg.Data)
		var id []byte
		if allowed && matched {
			id, matched = scanReservation(msg.Data)
		}
		if !matched {
			w.unmatched++
			w.errs.Add(1)
			continue
		}
		if !allowed {
			w.denied++
			w.done.Add(1)
			continue
		}
		w.admitted++
		rw.id = append(rw.id[:0], id...)
		// Wall-clock instants, as nodes decide on the wall clock.
		sent, received := t0.UnixNano()-base, t1.UnixNano()-base
		units, abandon := rb.drawEnd(rw, cost)
		if rb.rp.concurrency {
			rb.tally[k].add(cost, sent, received)
			rb.acquired(k, cost)
			time.Sleep(rb.drawHold(rw))
			rb.slots[k].held.Add(-cost) // before the release is sent
		}
		if abandon {
			rw.abandoned++
			if !rb.rp.concurrency {
				rb.tally[k].add(cost, sent, received) // spent at its reserved cost when it expires
			}
			w.done.Add(1)
			continue
		}
		rw.end = rb.plan.appendEnd(rw.end[:0], rw.id, units)
		t2 := time.Now()
		confirmed, expired, retried := rb.end(w, units)
		t3 := time.Now()
		if !rb.rp.concurrency {
			switch {
			case expired && !retried:
				rb.tally[k].add(cost, sent, received)
			default:
				// Settled, or an outcome bench did not learn: at least
				// units stay spent.
				rb.tally[k].add(units, sent, received)
			}
		}
		if confirmed {
			w.hist.record(int64(t1.Sub(t0) + t3.Sub(t2)))
		}
		w.done.Add(1)
	}
}

// acquired adds cost to key k's held units and notes any excess.
func (rb *resBench) acquired(k int, cost int64) {
	st := &rb.slots[k]
	over := st.held.Add(cost) - rb.rp.capacity
	for over > 0 {
		e := st.excess.Load()
		if over <= e || st.excess.CompareAndSwap(e, over) {
			break
		}
	}
}

// end sends the worker's settle (keeping units) or release body until the node answers it:
// confirmed when the reply is the end asked for, expired on a 404 (retried
// when it followed a send without answer). A repeat returns the first
// outcome, so sending again is safe.
func (rb *resBench) end(w *worker, units int64) (confirmed, expired, retried bool) {
	rw := w.res
	for attempt := range endAttempts {
		retried = attempt > 0
		msg, code, ok := rb.request(w, rb.rp.endSubj, rw.end)
		switch {
		case ok:
			if rb.plan.endConfirmed(msg.Data, units) {
				return true, false, retried
			}
			w.unmatched++
			w.errs.Add(1)
			rw.endUnknown++
			return false, false, retried
		case code == "404":
			rw.expired++
			return false, true, retried
		case code == "503" || msg == nil:
			if msg != nil {
				countError(w, code)
			}
			continue // no answer, or the owner was unavailable: again
		default:
			countError(w, code)
			rw.endUnknown++
			return false, false, retried
		}
	}
	rw.endUnknown++
	return false, false, retried
}

// echoLoop is a worker's loop in the echo phase of a reserve mode: the
// same requests, holds and draws against the echo responders.
func (rb *resBench) echoLoop(w *worker, stop *atomic.Bool) {
	rw := w.res
	echoEnd := rb.rp.echoEndSubj
	for !stop.Load() {
		k := w.pick.next()
		cost := rb.drawCost(rw)
		w.body = rb.plan.appendReserve(w.body[:0], k, cost)
		t0 := time.Now()
		if _, code, ok := rb.request(w, rb.plan.echoSubj, w.body); !ok {
			if code != "" {
				countError(w, code)
			}
			continue
		}
		t1 := time.Now()
		units, abandon := rb.drawEnd(rw, cost)
		time.Sleep(rb.drawHold(rw))
		if abandon {
			w.done.Add(1)
			continue
		}
		rw.end = rb.plan.appendEnd(rw.end[:0], rb.echoID, units)
		t2 := time.Now()
		if _, code, ok := rb.request(w, echoEnd, rw.end); !ok {
			if code != "" {
				countError(w, code)
			}
			continue
		}
		t3 := time.Now()
		w.hist.record(int64(t1.Sub(t0) + t3.Sub(t2)))
		w.done.Add(1)
	}
}
