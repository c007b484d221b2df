package shadow

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/usage"
)

// TestBacktestMatchesLive: a backtest of each candidate's document over the
// records the stream holds counts exactly what the live evaluator counted
// over the same records; --since selects by stream time; a policy that is
// not a candidate (the live one) backtests too.
func TestBacktestMatchesLive(t *testing.T) {
	s := startServer(t)
	nc, js := connectJS(t, s)
	kv := installation(t, js, "rl")
	cands := putCandidates(t, kv)
	recs := genStream(t, 2500, 5)
	runEvaluator(t, js, Config{Prefix: "rl", NodeID: "n1"})
	stream := publishBatches(t, js, "rl", "n1", recs, 80, livePolicyOf)
	if err := nc.Publish(usage.Subject("rl", ""), []byte(`not json`)); err != nil {
		t.Fatal(err)
	}
	live := expected(cands, stream)
	waitSummaries(t, js, "rl", live)

	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	for _, c := range cands {
		got, err := Backtest(ctx, js, c, BacktestConfig{Prefix: "rl", Since: time.Hour, FetchSize: 7})
		if err != nil {
			t.Fatal(err)
		}
		want := live[c.Name]
		if got.Summary.SinceUs != stream[0].TimeUs {
			t.Errorf("%s: since_us %d, want the first record's %d", c.Name, got.Summary.SinceUs, stream[0].TimeUs)
		}
		got.Summary.SinceUs = want.SinceUs
		if jsonString(got.Summary) != jsonString(want) {
			t.Errorf("%s: backtest\n%s\nlive\n%s", c.Name, jsonString(got.Summary), jsonString(want))
		}
		if got.Records != uint64(len(stream)) || got.Invalid != 1 || got.FirstSeq != 1 || got.LastSeq != got.Messages {
			t.Errorf("%s: %+v", c.Name, got)
		}
	}

	// A policy that is not a candidate, not in the bucket under this name.
	p := mustPolicy(t, "what-if", 0, `{"match": {"tenant": "*"}, "limits": [{"algorithm": "fixed_window", "limit": 100, "window": "1s"}]}`)
	got, err := Backtest(ctx, js, p, BacktestConfig{Prefix: "rl"})
	if err != nil {
		t.Fatal(err)
	}
	requests := 0 // the records that are requests: not released reservations (cost 0)
	for _, r := range stream {
		if r.Cost > 0 {
			requests++
		}
	}
	if want := naiveReplay([]*policyT{p}, stream)["what-if"]; got.Summary.Evaluated != uint64(requests) || requests == len(stream) ||
		got.Summary.WouldDeny != want.WouldDeny || got.Summary.WouldDeny == 0 {
		t.Errorf("what-if: %+v, naive %+v", got.Summary, want)
	}

	// Nothing was stored in the half hour before a clock an hour ahead.
	ahead := func() time.Time { return time.Now().Add(time.Hour) }
	got, err = Backtest(ctx, js, p, BacktestConfig{Prefix: "rl", Since: 30 * time.Minute, Clock: ahead})
	if err != nil {
		t.Fatal(err)
	}
	if got.Records != 0 || got.Messages != 0 || got.Summary.Evaluated != 0 || got.Summary.SinceUs != 0 {
		t.Errorf("since a future instant: %+v", got)
	}

	if _, err := Backtest(ctx, js, p, BacktestConfig{Prefix: "other"}); err == nil {
		t.Error("a backtest of an installation without a usage stream succeeded")
	}
}

// TestBacktestWaitsAndResumes: reading one message at a time with a wait
// of a microsecond, the backtest stalls again and again and takes new
// consumers after the last message it read, while a publisher goes on
// adding messages; it still ends, having replayed every message up to the
// stream's last at its start (or later) exactly once: its counts equal a
// replay of those records.
func TestBacktestWaitsAndResumes(t *testing.T) {
	s := startServer(t)
	_, js := connectJS(t, s)
	kv := installation(t, js, "rl")
	cands := putCandidates(t, kv)
	recs := genStream(t, 3000, 6)
	stream := publishBatches(t, js, "rl", "n1", recs[:2000], 20, livePolicyOf)
	more := make(chan []usage.Record, 1)
	go func() { more <- publishBatches(t, js, "rl", "n1", recs[2000:], 20, livePolicyOf) }()
	ctx, cancel := context.WithTimeout(context.Background(), 2*waitLimit)
	defer cancel()
	got, err := Backtest(ctx, js, cands[1], BacktestConfig{Prefix: "rl", FetchSize: 1, Wait: time.Microsecond})
	if err != nil {
		t.Fatal(err)
	}
	stream = append(stream, <-more...)
	if got.Records < 2000 || got.Records > uint64(len(stream)) || got.FirstSeq != 1 || got.Messages != got.LastSeq {
		t.Fatalf("replayed %+v of %d records", got, len(stream))
	}
	want := expected(cands[1:2], stream[:got.Records])[cands[1].Name]
	if jsonString(got.Summary) != jsonString(want) {
		t.Errorf("backtest\n%s\nreplay of its records\n%s", jsonString(got.Summary), jsonString(want))
	}
}

// TestBacktestGivesUp: a backtest against a server that is gone ends with
// an error once the stream has not answered for its patience; one whose
// context ends returns the context's error.
func TestBacktestGivesUp(t *testing.T) {
	s := startServer(t)
	_, js := connectJS(t, s)
	installation(t, js, "rl")
	publishBatches(t, js, "rl", "n1", genStream(t, 100, 7), 20, livePolicyOf)
	p := mustPolicy(t, "what-if", 0, `{"match": {"tenant": "*"}, "limits": [{"algorithm": "fixed_window", "limit": 100, "window": "1s"}]}`)

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := Backtest(ctx, js, p, BacktestConfig{Prefix: "rl"}); !errors.Is(err, context.Canceled) {
		t.Errorf("a cancelled backtest: %v", err)
	}

	s.Shutdown()
	s.WaitForShutdown()
	ctx, cancel = context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	_, err := Backtest(ctx, js, p, BacktestConfig{Prefix: "rl", Patience: 300 * time.Millisecond})
	if err == nil || ctx.Err() != nil || !strings.Contains(err.Error(), "no answer") {
		t.Errorf("a backtest without a server: %v", err)
	}
}
