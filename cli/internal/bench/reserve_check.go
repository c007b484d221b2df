package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/limitmesh/limitmesh/cli/internal/clitext"
	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/policies"
)

// The leak check of the reserve modes. After the last slice every key a
// reserve was sent for must come back to full, and no reservation of the
// bench policy may stay open: each ends by its settle or release, or by
// expiry at its ttl. bench polls, every leakPoll, until both hold or
// --leak-wait passes (default: --ttl, or a reserve key's time to fill up
// from empty if longer, plus 2s for the nodes' expiry sweeps):
//
//   - keys: a dry-run reserve of the key's whole capacity (the burst; the
//     slots) must be admitted; a denied one's "remaining" is what the key
//     has, and capacity minus remaining is missing (leaked_units summed,
//     leaked_keys counted, at the last poll). A key once full is not asked
//     again (nothing runs after the run to take from it). A token bucket
//     refills with time whatever is open on it, so in reserve mode this
//     finds units a settle took for good, and the gauge below finds the
//     reservations left open; a concurrency slot left open keeps its key
//     below full until it expires;
//   - open_reservations: limitmesh_reservations_open{policy=<the bench
//     policy>} summed over the nodes' /metrics (the embedded node's
//     served on a loopback port; a deployment's from --metrics-url, else
//     not measured and absent from --json). limitmesh_reservations_total
//     of the policy is reported beside it (reservations_ended, by
//     outcome).
//
// A run whose workers abandon reservations (--abandon) with a --ttl longer
// than --leak-wait fails the check: that is how the check is shown to work.

// leakPoll is the leak check's poll interval.
const leakPoll = 50 * time.Millisecond

// leakMargin is added to the longer of --ttl and a key's time to fill.
const leakMargin = 2 * time.Second

// ResReport is the reserve modes' part of the report (embedded in
// Report, its fields are the --json line's).
type ResReport struct {
	Requests        int64   `json:"requests"`
	CPUPerPairUs    float64 `json:"cpu_us_per_pair"`
	CPUPerRequestUs float64 `json:"cpu_us_per_request"`
	TTL             string  `json:"ttl"`
	Slots           string  `json:"slots,omitempty"`
	HoldMaxMs       float64 `json:"hold_max_ms,omitempty"`
	RandomCost      bool    `json:"random_cost"`
	Abandon         float64 `json:"abandon"`
	Abandoned       int64   `json:"abandoned"`
	// Ends answered 404 (the reservation had expired) and ends whose
	// outcome bench never learned.
	ExpiredBeforeEnd int64 `json:"expired_before_end"`
	EndUnknown       int64 `json:"end_unknown"`
	// The leak check.
	LeakedUnits       float64            `json:"leaked_units"`
	LeakedKeys        int                `json:"leaked_keys"`
	KeysChecked       int                `json:"keys_checked"`
	OpenReservations  *float64           `json:"open_reservations,omitempty"`
	ReservationsEnded map[string]float64 `json:"reservations_ended,omitempty"`
	LeakWaitS         float64            `json:"leak_wait_s"`
	LeakWait          time.Duration      `json:"-"` // the longest the check could wait
	LeakedMicro       int64              `json:"-"` // LeakedUnits in micro-units
	MetricsErr        error              `json:"-"` // why OpenReservations is nil, against a node whose metrics were read
}

// leakWaitFor returns how long the leak check may wait.
func leakWaitFor(c *Config, l kvstate.Limit) time.Duration {
	if c.Reserve.LeakWait > 0 {
		return c.Reserve.LeakWait
	}
	wait := c.Reserve.TTL
	if l.Algorithm == kvstate.TokenBucket && l.Rate > 0 {
		per := l.RatePer
		if per == 0 {
			per = kvstate.Second
		}
		fill := float64(l.Burst) / float64(l.Rate) * float64(per)
		wait = max(wait, time.Duration(min(fill, float64(time.Hour))))
	}
	return wait + leakMargin
}

// checkLeaks runs the leak check over the load connections' slots (idle
// after the run) and fills rep's leak fields.
func (rb *resBench) checkLeaks(ctx context.Context, rep *ResReport, metricsURLs []string, progress io.Writer) {
	c := rb.r.c
	var pending []int
	for k := range rb.touched {
		if rb.touched[k].Load() {
			pending = append(pending, k)
		}
	}
	rep.KeysChecked = len(pending)
	wait := leakWaitFor(c, rb.plan.limit)
	rep.LeakWait = wait
	logf(progress, "bench: leak check: %d keys back to full and no reservation open, waiting up to %v", len(pending), wait)
	start := time.Now()
	deadline := start.Add(wait)
	for {
		var missing int64
		pending, missing = rb.dryRunKeys(pending)
		rep.LeakedMicro, rep.LeakedKeys = missing, len(pending)
		rep.OpenReservations, rep.ReservationsEnded, rep.MetricsErr = nil, nil, nil
		if len(metricsURLs) > 0 {
			open, ended, err := scrapeReservations(ctx, metricsURLs, rb.plan.policyName, c.Timeout)
			if err != nil {
				rep.MetricsErr = err
			} else {
				rep.OpenReservations, rep.ReservationsEnded = &open, ended
			}
		}
		clean := len(pending) == 0 && rep.MetricsErr == nil && (rep.OpenReservations == nil || *rep.OpenReservations == 0)
		if clean || !time.Now().Before(deadline) || !sleepCtx(ctx, min(leakPoll, time.Until(deadline))) {
			break
		}
	}
	rep.LeakWaitS = math.Round(time.Since(start).Seconds()*1e3) / 1e3
	rep.LeakedUnits = float64(rep.LeakedMicro) / float64(kvstate.Unit)
}

// dryRunKeys asks, for each key in keys, a dry-run reserve of its whole
// capacity, spread over the load slots; it returns the keys not full
// (those whose reply was denied, or did not come) and the units they
// miss.
func (rb *resBench) dryRunKeys(keys []int) (notFull []int, missing int64) {
	var slots []*inboxSlot
	for _, lc := range rb.r.load {
		slots = append(slots, lc.slots...)
	}
	var (
		next   atomic.Int64
		mu     sync.Mutex
		wg     sync.WaitGroup
		suffix = []byte(`"},"cost":"` + string(kvstate.AppendUnits(nil, rb.rp.capacity)) + `","dry_run":true}`)
	)
	for _, s := range slots[:min(len(slots), len(keys))] {
		wg.Go(func() {
			var body []byte
			for {
				i := int(next.Add(1) - 1)
				if i >= len(keys) {
					return
				}
				k := keys[i]
				body = append(strconv.AppendInt(append(body[:0], rb.plan.bodyPre...), int64(k), 10), suffix...)
				full, miss := rb.dryRun(s, body)
				if !full {
					mu.Lock()
					notFull = append(notFull, k)
					missing += miss
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	return notFull, missing
}

// dryRun sends one dry-run reserve; full when admitted, else the units the
// key misses (0 when unknown: no reply, or one bench cannot read).
func (rb *resBench) dryRun(s *inboxSlot, body []byte) (full bool, missing int64) {
	msg, err := s.request(rb.plan.decideSubj, body, rb.r.c.Timeout)
	if err != nil || msg.Header.Get("Nats-Service-Error-Code") != "" {
		return false, 0
	}
	var r decideReply
	if json.Unmarshal(msg.Data, &r) != nil || r.Policy != rb.plan.policyName {
		return false, 0
	}
	if r.Allowed {
		return true, 0
	}
	have := int64(0)
	if s := r.Remaining.String(); s != "0" {
		if v, err := policies.ParseCost(s); err == nil {
			have = v
		}
	}
	return false, max(rb.rp.capacity-have, 0)
}

// scrapeReservations reads the nodes' /metrics and returns the policy's
// open reservations (summed; a node without the series has none) and its
// ended reservations by outcome.
func scrapeReservations(ctx context.Context, urls []string, policy string, timeout time.Duration) (float64, map[string]float64, error) {
	var open float64
	ended := map[string]float64{}
	hc := &http.Client{Timeout: timeout}
	for _, u := range urls {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
		if err != nil {
			return 0, nil, err
		}
		resp, err := hc.Do(req)
		if err != nil {
			return 0, nil, fmt.Errorf("metrics %s: %v", clitext.RedactURL(u), err)
		}
		body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
		resp.Body.Close()
		if err != nil {
			return 0, nil, fmt.Errorf("metrics %s: %v", clitext.RedactURL(u), err)
		}
		if resp.StatusCode != http.StatusOK {
			return 0, nil, fmt.Errorf("metrics %s: %s", clitext.RedactURL(u), resp.Status)
		}
		open += reservationMetrics(body, policy, ended)
	}
	return open, ended, nil
}

// reservationMetrics reads the Prometheus text exposition b: it returns
// limitmesh_reservations_open of policy and adds its
// limitmesh_reservations_total to ended by outcome.
func reservationMetrics(b []byte, policy string, ended map[string]float64) (open float64) {
	for line := range bytes.SplitSeq(b, []byte("\n")) {
		name, labels, v, ok := promSample(line)
		if !ok || labels["policy"] != policy {
			continue
		}
		switch name {
		case "limitmesh_reservations_open":
			open += v
		case "limitmesh_reservations_total":
			ended[labels["outcome"]] += v
		}
	}
	return open
}

// promSample parses one sample line of the Prometheus text format:
// name{label="value",...} value [timestamp]. ok is false for comments,
// blank lines and anything it cannot read.
func promSample(line []byte) (name string, labels map[string]string, v float64, ok bool) {
	line = bytes.TrimSpace(line)
	if len(line) == 0 || line[0] == '#' {
		return "", nil, 0, false
	}
	i := bytes.IndexAny(line, "{ \t")
	if i <= 0 {
		return "", nil, 0, false
	}
	name, rest := string(line[:i]), line[i:]
	labels = map[string]string{}
	if rest[0] == '{' {
		rest = rest[1:]
		for {
			rest = bytes.TrimLeft(rest, " \t,")
			if len(rest) > 0 && rest[0] == '}' {
				rest = rest[1:]
				break
			}
			eq := bytes.IndexByte(rest, '=')
			if eq <= 0 || eq+1 >= len(rest) || rest[eq+1] != '"' {
				return "", nil, 0, false
			}
			key := string(bytes.TrimSpace(rest[:eq]))
			val := rest[eq+1:]
			end := -1
			for j := 1; j < len(val); j++ {
				if val[j] == '\\' {
					j++
				} else if val[j] == '"' {
					end = j
					break
				}
			}
			if end < 0 {
				return "", nil, 0, false
			}
			s, err := strconv.Unquote(string(val[:end+1]))
			if err != nil {
				return "", nil, 0, false
			}
			labels[key] = s
			rest = val[end+1:]
		}
	}
	fields := bytes.Fields(rest)
	if len(fields) == 0 {
		return "", nil, 0, false
	}
	v, err := strconv.ParseFloat(string(fields[0]), 64)
	if err != nil {
		return "", nil, 0, false
	}
	return name, labels, v, true
}

// reserveReport fills the reserve modes' figures of rep from the phases,
// and runs the leak check.
func (rb *resBench) reserveReport(ctx context.Context, rep *Report, echo, measured *phase, metricsURLs []string, progress io.Writer) {
	c := rb.r.c
	rr := &ResReport{TTL: c.Reserve.TTL.String(), RandomCost: rb.rp.randomCost, Abandon: rb.rp.abandon}
	for _, w := range measured.workers {
		rr.Requests += w.res.requests
		rr.Abandoned += w.res.abandoned
		rr.ExpiredBeforeEnd += w.res.expired
		rr.EndUnknown += w.res.endUnknown
	}
	rr.CPUPerRequestUs = cpuPer(measured.cpu, rr.Requests)
	if rr.Requests > 0 {
		rr.CPUPerPairUs = math.Round(2*float64(measured.cpu.Nanoseconds())/float64(rr.Requests)/10) / 100
	}
	if rb.rp.concurrency {
		rr.Slots = c.Slots()
		rr.HoldMaxMs = float64(rb.rp.hold.Microseconds()) / 1e3
		rep.OvershootMicro, rep.OvershootKeys = 0, 0
		for i := range rb.slots {
			if e := rb.slots[i].excess.Load(); e > 0 {
				rep.OvershootMicro += e
				rep.OvershootKeys++
			}
		}
		rep.Overshoot = float64(rep.OvershootMicro) / float64(kvstate.Unit)
	}
	rb.checkLeaks(ctx, rr, metricsURLs, progress)
	rep.ResReport = rr
}
