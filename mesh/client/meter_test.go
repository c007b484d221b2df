package client

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"
)

func mustMeter(t *testing.T, c *Client, chunk int64, ttl time.Duration) *Meter {
	t.Helper()
	m, err := NewMeter(c, acme, chunk, ttl)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// reserveCosts returns the costs of the reserves the service received, in
// units, and checks that each carries a request id.
func reserveCosts(t *testing.T, f *resService) []string {
	t.Helper()
	var costs []string
	for _, r := range f.requests("reserve") {
		if str(r["request_id"]) == "" {
			t.Errorf("reserve without a request id: %v", r)
		}
		costs = append(costs, string(r["cost"]))
	}
	return costs
}

// settleCosts returns the costs of the settles the service received ("all"
// when a settle has none: the whole reserved cost).
func settleCosts(f *resService) []string {
	var costs []string
	for _, r := range f.requests("settle") {
		if r["cost"] == nil {
			costs = append(costs, "all")
		} else {
			costs = append(costs, string(r["cost"]))
		}
	}
	return costs
}

// TestMeterChunks: units are counted against the open chunk; what
// overflows it takes the next chunk (the chunk size, or the overflow when
// larger), the full chunk is settled whole, Close settles what the open
// chunk used, and the units settled are exactly the units added.
func TestMeterChunks(t *testing.T) {
	c, f := reserveFixture(t, 1000, false)
	ctx := context.Background()
	m := mustMeter(t, c, 10, 0)
	for _, u := range []int64{3, 4, 0, 5, 25, 1} {
		if err := m.Add(ctx, u); err != nil {
			t.Fatalf("Add(%d): %v", u, err)
		}
	}
	// 3+4 in chunk 1 (10); 5 fills it and 2 start chunk 2 (10); 25 fills
	// it (8) and 17 take chunk 3 (17, larger than the chunk size); 1 more
	// needs chunk 4 (10).
	if got, want := strings.Join(reserveCosts(t, f), " "), "10 10 17 10"; got != want {
		t.Errorf("reserved %s, want %s", got, want)
	}
	if got, want := strings.Join(settleCosts(f), " "), "all all all"; got != want {
		t.Errorf("settled %s before Close, want %s", got, want)
	}
	if err := m.Close(ctx); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if got, want := strings.Join(settleCosts(f), " "), "all all all 1"; got != want {
		t.Errorf("settled %s, want %s", got, want)
	}
	held, spent, settled, open := f.state()
	if m.Used() != 38 || settled != 38_000_000 || spent != settled || held != 0 || open != 0 {
		t.Errorf("Used %d; service: settled %d, spent %d, held %d in %d reservations; want 38 units settled, none held",
			m.Used(), settled, spent, held, open)
	}
	ids := map[string]bool{}
	for _, r := range f.requests("reserve") {
		ids[str(r["request_id"])] = true
	}
	if len(ids) != 4 {
		t.Errorf("%d distinct request ids for 4 chunks", len(ids))
	}

	n := len(f.requests("settle")) + f.count("release")
	if err := m.Add(ctx, 1); !errors.Is(err, ErrMeterClosed) {
		t.Errorf("Add after Close: %v, want ErrMeterClosed", err)
	}
	if err := m.Close(ctx); err != nil || len(f.requests("settle"))+f.count("release") != n {
		t.Errorf("second Close: %v, %d more requests", err, len(f.requests("settle"))+f.count("release")-n)
	}
}

// TestMeterDenied: a denied chunk is a *ChunkDeniedError with the denial;
// the open chunk is settled with what was used before, the meter stops,
// and the units settled are those of the Adds that succeeded.
func TestMeterDenied(t *testing.T) {
	c, f := reserveFixture(t, 25, false)
	ctx := context.Background()
	m := mustMeter(t, c, 10, 0)
	for _, u := range []int64{8, 8} { // chunk 1 (10), then chunk 2 (10) with 6 used
		if err := m.Add(ctx, u); err != nil {
			t.Fatalf("Add(%d): %v", u, err)
		}
	}
	err := m.Add(ctx, 8) // 4 overflow chunk 2: chunk 3 would make 30 of 25
	var denied *ChunkDeniedError
	if !errors.Is(err, ErrChunkDenied) || !errors.As(err, &denied) {
		t.Fatalf("Add over the limit: %v, want a ChunkDeniedError", err)
	}
	if denied.Units != 10 || denied.Result.Allowed || denied.Result.Policy != "p" || denied.Result.RetryAfter != 250*time.Millisecond {
		t.Errorf("ChunkDeniedError = %+v", denied)
	}
	if got, want := strings.Join(settleCosts(f), " "), "all 6"; got != want {
		t.Errorf("settled %s, want %s", got, want)
	}
	reserves := f.count("reserve")
	if err2 := m.Add(ctx, 1); err2 != err || f.count("reserve") != reserves {
		t.Errorf("Add after the denial: %v, %d more reserves; want the same error", err2, f.count("reserve")-reserves)
	}
	if err2 := m.Start(ctx); err2 != err {
		t.Errorf("Start after the denial: %v", err)
	}
	if err := m.Close(ctx); err != nil {
		t.Errorf("Close: %v", err)
	}
	held, _, settled, open := f.state()
	if m.Used() != 16 || settled != 16_000_000 || held != 0 || open != 0 || len(f.requests("settle")) != 2 {
		t.Errorf("Used %d; service: settled %d, held %d in %d reservations, %d settles; want 16 units settled",
			m.Used(), settled, held, open, len(f.requests("settle")))
	}
}

// TestMeterStart: Start reserves the first chunk ahead of the stream (and
// is denied before anything is produced when the limits lack it); a chunk
// nothing was added to is released by Close.
func TestMeterStart(t *testing.T) {
	c, f := reserveFixture(t, 15, false)
	ctx := context.Background()
	m := mustMeter(t, c, 10, 0)
	if err := m.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if err := m.Start(ctx); err != nil || f.count("reserve") != 1 {
		t.Fatalf("second Start: %v, %d reserves", err, f.count("reserve"))
	}
	other := mustMeter(t, c, 10, 0)
	if err := other.Start(ctx); !errors.Is(err, ErrChunkDenied) {
		t.Errorf("Start beyond the limit: %v, want ErrChunkDenied", err)
	}
	if err := other.Close(ctx); err != nil {
		t.Error(err)
	}
	if err := m.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if held, _, settled, open := f.state(); f.count("release") != 1 || len(f.requests("settle")) != 0 || settled != 0 || held != 0 || open != 0 {
		t.Errorf("%d releases, %d settles; service: settled %d, held %d in %d reservations", f.count("release"),
			len(f.requests("settle")), settled, held, open)
	}
}

// TestMeterRenews: Add renews the open chunk once half its ttl has passed
// (by the client's clock); a chunk that expired stops the meter with
// ErrNotFound.
func TestMeterRenews(t *testing.T) {
	clock := newFakeClock()
	c, f := reserveFixture(t, 1000, false, Clock(clock.Now))
	ctx := context.Background()
	m := mustMeter(t, c, 100, 10*time.Second)
	step := func(advance time.Duration, wantRenews int) {
		t.Helper()
		clock.Advance(advance)
		if err := m.Add(ctx, 1); err != nil {
			t.Fatalf("Add: %v", err)
		}
		if got := f.count("renew"); got != wantRenews {
			t.Fatalf("after %v: %d renews, want %d", advance, got, wantRenews)
		}
	}
	step(0, 0)                     // reserves, renew due in 5 s
	step(4999*time.Millisecond, 0) // not yet
	step(time.Millisecond, 1)      // half the ttl: renewed, due in 5 s
	step(4*time.Second, 1)         //
	step(time.Second, 2)           //
	if r := f.requests("renew")[0]; str(r["ttl"]) != "10s" {
		t.Errorf("renew %v, want ttl 10s", r)
	}

	f.expire(str(f.requests("renew")[0]["reservation"]))
	clock.Advance(5 * time.Second)
	err := m.Add(ctx, 1)
	if !errors.Is(err, ErrNotFound) {
		t.Fatalf("Add on an expired chunk: %v, want ErrNotFound", err)
	}
	if err2 := m.Add(ctx, 1); err2 != err {
		t.Errorf("Add after the loss: %v", err2)
	}
	if err := m.Close(ctx); err != nil || len(f.requests("settle")) != 0 {
		t.Errorf("Close: %v, %d settles", err, len(f.requests("settle")))
	}
	if m.Used() != 5 {
		t.Errorf("Used = %d, want 5", m.Used())
	}
}

// TestMeterRetriesTheSameChunk: a reserve whose answer was lost (granted
// by the service) is asked again with the same request id, so it is not
// held twice; Close releases one whose Add was not retried.
func TestMeterRetriesTheSameChunk(t *testing.T) {
	c, f := reserveFixture(t, 1000, false)
	ctx := context.Background()
	// The Adds whose reply is dropped wait this long; the others have the
	// fixture's generous timeout.
	lost := func() context.Context {
		ctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
		t.Cleanup(cancel)
		return ctx
	}
	f.setFault(func(endpoint string, n int) *fault {
		if endpoint == "reserve" && n == 0 {
			return &fault{drop: true}
		}
		return nil
	})
	m := mustMeter(t, c, 10, 0)
	if err := m.Add(lost(), 5); !errors.Is(err, ErrTimeout) {
		t.Fatalf("Add with the reply lost: %v, want ErrTimeout", err)
	}
	if err := m.Add(ctx, 5); err != nil {
		t.Fatalf("Add again: %v", err)
	}
	if err := m.Close(ctx); err != nil {
		t.Fatal(err)
	}
	reqs := f.requests("reserve")
	if len(reqs) != 2 || str(reqs[0]["request_id"]) != str(reqs[1]["request_id"]) {
		t.Errorf("reserves %v: want the same request id twice", reqs)
	}
	if held, _, settled, open := f.state(); settled != 5_000_000 || held != 0 || open != 0 {
		t.Errorf("service: settled %d, held %d in %d reservations; want 5 units settled, none held", settled, held, open)
	}

	f.setFault(func(endpoint string, n int) *fault {
		if endpoint == "reserve" && n == 2 {
			return &fault{drop: true}
		}
		return nil
	})
	m = mustMeter(t, c, 10, 0)
	if err := m.Add(lost(), 5); !errors.Is(err, ErrTimeout) {
		t.Fatalf("Add with the reply lost: %v, want ErrTimeout", err)
	}
	if err := m.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if held, _, settled, open := f.state(); settled != 5_000_000 || held != 0 || open != 0 || f.count("release") != 1 {
		t.Errorf("service: settled %d, held %d in %d reservations, %d releases; want the lost chunk released",
			settled, held, open, f.count("release"))
	}
}

// TestMeterPendingSettles: settles that got no answer are owed and sent
// again (by the next Add or Close); the totals stay exact.
func TestMeterPendingSettles(t *testing.T) {
	c, f := reserveFixture(t, 1000, false)
	ctx := context.Background()
	f.setFault(func(endpoint string, n int) *fault {
		if endpoint == "settle" && n < 3 {
			return &fault{answer: answer{Code: 503, Symbol: "unavailable", Message: "busy"}}
		}
		return nil
	})
	m := mustMeter(t, c, 10, 0)
	// Chunks 1, 2 and 3: the settle of chunk 1 (by the second Add) fails,
	// and so do its retry and chunk 2's (by the third Add); Close sends
	// both in full and 4 units of chunk 3.
	for _, u := range []int64{10, 10, 4} {
		if err := m.Add(ctx, u); err != nil {
			t.Fatalf("Add(%d): %v", u, err)
		}
	}
	if err := m.Close(ctx); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if held, _, settled, open := f.state(); settled != 24_000_000 || held != 0 || open != 0 {
		t.Errorf("service: settled %d, held %d in %d reservations; want 24 units settled, none held", settled, held, open)
	}

	// A Close whose settle fails reports it, and a later Close retries.
	next := len(f.requests("settle"))
	f.setFault(func(endpoint string, n int) *fault {
		if endpoint == "settle" && n == next {
			return &fault{answer: answer{Code: 503, Symbol: "unavailable", Message: "busy"}}
		}
		return nil
	})
	m = mustMeter(t, c, 10, 0)
	if err := m.Add(ctx, 3); err != nil {
		t.Fatal(err)
	}
	if err := m.Close(ctx); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Close with its settle failing: %v, want ErrUnavailable", err)
	}
	f.setFault(nil)
	if err := m.Close(ctx); err != nil {
		t.Fatalf("Close again: %v", err)
	}
	if _, _, settled, open := f.state(); settled != 27_000_000 || open != 0 {
		t.Errorf("service: settled %d in all, %d open; want 27 units", settled, open)
	}
}

// TestMeterCloseExpired: a chunk that expired before Close counted at its
// reserved cost; Close says so with ErrNotFound.
func TestMeterCloseExpired(t *testing.T) {
	c, f := reserveFixture(t, 1000, false)
	ctx := context.Background()
	m := mustMeter(t, c, 10, 0)
	if err := m.Add(ctx, 3); err != nil {
		t.Fatal(err)
	}
	f.expire(f.openIDs()[0])
	if err := m.Close(ctx); !errors.Is(err, ErrNotFound) {
		t.Errorf("Close of an expired chunk: %v, want ErrNotFound", err)
	}
	if err := m.Close(ctx); err != nil || len(f.requests("settle")) != 1 {
		t.Errorf("second Close: %v, %d settles; want nothing more to do", err, len(f.requests("settle")))
	}
	if _, spent, settled, _ := f.state(); spent != 10_000_000 || settled != 0 {
		t.Errorf("service: spent %d, settled %d; want the reserved 10 spent by the expiry", spent, settled)
	}
}

func TestNewMeterRejects(t *testing.T) {
	c, _ := reserveFixture(t, 10, false)
	for name, fn := range map[string]func() (*Meter, error){
		"nil client":    func() (*Meter, error) { return NewMeter(nil, acme, 1, 0) },
		"no descriptor": func() (*Meter, error) { return NewMeter(c, nil, 1, 0) },
		"chunk 0":       func() (*Meter, error) { return NewMeter(c, acme, 0, 0) },
		"huge chunk":    func() (*Meter, error) { return NewMeter(c, acme, MaxCost+1, 0) },
		"ttl above 1h":  func() (*Meter, error) { return NewMeter(c, acme, 1, 2*time.Hour) },
	} {
		if m, err := fn(); m != nil || err == nil {
			t.Errorf("%s: %v, %v", name, m, err)
		}
	}
	m := mustMeter(t, c, 10, 0)
	if err := m.Add(context.Background(), -1); !errors.Is(err, ErrInvalidRequest) {
		t.Errorf("Add(-1): %v", err)
	}
}
