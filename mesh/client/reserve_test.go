package client

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/jstest"
)

var acme = map[string]string{"tenant": "acme", "operation": "export"}

// reserveFixture is a client and a reservation service (a quota of limit
// units unless concurrency) on one embedded nats-server.
func reserveFixture(t *testing.T, limit int64, concurrency bool, opts ...Option) (*Client, *resService) {
	t.Helper()
	s := startServer(t)
	f := startResService(t, jstest.Connect(t, s), "rl", limit, concurrency)
	// A generous timeout: the service answers every request, so a timeout
	// here would only say the machine was busy.
	return newClient(t, jstest.Connect(t, s), append([]Option{Timeout(30 * time.Second)}, opts...)...), f
}

func mustReserve(t *testing.T, c *Client, cost int64, ttl time.Duration, opts ...DecideOption) *Reservation {
	t.Helper()
	r, err := c.Reserve(context.Background(), acme, cost, ttl, opts...)
	if err != nil {
		t.Fatalf("Reserve(%d): %v", cost, err)
	}
	if !r.Allowed || r.ID == "" {
		t.Fatalf("Reserve(%d) = %+v, want an admitted reservation", cost, r)
	}
	return r
}

// lastBody returns the last request an endpoint received, re-encoded with
// sorted keys.
func lastBody(t *testing.T, f *resService, endpoint string) string {
	t.Helper()
	reqs := f.requests(endpoint)
	if len(reqs) == 0 {
		t.Fatalf("no %s request", endpoint)
	}
	b, _ := json.Marshal(reqs[len(reqs)-1])
	var v any
	if err := json.Unmarshal(b, &v); err != nil {
		t.Fatal(err)
	}
	b, _ = json.Marshal(v)
	return string(b)
}

func TestReserveReplies(t *testing.T) {
	c, f := reserveFixture(t, 10, false)
	ctx := context.Background()

	r := mustReserve(t, c, 3, 45*time.Second)
	want := Reservation{Result: Result{Allowed: true, Policy: "p", Revision: 7, Remaining: "7", ResetAfter: time.Second},
		ID: "res-1", ExpiresIn: 45 * time.Second}
	if *r != want {
		t.Errorf("Reserve = %+v, want %+v", *r, want)
	}
	if got, want := lastBody(t, f, "reserve"), `{"cost":3,"descriptor":{"operation":"export","tenant":"acme"},"ttl":"45s"}`; got != want {
		t.Errorf("reserve body %s, want %s", got, want)
	}

	// ttl 0: no ttl on the wire, the service's default.
	r = mustReserve(t, c, 1, 0)
	if r.ExpiresIn != DefaultTTL || strings.Contains(lastBody(t, f, "reserve"), "ttl") {
		t.Errorf("ttl 0: ExpiresIn %v, body %s", r.ExpiresIn, lastBody(t, f, "reserve"))
	}

	// A decimal cost goes as a string.
	r = mustReserve(t, c, 0, time.Minute, Cost("2.5"))
	if r.Remaining != "3.5" || !strings.Contains(lastBody(t, f, "reserve"), `"cost":"2.5"`) || !strings.Contains(lastBody(t, f, "reserve"), `"ttl":"1m0s"`) {
		t.Errorf("Cost(2.5): %+v, body %s", r, lastBody(t, f, "reserve"))
	}

	// A dry run holds nothing and gets no reservation.
	held, _, _, _ := f.state()
	r, err := c.Reserve(ctx, acme, 1, 0, DryRun())
	if err != nil || !r.Allowed || r.ID != "" || r.ExpiresIn != 0 {
		t.Errorf("dry run: %+v, %v", r, err)
	}
	if h, _, _, _ := f.state(); h != held || !strings.Contains(lastBody(t, f, "reserve"), `"dry_run":true`) {
		t.Errorf("dry run held %d -> %d, body %s", held, h, lastBody(t, f, "reserve"))
	}

	// A request id makes it idempotent: the retry gets the same reservation
	// and holds once.
	r1 := mustReserve(t, c, 1, 0, RequestID("job-42"))
	r2 := mustReserve(t, c, 1, 0, RequestID("job-42"))
	if h, _, _, _ := f.state(); r1.ID != r2.ID || h != held+1_000_000 {
		t.Errorf("retry with a request id: %s then %s, held %d -> %d", r1.ID, r2.ID, held, h)
	}

	// Denied: no reservation, a nil error, the wait.
	r, err = c.Reserve(ctx, acme, 5, 0)
	want = Reservation{Result: Result{Policy: "p", Revision: 7, Remaining: "2.5", RetryAfter: 250 * time.Millisecond, ResetAfter: time.Second}}
	if err != nil || *r != want {
		t.Errorf("denied: %+v, %v; want %+v", r, err, want)
	}

	// Rejected before sending.
	n := f.count("reserve")
	for name, call := range map[string]func() error{
		"negative ttl":  func() error { _, err := c.Reserve(ctx, acme, 1, -time.Second); return err },
		"ttl above 1h":  func() error { _, err := c.Reserve(ctx, acme, 1, MaxTTL+time.Millisecond); return err },
		"no descriptor": func() error { _, err := c.Reserve(ctx, nil, 1, 0); return err },
		"cost 0":        func() error { _, err := c.Reserve(ctx, acme, 0, 0); return err },
		"bad decimal":   func() error { _, err := c.Reserve(ctx, acme, 1, 0, Cost("1e3")); return err },
	} {
		if err := call(); !errors.Is(err, ErrInvalidRequest) {
			t.Errorf("%s: %v, want ErrInvalidRequest", name, err)
		}
	}
	if f.count("reserve") != n {
		t.Errorf("invalid reserves reached the service")
	}
	// The largest ttl is accepted.
	mustReserve(t, c, 1, MaxTTL)
}

func TestSettleReleaseRenew(t *testing.T) {
	c, f := reserveFixture(t, 100, false)
	ctx := context.Background()

	// Settle part: the rest comes back; settling again (whatever the cost),
	// releasing or renewing returns the first outcome.
	id := mustReserve(t, c, 10, 0).ID
	st, err := c.Settle(ctx, id, 3)
	want := Settlement{Reservation: id, Outcome: OutcomeSettled, Settled: "3", Returned: "7", Remaining: "97"}
	if err != nil || *st != want {
		t.Fatalf("Settle = %+v, %v; want %+v", st, err, want)
	}
	if got := lastBody(t, f, "settle"); got != `{"cost":3,"reservation":"`+id+`"}` {
		t.Errorf("settle body %s", got)
	}
	for name, call := range map[string]func() (*Settlement, error){
		"settle again": func() (*Settlement, error) { return c.Settle(ctx, id, 5) },
		"release":      func() (*Settlement, error) { return c.Release(ctx, id) },
		"renew":        func() (*Settlement, error) { return c.Renew(ctx, id, time.Minute) },
	} {
		if again, err := call(); err != nil || *again != want {
			t.Errorf("%s after settle = %+v, %v; want the first outcome %+v", name, again, err, want)
		}
	}

	// Release: everything comes back; the body names only the reservation.
	id = mustReserve(t, c, 4, 0).ID
	st, err = c.Release(ctx, id)
	if err != nil || *st != (Settlement{Reservation: id, Outcome: OutcomeReleased, Settled: "0", Returned: "4", Remaining: "97"}) {
		t.Errorf("Release = %+v, %v", st, err)
	}
	if got := lastBody(t, f, "release"); got != `{"reservation":"`+id+`"}` {
		t.Errorf("release body %s", got)
	}

	// Renew, then settle the whole reserved cost (no cost on the wire).
	id = mustReserve(t, c, 4, 0).ID
	st, err = c.Renew(ctx, id, 90*time.Second)
	if err != nil || *st != (Settlement{Reservation: id, Outcome: OutcomeRenewed, Settled: "0", Returned: "0", Remaining: "93", ExpiresIn: 90 * time.Second}) {
		t.Errorf("Renew = %+v, %v", st, err)
	}
	if got := lastBody(t, f, "renew"); got != `{"reservation":"`+id+`","ttl":"1m30s"}` {
		t.Errorf("renew body %s", got)
	}
	if st, err = c.Renew(ctx, id, 0); err != nil || st.ExpiresIn != DefaultTTL || strings.Contains(lastBody(t, f, "renew"), "ttl") {
		t.Errorf("Renew(0) = %+v, %v; body %s", st, err, lastBody(t, f, "renew"))
	}
	st, err = c.Settle(ctx, id, SettleReserved)
	if err != nil || st.Settled != "4" || st.Returned != "0" {
		t.Errorf("Settle(SettleReserved) = %+v, %v", st, err)
	}
	if got := lastBody(t, f, "settle"); got != `{"reservation":"`+id+`"}` {
		t.Errorf("settle-all body %s", got)
	}

	// Decimal settles, zero included.
	id = mustReserve(t, c, 5, 0).ID
	st, err = c.Settle(ctx, id, 0, Cost("2.5"))
	if err != nil || st.Settled != "2.5" || st.Returned != "2.5" || !strings.Contains(lastBody(t, f, "settle"), `"cost":"2.5"`) {
		t.Errorf("Settle(Cost 2.5) = %+v, %v", st, err)
	}
	id = mustReserve(t, c, 2, 0).ID
	if st, err = c.Settle(ctx, id, 0, Cost("0")); err != nil || st.Settled != "0" || st.Returned != "2" {
		t.Errorf("Settle(Cost 0) = %+v, %v", st, err)
	}
	id = mustReserve(t, c, 2, 0).ID
	if st, err = c.Settle(ctx, id, 0); err != nil || st.Settled != "0" || !strings.Contains(lastBody(t, f, "settle"), `"cost":0`) {
		t.Errorf("Settle(0) = %+v, %v", st, err)
	}

	// Above the reserved cost: the service's 400.
	id = mustReserve(t, c, 2, 0).ID
	_, err = c.Settle(ctx, id, 3)
	var se *ServiceError
	if !errors.Is(err, ErrInvalidRequest) || !errors.As(err, &se) || se.Code != 400 {
		t.Errorf("Settle above the reserved cost: %v", err)
	}

	// Rejected before sending.
	n := f.count("settle") + f.count("release") + f.count("renew")
	for name, call := range map[string]func() error{
		"empty id":       func() error { _, err := c.Settle(ctx, "", 1); return err },
		"long id":        func() error { _, err := c.Release(ctx, strings.Repeat("x", MaxReservationIDLen+1)); return err },
		"negative cost":  func() error { _, err := c.Settle(ctx, id, -2); return err },
		"cost too large": func() error { _, err := c.Settle(ctx, id, MaxCost+1); return err },
		"dry run":        func() error { _, err := c.Settle(ctx, id, 1, DryRun()); return err },
		"request id":     func() error { _, err := c.Settle(ctx, id, 1, RequestID("r")); return err },
		"bad decimal":    func() error { _, err := c.Settle(ctx, id, 0, Cost("-1")); return err },
		"renew ttl":      func() error { _, err := c.Renew(ctx, id, 2*time.Hour); return err },
		"renew empty id": func() error { _, err := c.Renew(ctx, "", 0); return err },
	} {
		if err := call(); !errors.Is(err, ErrInvalidRequest) {
			t.Errorf("%s: %v, want ErrInvalidRequest", name, err)
		}
	}
	if f.count("settle")+f.count("release")+f.count("renew") != n {
		t.Errorf("invalid requests reached the service")
	}
}

// TestReservationNotFound: a 404 matches ErrNotFound (and no other
// sentinel) and is a *ServiceError, for an unknown and an expired
// reservation alike.
func TestReservationNotFound(t *testing.T) {
	c, f := reserveFixture(t, 10, false)
	ctx := context.Background()
	expired := mustReserve(t, c, 1, 0).ID
	f.expire(expired)
	all := []error{ErrInvalidRequest, ErrUnavailable, ErrInternal, ErrBadReply, ErrTimeout, ErrNoResponders}
	for _, id := range []string{"res-unknown", expired} {
		for name, call := range map[string]func() (*Settlement, error){
			"settle":  func() (*Settlement, error) { return c.Settle(ctx, id, 1) },
			"release": func() (*Settlement, error) { return c.Release(ctx, id) },
			"renew":   func() (*Settlement, error) { return c.Renew(ctx, id, 0) },
		} {
			st, err := call()
			var se *ServiceError
			if st != nil || !errors.Is(err, ErrNotFound) || !errors.As(err, &se) || se.Code != 404 || se.Symbol != "not_found" {
				t.Errorf("%s %s: %+v, %v; want ErrNotFound", name, id, st, err)
				continue
			}
			for _, other := range all {
				if errors.Is(err, other) {
					t.Errorf("%s %s: %v also matches %v", name, id, err, other)
				}
			}
		}
	}
}

// TestReservationUnavailable: no answer is an error matching the
// unavailability sentinels, also with a failure behaviour configured:
// reservations never fail open.
func TestReservationUnavailable(t *testing.T) {
	failOpen := OnUnavailable(func(string, map[string]string) Failure { return FailOpenBucket(100, 100) })
	ctx := context.Background()
	calls := func(c *Client) map[string]func() error {
		return map[string]func() error{
			"reserve": func() error { _, err := c.Reserve(ctx, acme, 1, 0); return err },
			"acquire": func() error { _, _, err := c.Acquire(ctx, acme, 1, 0); return err },
			"settle":  func() error { _, err := c.Settle(ctx, "res-1", 1); return err },
			"release": func() error { _, err := c.Release(ctx, "res-1"); return err },
			"renew":   func() error { _, err := c.Renew(ctx, "res-1", 0); return err },
		}
	}

	t.Run("no responders", func(t *testing.T) {
		c := newClient(t, jstest.Connect(t, startServer(t)), failOpen)
		for name, call := range calls(c) {
			if err := call(); !errors.Is(err, ErrNoResponders) {
				t.Errorf("%s: %v, want ErrNoResponders", name, err)
			}
		}
	})
	t.Run("503", func(t *testing.T) {
		c, f := reserveFixture(t, 10, false, failOpen)
		f.setFault(func(string, int) *fault {
			return &fault{answer: answer{Code: 503, Symbol: "unavailable", Message: "no decision within 500ms"}}
		})
		for name, call := range calls(c) {
			var se *ServiceError
			if err := call(); !errors.Is(err, ErrUnavailable) || !errors.As(err, &se) || se.Code != 503 {
				t.Errorf("%s: %v, want ErrUnavailable", name, err)
			}
		}
	})
	t.Run("timeout", func(t *testing.T) {
		c, f := reserveFixture(t, 10, false, failOpen, Timeout(50*time.Millisecond))
		f.setFault(func(string, int) *fault { return &fault{answer: answer{Silent: true}} })
		for name, call := range calls(c) {
			if err := call(); !errors.Is(err, ErrTimeout) {
				t.Errorf("%s: %v, want ErrTimeout", name, err)
			}
		}
	})
}

func TestDecodeSettlement(t *testing.T) {
	good := map[string]Settlement{
		`{"reservation":"r","outcome":"settled","settled":3,"returned":7,"remaining":12}`: {Reservation: "r", Outcome: OutcomeSettled, Settled: "3", Returned: "7", Remaining: "12"},
		`{"outcome":"released","settled":"0","returned":"2.5"}`:                           {Reservation: "r", Outcome: OutcomeReleased, Settled: "0", Returned: "2.5", Remaining: "0"},
		`{"reservation":"r","outcome":"renewed","expires_in_ms":1500,"future":[1]}`:       {Reservation: "r", Outcome: OutcomeRenewed, Settled: "0", Returned: "0", Remaining: "0", ExpiresIn: 1500 * time.Millisecond},
	}
	for body, want := range good {
		if st, err := decodeSettlement([]byte(body), "r"); err != nil || *st != want {
			t.Errorf("%s: %+v, %v; want %+v", body, st, err, want)
		}
	}
	for _, body := range []string{
		``, `not json`, `{}`, `{"settled":1}`,
		`{"reservation":"other","outcome":"settled"}`,
		`{"outcome":"settled","settled":-1}`,
		`{"outcome":"settled","returned":"1e3"}`,
		`{"outcome":"settled","remaining":"x"}`,
		`{"outcome":"renewed","expires_in_ms":-5}`,
	} {
		if st, err := decodeSettlement([]byte(body), "r"); st != nil || !errors.Is(err, ErrBadReply) {
			t.Errorf("%s: %+v, %v; want ErrBadReply", body, st, err)
		}
	}
}

func TestDecodeReservation(t *testing.T) {
	r, err := decodeReservation([]byte(`{"allowed":true,"policy":"p","revision":2,"remaining":"1.5","reservation":"abc","expires_in_ms":30000,"partition":3}`))
	want := Reservation{Result: Result{Allowed: true, Policy: "p", Revision: 2, Remaining: "1.5"}, ID: "abc", ExpiresIn: 30 * time.Second}
	if err != nil || *r != want {
		t.Errorf("decodeReservation = %+v, %v; want %+v", r, err, want)
	}
	for _, body := range []string{
		``, `{}`, `{"allowed":"yes"}`,
		`{"allowed":false,"reservation":"abc"}`,
		`{"allowed":true,"reservation":"abc","expires_in_ms":-1}`,
		`{"allowed":true,"reservation":"` + strings.Repeat("x", MaxReservationIDLen+1) + `"}`,
		`{"allowed":true,"retry_after_ms":-2}`,
	} {
		if r, err := decodeReservation([]byte(body)); r != nil || !errors.Is(err, ErrBadReply) {
			t.Errorf("%s: %+v, %v; want ErrBadReply", body, r, err)
		}
	}
}

// FuzzDecodeReservations: the reserve and settle decoders never panic, and
// either decode or return an error wrapping ErrBadReply.
func FuzzDecodeReservations(f *testing.F) {
	for _, s := range []string{
		`{"allowed":true,"policy":"p","revision":2,"remaining":1,"reservation":"abc","expires_in_ms":30000}`,
		`{"allowed":false,"policy":"p","retry_after_ms":-1}`,
		`{"reservation":"abc","outcome":"settled","settled":3,"returned":"7","remaining":12}`,
		`{"reservation":"abc","outcome":"renewed","expires_in_ms":30000}`,
		``, `{`, `null`, `[]`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if r, err := decodeReservation(data); err != nil {
			if r != nil || !errors.Is(err, ErrBadReply) {
				t.Fatalf("decodeReservation: %+v, %v", r, err)
			}
		} else if r.ID != "" && (!r.Allowed || len(r.ID) > MaxReservationIDLen) {
			t.Fatalf("decodeReservation accepted %+v", r)
		}
		if s, err := decodeSettlement(data, "abc"); err != nil {
			if s != nil || !errors.Is(err, ErrBadReply) {
				t.Fatalf("decodeSettlement: %+v, %v", s, err)
			}
		} else {
			for _, d := range []Decimal{s.Settled, s.Returned, s.Remaining} {
				if m, ok := d.Micro(); !ok || m < 0 {
					t.Fatalf("decodeSettlement accepted %q in %+v", d, s)
				}
			}
			if s.Reservation != "abc" || s.Outcome == "" || s.ExpiresIn < 0 {
				t.Fatalf("decodeSettlement accepted %+v", s)
			}
		}
	})
}
