package client

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/jstest"
	"github.com/nats-io/nats.go"
)

func TestDecideResults(t *testing.T) {
	s := startServer(t)
	nc := jstest.Connect(t, s)
	answers := map[string]answer{
		"allow":    reply(true, "acme-search", 12, "12.5", 0, 4000),
		"deny":     reply(false, "acme-search", 12, "0", 100, 4000),
		"never":    reply(false, "acme-search", 13, "0.25", -1, 2500),
		"nomatch":  reply(true, "", 0, "0", 0, 0),
		"shadow":   {Reply: `{"allowed":true,"policy":"p","revision":3,"remaining":0,"retry_after_ms":0,"reset_after_ms":7,"shadow_denied":true}`},
		"extra":    {Reply: `{"allowed":true,"policy":"p","revision":1,"remaining":2,"retry_after_ms":0,"reset_after_ms":0,"future_field":[1,2]}`},
		"noremain": {Reply: `{"allowed":true,"policy":"p","revision":1}`},
	}
	startResponder(t, nc, "rl", func(r seenRequest) answer { return answers[r.Descriptor["case"]] })
	c := newClient(t, nc)

	tests := []struct {
		name string
		want Result
	}{
		{"allow", Result{Allowed: true, Policy: "acme-search", Revision: 12, Remaining: "12.5", ResetAfter: 4 * time.Second}},
		{"deny", Result{Policy: "acme-search", Revision: 12, Remaining: "0", RetryAfter: 100 * time.Millisecond, ResetAfter: 4 * time.Second}},
		{"never", Result{Policy: "acme-search", Revision: 13, Remaining: "0.25", Never: true, ResetAfter: 2500 * time.Millisecond}},
		{"nomatch", Result{Allowed: true, Remaining: "0"}},
		{"shadow", Result{Allowed: true, Policy: "p", Revision: 3, Remaining: "0", ResetAfter: 7 * time.Millisecond, ShadowDenied: true}},
		{"extra", Result{Allowed: true, Policy: "p", Revision: 1, Remaining: "2"}},
		{"noremain", Result{Allowed: true, Policy: "p", Revision: 1, Remaining: "0"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := c.Decide(context.Background(), map[string]string{"case": tt.name}, 1)
			if err != nil {
				t.Fatalf("Decide: %v", err)
			}
			if *got != tt.want {
				t.Fatalf("Decide = %+v, want %+v", *got, tt.want)
			}
		})
	}
}

func TestDecideServiceErrors(t *testing.T) {
	s := startServer(t)
	nc := jstest.Connect(t, s)
	startResponder(t, nc, "rl", func(r seenRequest) answer {
		switch r.Descriptor["case"] {
		case "400":
			return answer{Code: 400, Symbol: "bad_request", Message: "descriptor lacks plan"}
		case "413":
			return answer{Code: 413, Symbol: "too_large", Message: "body over 4 KiB"}
		case "503":
			return answer{Code: 503, Symbol: "unavailable", Message: "no decision within 500ms"}
		case "500":
			return answer{Code: 500, Symbol: "internal", Message: "boom"}
		case "418":
			return answer{Code: 418, Symbol: "teapot", Message: "?"}
		}
		return answer{Reply: `not json`}
	})
	c := newClient(t, nc)

	tests := []struct {
		name    string
		want    error
		service *ServiceError
	}{
		{"400", ErrInvalidRequest, &ServiceError{400, "bad_request", "descriptor lacks plan"}},
		{"413", ErrInvalidRequest, &ServiceError{413, "too_large", "body over 4 KiB"}},
		{"503", ErrUnavailable, &ServiceError{503, "unavailable", "no decision within 500ms"}},
		{"500", ErrInternal, &ServiceError{500, "internal", "boom"}},
		{"418", ErrInternal, &ServiceError{418, "teapot", "?"}},
		{"garbage", ErrBadReply, nil},
	}
	all := []error{ErrInvalidRequest, ErrUnavailable, ErrInternal, ErrBadReply, ErrTimeout, ErrNoResponders}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			res, err := c.Decide(context.Background(), map[string]string{"case": tt.name}, 1)
			if res != nil {
				t.Fatalf("Decide returned a result %+v with error %v", res, err)
			}
			for _, sentinel := range all {
				if got, want := errors.Is(err, sentinel), sentinel == tt.want; got != want {
					t.Errorf("errors.Is(%v, %v) = %v, want %v", err, sentinel, got, want)
				}
			}
			var se *ServiceError
			if errors.As(err, &se) != (tt.service != nil) {
				t.Fatalf("errors.As(%v, *ServiceError) = %v", err, se)
			}
			if tt.service != nil && *se != *tt.service {
				t.Fatalf("ServiceError = %+v, want %+v", *se, *tt.service)
			}
		})
	}
}

func TestDecideNoResponders(t *testing.T) {
	s := startServer(t)
	c := newClient(t, jstest.Connect(t, s))
	_, err := c.Decide(context.Background(), map[string]string{"tenant": "acme"}, 1)
	if !errors.Is(err, ErrNoResponders) || errors.Is(err, ErrTimeout) || !IsUnavailable(err) {
		t.Fatalf("Decide without responders: %v, want ErrNoResponders", err)
	}
}

// silentResponder subscribes to the decide subject and never answers.
func silentResponder(t *testing.T, c *Client) {
	t.Helper()
	nc := c.nc
	sub, err := nc.Subscribe(c.Subject(), func(m *nats.Msg) {})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
}

func TestDecideTimeout(t *testing.T) {
	s := startServer(t)
	c := newClient(t, jstest.Connect(t, s), Timeout(50*time.Millisecond))
	silentResponder(t, c)

	t.Run("client timeout", func(t *testing.T) {
		_, err := c.Decide(context.Background(), map[string]string{"tenant": "acme"}, 1)
		if !errors.Is(err, ErrTimeout) || !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Decide: %v, want ErrTimeout", err)
		}
	})
	t.Run("context deadline", func(t *testing.T) {
		long := newClient(t, c.nc, Timeout(time.Hour))
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		defer cancel()
		_, err := long.Decide(ctx, map[string]string{"tenant": "acme"}, 1)
		if !errors.Is(err, ErrTimeout) {
			t.Fatalf("Decide: %v, want ErrTimeout", err)
		}
	})
	t.Run("cancelled", func(t *testing.T) {
		failing := newClient(t, c.nc, OnUnavailable(func(string, map[string]string) Failure { return FailClosed() }))
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		res, err := failing.Decide(ctx, map[string]string{"tenant": "acme"}, 1)
		if !errors.Is(err, context.Canceled) || IsUnavailable(err) || res != nil {
			t.Fatalf("Decide with cancelled context: %+v, %v; want context.Canceled", res, err)
		}
	})
}

func TestDecideClosedConnection(t *testing.T) {
	s := startServer(t)
	nc := jstest.Connect(t, s)
	c := newClient(t, nc)
	nc.Close()
	_, err := c.Decide(context.Background(), map[string]string{"tenant": "acme"}, 1)
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Decide on a closed connection: %v, want ErrUnavailable", err)
	}
}

func TestDecideEncoding(t *testing.T) {
	s := startServer(t)
	nc := jstest.Connect(t, s)
	rsp := startResponder(t, nc, "acme", func(seenRequest) answer { return reply(true, "p", 1, "1", 0, 0) })
	c := newClient(t, nc, Prefix("acme"))
	if c.Subject() != "acme.v1.decide" {
		t.Fatalf("Subject = %q", c.Subject())
	}
	odd := map[string]string{"tenant": `ac"me\ `, "plan": "v7 ünï\tcode", "op": "\x01\u2028"}
	calls := []struct {
		d    map[string]string
		cost int64
		opts []DecideOption
		want seenRequest
	}{
		{map[string]string{"tenant": "acme"}, 3, nil, seenRequest{Descriptor: map[string]string{"tenant": "acme"}, Cost: []byte(`3`)}},
		{map[string]string{"tenant": "acme"}, 1, []DecideOption{Cost("2.5"), RequestID("7f1c2e"), DryRun()},
			seenRequest{Descriptor: map[string]string{"tenant": "acme"}, Cost: []byte(`"2.5"`), RequestID: "7f1c2e", DryRun: true}},
		{odd, MaxCost, nil, seenRequest{Descriptor: odd, Cost: []byte(`1000000000`)}},
	}
	for i, call := range calls {
		if _, err := c.Decide(context.Background(), call.d, call.cost, call.opts...); err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
	}
	got := rsp.requests()
	if len(got) != len(calls) {
		t.Fatalf("responder saw %d requests, want %d", len(got), len(calls))
	}
	for i, call := range calls {
		g, w := got[i], call.want
		if string(g.Cost) != string(w.Cost) || g.RequestID != w.RequestID || g.DryRun != w.DryRun || len(g.Descriptor) != len(w.Descriptor) {
			t.Errorf("call %d: responder saw %+v (cost %s), want %+v (cost %s)", i, g, g.Cost, w, w.Cost)
		}
		for k, v := range w.Descriptor {
			if g.Descriptor[k] != v {
				t.Errorf("call %d: descriptor[%q] = %q, want %q", i, k, g.Descriptor[k], v)
			}
		}
	}
}

func TestDecideRejectsLocally(t *testing.T) {
	s := startServer(t)
	nc := jstest.Connect(t, s)
	rsp := startResponder(t, nc, "rl", func(seenRequest) answer { return reply(true, "p", 1, "1", 0, 0) })
	c := newClient(t, nc, OnUnavailable(func(string, map[string]string) Failure { return FailClosed() }))
	d := map[string]string{"tenant": "acme"}
	tests := []struct {
		name string
		d    map[string]string
		cost int64
		opts []DecideOption
	}{
		{"empty descriptor", map[string]string{}, 1, nil},
		{"zero cost", d, 0, nil},
		{"negative cost", d, -1, nil},
		{"cost above max", d, MaxCost + 1, nil},
		{"exponent", d, 1, []DecideOption{Cost("1e3")}},
		{"seven fraction digits", d, 1, []DecideOption{Cost("0.0000001")}},
		{"zero decimal", d, 1, []DecideOption{Cost("0.000")}},
		{"decimal above max", d, 1, []DecideOption{Cost("1000000000.000001")}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			res, err := c.Decide(context.Background(), tt.d, tt.cost, tt.opts...)
			if !errors.Is(err, ErrInvalidRequest) || res != nil {
				t.Fatalf("Decide = %+v, %v; want ErrInvalidRequest", res, err)
			}
		})
	}
	if n := len(rsp.requests()); n != 0 {
		t.Fatalf("responder saw %d requests, want none", n)
	}
}

func TestNewOptions(t *testing.T) {
	s := startServer(t)
	nc := jstest.Connect(t, s)
	bad := map[string]Option{
		"empty prefix":    Prefix(""),
		"wildcard prefix": Prefix("rl.*"),
		"zero timeout":    Timeout(0),
		"nil clock":       Clock(nil),
		"zero max keys":   MaxEmergencyBuckets(0),
	}
	for name, opt := range bad {
		if _, err := New(nc, opt); err == nil {
			t.Errorf("New with %s: no error", name)
		}
	}
	if _, err := New(nil); err == nil {
		t.Error("New(nil): no error")
	}
	c := newClient(t, nc, Prefix("a.b-c"))
	if c.Subject() != "a.b-c.v1.decide" {
		t.Errorf("Subject = %q", c.Subject())
	}
}
