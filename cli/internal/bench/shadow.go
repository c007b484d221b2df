package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/limitmesh/limitmesh/shadow"
)

// `limitmesh bench --candidates N` puts N shadow candidates (CONTRACT.md
// §7) on the bench run's descriptors before the first slice, so that the
// deployment's shadow evaluator replays every decision of the run through
// each of them, and reports how far the evaluation lagged behind the
// decisions. Comparing runs with --candidates 0 and 10 shows what the
// candidates cost the decision path: nothing but the evaluator's CPU, as
// live decisions ignore them.
//
// Lag. The evaluator writes each candidate's summary at least once a second
// with last_us (the t_us of the newest record it has evaluated) and
// updated_us (when it wrote). At a write, every record not yet evaluated
// was decided after last_us, so updated_us - last_us bounds the age of the
// oldest of them from above; it also counts the time a record waits in its
// node before it is published (--usage-interval of serve, 250 ms by
// default). bench watches one candidate's summary and takes that bound at
// every write that evaluated more records than the previous one and is
// followed by one that did too (the writes during echo slices, when no
// decision is made, and the last write of each decide slice, when none
// was made since last_us, measure idle time, not lag). Both
// times are read from clocks of the deployment (the deciding node's and
// the evaluator's; the same clock for the embedded node). After the last
// slice, bench waits until the summaries count every decision of the run
// and reports how long that took (catch_up_s).

// maxBenchCandidates bounds --candidates.
const maxBenchCandidates = 100

// benchCandidateDoc returns the document of the bench run's candidate i:
// all match the run's descriptors; they cycle through the algorithms, most
// keyed like the bench policy, some by run only.
func benchCandidateDoc(run string, i int) []byte {
	limits := []string{
		`[{"algorithm":"token_bucket","rate":"500/s","burst":50}]`,
		`[{"algorithm":"gcra","rate":"200/s","burst":20}]`,
		`[{"algorithm":"fixed_window","limit":100,"window":"1s"}]`,
		`[{"algorithm":"sliding_window","limit":5000,"window":"1s"}]`,
		`[{"name":"rate","algorithm":"token_bucket","rate":"100/s","burst":100},{"name":"minute","algorithm":"fixed_window","limit":3000,"window":"1m"}]`,
	}[i%5]
	key := `["bench_run","key"]`
	if i%5 == 3 {
		key = `["bench_run"]`
	}
	return fmt.Appendf(nil, `{"match":{"bench_run":%q},"key":%s,"limits":%s,"shadow":true,"description":"limitmesh bench run %s, candidate %d"}`,
		run, key, limits, run, i)
}

// benchShadowName is the name of the bench run's candidate i.
func benchShadowName(run string, i int) string { return "bench-shadow-" + run + "-" + strconv.Itoa(i) }

// benchShadow is a run's candidates and the lag watch on them.
type benchShadow struct {
	names    []string
	policies jetstream.KeyValue
	sums     jetstream.KeyValue
	stop     context.CancelFunc
	done     chan struct{}

	mu       sync.Mutex
	lags     []time.Duration // updated_us - last_us at writes that evaluated more, followed by one that did too
	pending  time.Duration   // the last such bound, until the next write says whether traffic went on
	lastEval uint64
}

// ShadowReport is the --json "shadow" object of a run with candidates.
type ShadowReport struct {
	Candidates int `json:"candidates"`
	// LagSamples is the number of summary writes the lag figures are taken
	// from; LagP50s and LagMaxS are the median and largest of their
	// updated_us - last_us, seconds.
	LagSamples int     `json:"lag_samples"`
	LagP50S    float64 `json:"lag_p50_s"`
	LagMaxS    float64 `json:"lag_max_s"`
	// Evaluated is what the watched candidate's summary counts at the end
	// (at least the run's decisions once caught up); CatchUpS is how long
	// after the last slice it took to count them (-1: not within 60 s).
	Evaluated uint64  `json:"evaluated"`
	CatchUpS  float64 `json:"catch_up_s"`
}

// startBenchShadow puts n candidates on plan's descriptors in the policy
// bucket policies of the installation prefix (none when n is
// 0: it returns nil), waits until the evaluator has written a summary of
// each (so it evaluates the run from its first decision) and starts
// watching the first one's.
func startBenchShadow(ctx context.Context, js jetstream.JetStream, prefix string, policies jetstream.KeyValue, n int, plan *benchPlan, progress io.Writer) (*benchShadow, error) {
	if n == 0 {
		return nil, nil
	}
	b := &benchShadow{policies: policies, done: make(chan struct{}), pending: -1}
	for i := range n {
		name := benchShadowName(plan.run, i)
		if _, err := policies.Put(ctx, name, benchCandidateDoc(plan.run, i)); err != nil {
			b.remove()
			return nil, fmt.Errorf("put candidate %s: %v", name, err)
		}
		b.names = append(b.names, name)
	}
	const wait = 30 * time.Second
	wctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	for {
		var err error
		if b.sums == nil {
			b.sums, err = js.KeyValue(wctx, shadow.Bucket(prefix))
		}
		if err == nil && b.allSummaries(wctx) {
			break
		}
		if !sleepCtx(wctx, 100*time.Millisecond) {
			b.remove()
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			return nil, fmt.Errorf("no shadow evaluator wrote summaries of the %d candidates within %v (does the deployment publish usage?)", n, wait)
		}
	}
	logf(progress, "bench: %d shadow candidates on the run's descriptors (%s ... %s)", n, b.names[0], b.names[n-1])
	w, err := b.sums.Watch(ctx, b.names[0], jetstream.UpdatesOnly())
	if err != nil {
		b.remove()
		return nil, fmt.Errorf("watch the summary of %s: %v", b.names[0], err)
	}
	wctx2, stop := context.WithCancel(ctx)
	b.stop = stop
	go func() { // the watch's updates until finish
		defer close(b.done)
		defer w.Stop()
		for {
			select {
			case <-wctx2.Done():
				return
			case e, ok := <-w.Updates():
				if !ok {
					return
				}
				if e != nil {
					b.sample(e.Value())
				}
			}
		}
	}()
	return b, nil
}

// allSummaries reports whether every candidate has a summary.
func (b *benchShadow) allSummaries(ctx context.Context) bool {
	for _, n := range b.names {
		if _, err := b.sums.Get(ctx, n); err != nil {
			return false
		}
	}
	return true
}

// sample takes the lag bound of one summary write of the watched
// candidate, when it evaluated more records than the previous one and the
// next write does too. The last write of a slice that made progress is
// left out: no decision came after its last_us, so updated_us - last_us
// is the time since the slice ended, not a lag.
func (b *benchShadow) sample(v []byte) {
	var s shadow.Summary
	if json.Unmarshal(v, &s) != nil {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if s.Evaluated <= b.lastEval || s.LastUs == 0 || s.UpdatedUs == 0 {
		b.pending = -1
		return
	}
	b.lastEval = s.Evaluated
	if b.pending >= 0 {
		b.lags = append(b.lags, b.pending)
	}
	b.pending = time.Duration(max(0, s.UpdatedUs-s.LastUs)) * time.Microsecond
}

// finish waits (at most a minute) until the watched candidate's summary
// counts decisions records, stops the watch and returns the figures.
func (b *benchShadow) finish(ctx context.Context, decisions int64, progress io.Writer) *ShadowReport {
	if b == nil {
		return nil
	}
	rep := &ShadowReport{Candidates: len(b.names), CatchUpS: -1}
	began := time.Now()
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for rep.CatchUpS < 0 {
		if e, err := b.sums.Get(wctx, b.names[0]); err == nil {
			var s shadow.Summary
			if json.Unmarshal(e.Value(), &s) == nil {
				rep.Evaluated = s.Evaluated
				if s.Evaluated >= uint64(max(decisions, 0)) {
					rep.CatchUpS = math.Round(time.Since(began).Seconds()*1e3) / 1e3
					continue
				}
			}
		}
		if !sleepCtx(wctx, 50*time.Millisecond) {
			logf(progress, "bench: the shadow evaluator counted %d of %d decisions a minute after the run", rep.Evaluated, decisions)
			break
		}
	}
	b.stop()
	<-b.done
	b.mu.Lock()
	lags := slices.Clone(b.lags)
	b.mu.Unlock()
	slices.Sort(lags)
	rep.LagSamples = len(lags)
	if len(lags) > 0 {
		rep.LagP50S = math.Round(lags[(len(lags)-1)/2].Seconds()*1e3) / 1e3
		rep.LagMaxS = math.Round(lags[len(lags)-1].Seconds()*1e3) / 1e3
	}
	return rep
}

// remove deletes the candidates (with a deadline of its own: it runs at
// the end, also after ctx ended).
func (b *benchShadow) remove() {
	if b == nil {
		return
	}
	if b.stop != nil {
		b.stop()
		<-b.done
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, n := range b.names {
		if err := b.policies.Delete(ctx, n); err != nil && !errors.Is(err, jetstream.ErrKeyNotFound) {
			return
		}
	}
}

// sleepCtx waits d or until ctx ends; it reports whether d passed.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
