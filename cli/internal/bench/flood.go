package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/limitmesh/limitmesh/cli/internal/clitext"
	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/policies"
)

// The flood (`limitmesh bench --flood F`): next to the measured load, a
// second load of requests that are over their limit, on another tenant's
// key, so that a run shows what rejected traffic costs the others
// (reference §30 item 14).
//
// The flood tenant has a policy of its own, bench-flood-<run>, matching
// bench_run=<run> and bench_flood=1 (more exact entries than the measured
// policy, so it wins for those descriptors), with one token_bucket limit
// of --flood-rate and --flood-burst, in --mode, and one limit key. Its
// capacity is --flood-rate; the flood offers F times that, open loop:
// requests are published at a steady pace on a connection of their own
// whatever the replies do (a flooding client does not wait), so all but
// about 1/F of them are denied. At most floodMaxOutstanding requests are
// left unanswered at once; a request due beyond that is skipped and
// counted. The flood runs from before the first slice to after the last,
// and its figures cover that whole time.
//
// Paired runs (with and without --flood, alternately) compare the measured
// load's decisions/s and p99 (with a --rate high enough that every
// measured request is admitted, its p99 is the admitted p99).

// FloodConfig is the flood (--flood, --flood-rate, --flood-burst).
type FloodConfig struct {
	Factor float64 // of the flood tenant's capacity offered; 0: no flood
	Rate   string  // token_bucket rate of the flood tenant's key (its capacity)
	Burst  string  // token_bucket burst of the flood tenant's key
}

// floodMaxOutstanding bounds the flood's unanswered requests.
const floodMaxOutstanding = 20_000

func (f *FloodConfig) validate() error {
	if f.Factor == 0 {
		return nil
	}
	if f.Factor < 0 || f.Factor > 1e6 || math.IsNaN(f.Factor) {
		return fmt.Errorf("--flood %g: must be 0..1000000", f.Factor)
	}
	if _, err := f.perSecond(); err != nil {
		return err
	}
	return nil
}

// policyDoc is the flood tenant's policy for run in mode.
func (f *FloodConfig) policyDoc(run, mode string) []byte {
	rate, _ := json.Marshal(f.Rate)
	return fmt.Appendf(nil, `{"match":{"bench_run":%q,"bench_flood":"1"},"key":["bench_run","bench_flood"],`+
		`"limits":[{"name":"rate","algorithm":"token_bucket","rate":%s,"burst":%s}],`+
		`"mode":%q,"description":"limitmesh bench flood %s"}`, run, rate, clitext.NumberJSON(f.Burst), mode, run)
}

// perSecond returns the requests per second the flood offers: factor
// times --flood-rate.
func (f *FloodConfig) perSecond() (float64, error) {
	p, err := policies.Parse("bench-flood", f.policyDoc("x", "strict"))
	if err != nil {
		return 0, fmt.Errorf("--flood-rate %q / --flood-burst %q: %v", f.Rate, f.Burst, err)
	}
	l := p.Limits[0].Limit
	per := l.RatePer
	if per == 0 {
		per = kvstate.Second
	}
	return f.Factor * float64(l.Rate) / float64(kvstate.Unit) * float64(kvstate.Second) / float64(per), nil
}

// FloodReport is the flood's part of the --json line.
type FloodReport struct {
	Factor     float64 `json:"factor"`
	Rate       string  `json:"rate"`
	OfferedPS  float64 `json:"offered_per_sec"`
	Sent       int64   `json:"sent"`
	RepliesPS  float64 `json:"replies_per_sec"`
	Admitted   int64   `json:"admitted"`
	Denied     int64   `json:"denied"`
	Errors     int64   `json:"errors"`
	Skipped    int64   `json:"skipped"`
	DurationS  float64 `json:"duration_s"`
	Unanswered int64   `json:"unanswered"`
}

// flood is a running flood load.
type flood struct {
	cfg     *FloodConfig
	perSec  float64
	nc      *nats.Conn
	subject string
	body    []byte
	inbox   string
	sub     *nats.Subscription

	sent, replies, admitted, denied, errors, skipped atomic.Int64

	start   time.Time
	elapsed time.Duration
	stop    chan struct{}
	wg      sync.WaitGroup
}

// startFlood installs the flood tenant's policy in kv (removed by the
// returned cleanup, with the load stopped), waits until a node decides
// with it, and starts the load on a connection of its own. It returns a
// nil flood when --flood is 0.
func startFlood(ctx context.Context, c *Config, plan *benchPlan, kv jetstream.KeyValue,
	connect func(string) (*nats.Conn, error), progress io.Writer) (*flood, func(), error) {
	if c.Flood.Factor == 0 {
		return nil, func() {}, nil
	}
	perSec, err := c.Flood.perSecond()
	if err != nil {
		return nil, nil, err
	}
	name := "bench-flood-" + plan.run
	doc := c.Flood.policyDoc(plan.run, string(c.Mode))
	var undo []func()
	cleanup := func() {
		for i := len(undo) - 1; i >= 0; i-- {
			undo[i]()
		}
	}
	rev, err := kv.Put(ctx, name, doc)
	if err != nil {
		return nil, nil, fmt.Errorf("put policy %s: %v", name, err)
	}
	undo = append(undo, func() {
		dctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = kv.Delete(dctx, name)
	})
	nc, err := connect("limitmesh-bench-flood")
	if err != nil {
		cleanup()
		return nil, nil, err
	}
	undo = append(undo, nc.Close)
	f := &flood{cfg: &c.Flood, perSec: perSec, nc: nc, subject: plan.decideSubj,
		body:  fmt.Appendf(nil, `{"descriptor":{"bench_run":%q,"bench_flood":"1"},"cost":%s}`, plan.run, strconv.Quote(c.Cost)),
		inbox: nc.NewInbox(), stop: make(chan struct{})}
	if err := f.waitPolicy(ctx, name, rev, c.Timeout); err != nil {
		cleanup()
		return nil, nil, err
	}
	quoted := strconv.AppendQuote(nil, name)
	if f.sub, err = nc.Subscribe(f.inbox, func(m *nats.Msg) { f.reply(m, quoted) }); err != nil {
		cleanup()
		return nil, nil, err
	}
	_ = f.sub.SetPendingLimits(-1, -1)
	logf(progress, "bench: flood policy %s (revision %d): token_bucket %s burst %s; offering %.0f requests/s (%g x its rate)",
		name, rev, c.Flood.Rate, c.Flood.Burst, perSec, c.Flood.Factor)
	f.start = time.Now()
	f.wg.Add(1)
	go f.run()
	undo = append(undo, f.halt)
	return f, cleanup, nil
}

// waitPolicy polls with dry runs until a node decides the flood's
// descriptor with policy name at revision rev or later.
func (f *flood) waitPolicy(ctx context.Context, name string, rev uint64, timeout time.Duration) error {
	body := append(bytes.TrimSuffix(bytes.Clone(f.body), []byte("}")), `,"dry_run":true}`...)
	deadline := time.Now().Add(5 * time.Second)
	for {
		msg, err := f.nc.Request(f.subject, body, timeout)
		if errors.Is(err, nats.ErrNoResponders) {
			return fmt.Errorf("no limitmesh node answers on %s", f.subject)
		}
		if err == nil {
			var r decideReply
			if json.Unmarshal(msg.Data, &r) == nil && r.Policy == name && r.Revision >= rev {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no node applied policy %s within 5s", name)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// reply counts one reply (on the subscription's goroutine).
func (f *flood) reply(m *nats.Msg, quotedPolicy []byte) {
	f.replies.Add(1)
	switch {
	case m.Header.Get("Nats-Service-Error-Code") != "" || !bytes.Contains(m.Data, quotedPolicy):
		f.errors.Add(1)
	case bytes.Contains(m.Data, []byte(`"allowed":true`)):
		f.admitted.Add(1)
	default:
		f.denied.Add(1)
	}
}

// run publishes the flood at its pace until halt: every millisecond, the
// requests due since the start and not yet sent, unless
// floodMaxOutstanding are unanswered (those are skipped).
func (f *flood) run() {
	defer f.wg.Done()
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	var handled int64 // sent + skipped
	for {
		select {
		case <-f.stop:
			return
		case <-tick.C:
		}
		due := int64(time.Since(f.start).Seconds() * f.perSec)
		for ; handled < due; handled++ {
			if f.sent.Load()-f.replies.Load() >= floodMaxOutstanding {
				f.skipped.Add(due - handled)
				handled = due
				break
			}
			if f.nc.PublishRequest(f.subject, f.inbox, f.body) != nil {
				f.errors.Add(1)
				continue
			}
			f.sent.Add(1)
		}
	}
}

// halt stops the load and gives the replies in flight a moment to come.
func (f *flood) halt() {
	select {
	case <-f.stop:
		return
	default:
	}
	close(f.stop)
	f.wg.Wait()
	f.elapsed = time.Since(f.start)
	deadline := time.Now().Add(2 * time.Second)
	for f.replies.Load() < f.sent.Load() && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	_ = f.sub.Unsubscribe()
}

// report stops the flood (if it still runs) and returns its figures; nil
// for no flood.
func (f *flood) report() *FloodReport {
	if f == nil {
		return nil
	}
	f.halt()
	r := &FloodReport{
		Factor: f.cfg.Factor, Rate: f.cfg.Rate, OfferedPS: math.Round(f.perSec),
		Sent: f.sent.Load(), Admitted: f.admitted.Load(), Denied: f.denied.Load(),
		Errors: f.errors.Load(), Skipped: f.skipped.Load(),
		DurationS:  math.Round(f.elapsed.Seconds()*1e3) / 1e3,
		Unanswered: f.sent.Load() - f.replies.Load(),
	}
	if f.elapsed > 0 {
		r.RepliesPS = math.Round(float64(f.replies.Load()) / f.elapsed.Seconds())
	}
	return r
}

// maxKeysJSON is the bench policy's max_keys field, or nothing.
func maxKeysJSON(n int64) string {
	if n <= 0 {
		return ""
	}
	return `,"max_keys":` + strconv.FormatInt(n, 10)
}
