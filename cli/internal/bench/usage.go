package bench

import (
	"context"
	"errors"
	"math"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	lmusage "github.com/limitmesh/limitmesh/usage"
)

// The usage lag of a bench run: at the end of the last decide slice, how
// far the usage ledger is behind the usage stream (lmusage.MeasureLag): the
// age of the oldest record in the stream that the ledger's consumer has not
// acknowledged, and how many batches are in that state. Records the nodes
// still buffer (at most --usage-interval old) are not in the stream yet and
// not counted.

// measureUsageLag measures the lag of the deployment js reaches; nil
// figures and a note when there is none to measure (usage off, no stream,
// a failed request).
func measureUsageLag(ctx context.Context, js jetstream.JetStream, c *Config) (lagMs *float64, pending *uint64, note string) {
	if !c.Usage {
		return nil, nil, "off (--usage=false)"
	}
	mctx, cancel := context.WithTimeout(ctx, c.Timeout+5*time.Second)
	defer cancel()
	l, err := lmusage.MeasureLag(mctx, js, c.Prefix, time.Now())
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound):
		return nil, nil, "none (no usage stream " + lmusage.StreamName(c.Prefix) + ": usage is off)"
	case err != nil:
		return nil, nil, "not measured: " + err.Error()
	}
	ms := math.Round(float64(l.Oldest.Microseconds())) / 1e3
	return &ms, &l.Pending, ""
}

// The usage stream's bytes per decision of a bench run: the bytes the
// usage stream took during the decide phase (its state's bytes, which are
// what its max bytes limit counts: each message's subject, headers, body
// and the store's per-message overhead), divided by the decisions; and
// how long the stream's limits hold records at that many bytes per
// decision and the run's decisions per second: min(max age, max bytes /
// bytes per second, max msgs / messages per second). The state is read
// before the first decide slice and once the stream has stopped growing
// after the last (the nodes publish at least every --usage-interval). If
// the stream discarded messages meanwhile (it was full), the bytes added
// are estimated from the messages added and the mean size of those it
// holds. Against a deployment (--nats-url), whatever else its nodes
// decided meanwhile is counted too.

// usageStreamMark is the usage stream's state at one instant.
type usageStreamMark struct {
	firstSeq, lastSeq uint64
	msgs, bytes       uint64
	cfg               jetstream.StreamConfig
}

// markUsageStream reads the usage stream's state; ok false when there is
// none to read (usage off, no stream, a failed request).
func markUsageStream(ctx context.Context, js jetstream.JetStream, c *Config) (m usageStreamMark, ok bool) {
	if !c.Usage {
		return m, false
	}
	mctx, cancel := context.WithTimeout(ctx, c.Timeout+5*time.Second)
	defer cancel()
	s, err := js.Stream(mctx, lmusage.StreamName(c.Prefix))
	if err != nil {
		return m, false
	}
	info, err := s.Info(mctx)
	if err != nil {
		return m, false
	}
	st := info.State
	return usageStreamMark{firstSeq: st.FirstSeq, lastSeq: st.LastSeq, msgs: st.Msgs, bytes: st.Bytes, cfg: info.Config}, true
}

// settleUsageStream waits until the usage stream's last sequence has not
// moved for settle (at most limit), and returns its state then.
func settleUsageStream(ctx context.Context, js jetstream.JetStream, c *Config, settle, limit time.Duration) (usageStreamMark, bool) {
	deadline := time.Now().Add(limit)
	last, ok := markUsageStream(ctx, js, c)
	since := time.Now()
	for ok && time.Now().Before(deadline) && ctx.Err() == nil {
		time.Sleep(settle / 4)
		m, ok2 := markUsageStream(ctx, js, c)
		if !ok2 {
			break
		}
		if m.lastSeq != last.lastSeq {
			last, since = m, time.Now()
			continue
		}
		last = m
		if time.Since(since) >= settle {
			break
		}
	}
	return last, ok
}

// UsageStreamCost is what the decide phase cost the usage stream.
type UsageStreamCost struct {
	BytesPerDecision *float64      // nil: not measured (Note says why)
	RetentionHours   *float64      // nil: no limit bounds it
	Estimated        bool          // the stream discarded messages: bytes estimated
	MaxBytes         int64         // the stream's limits (<= 0: none)
	MaxAge           time.Duration //
	Note             string
}

// usageCost computes the decide phase's usage stream cost from the
// stream's state before and after it, the decisions and decisions per
// second.
func usageCost(before, after usageStreamMark, decisions int64, perSec float64) UsageStreamCost {
	out := UsageStreamCost{MaxBytes: after.cfg.MaxBytes, MaxAge: after.cfg.MaxAge}
	if decisions <= 0 {
		out.Note = "no decisions"
		return out
	}
	newMsgs := after.lastSeq - min(before.lastSeq, after.lastSeq)
	var added float64
	switch {
	case after.firstSeq == before.firstSeq || before.msgs == 0 && after.firstSeq <= before.lastSeq+1:
		added = float64(after.bytes) - float64(before.bytes)
	case after.msgs > 0:
		out.Estimated = true
		added = float64(newMsgs) * float64(after.bytes) / float64(after.msgs)
	}
	bpd := math.Round(max(0, added)/float64(decisions)*10) / 10
	out.BytesPerDecision = &bpd
	hold := math.Inf(1) // seconds
	if after.cfg.MaxAge > 0 {
		hold = after.cfg.MaxAge.Seconds()
	}
	if bps := bpd * perSec; after.cfg.MaxBytes > 0 && bps > 0 {
		hold = min(hold, float64(after.cfg.MaxBytes)/bps)
	}
	if mps := float64(newMsgs) / float64(decisions) * perSec; after.cfg.MaxMsgs > 0 && mps > 0 {
		hold = min(hold, float64(after.cfg.MaxMsgs)/mps)
	}
	if !math.IsInf(hold, 1) {
		h := math.Round(hold/3600*1000) / 1000
		out.RetentionHours = &h
	}
	return out
}

// measureUsageCost sets the report's usage stream figures from the
// stream's state before the decide phase (ok false: none) and once it
// settled after it.
func (rep *Report) measureUsageCost(ctx context.Context, js jetstream.JetStream, c *Config, before usageStreamMark, ok bool) {
	switch {
	case !ok:
		return
	case c.Flood.Factor > 0:
		rep.UsageCost = &UsageStreamCost{Note: "bytes per decision not measured with --flood (its decisions share the stream)"}
		return
	}
	after, ok := settleUsageStream(ctx, js, c, time.Second, 10*time.Second)
	if !ok {
		return
	}
	u := usageCost(before, after, rep.Decisions, rep.DecisionsPerS)
	rep.UsageBytesPerDecision, rep.UsageRetentionHours, rep.UsageCost = u.BytesPerDecision, u.RetentionHours, &u
}
