package cli

import (
	"encoding/json"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/limitmesh/limitmesh/internal/jstest"
	"github.com/nats-io/nats.go/micro"
)

// fakeReservations answers the four reservation endpoints (CONTRACT.md
// §10) with fixed replies, standing in for a node: reservation "res-1"
// exists (any other is a 404), a settle above 10 units is a 400, and a
// reserve of the descriptor tenant=full is denied. It records each
// request body.
type fakeReservations struct {
	url  string
	mu   sync.Mutex
	seen map[string][]string // endpoint -> bodies
}

func startFakeReservations(t *testing.T, prefix string) *fakeReservations {
	t.Helper()
	srv := jstest.Start(t, jstest.NoJetStream)
	nc := jstest.Connect(t, srv.Server)
	f := &fakeReservations{url: srv.ClientURL(), seen: map[string][]string{}}
	svc, err := micro.AddService(nc, micro.Config{Name: "limitmesh", Version: "0.0.1", QueueGroup: "limitmesh"})
	if err != nil {
		t.Fatal(err)
	}
	g := svc.AddGroup(prefix + ".v1")
	for _, endpoint := range []string{"reserve", "settle", "release", "renew"} {
		err := g.AddEndpoint(endpoint, micro.HandlerFunc(func(req micro.Request) {
			f.mu.Lock()
			f.seen[endpoint] = append(f.seen[endpoint], string(req.Data()))
			f.mu.Unlock()
			var b struct {
				Descriptor  map[string]string `json:"descriptor"`
				Reservation string            `json:"reservation"`
				Cost        json.RawMessage   `json:"cost"`
			}
			if err := json.Unmarshal(req.Data(), &b); err != nil {
				_ = req.Error("400", "malformed JSON", []byte(`{"error":"bad_request","message":"malformed JSON"}`))
				return
			}
			switch {
			case endpoint == "reserve" && b.Descriptor["tenant"] == "full":
				_ = req.Respond([]byte(`{"allowed":false,"policy":"exports","revision":4,"remaining":0,"retry_after_ms":1200,"reset_after_ms":0}`))
			case endpoint == "reserve":
				_ = req.Respond([]byte(`{"allowed":true,"policy":"exports","revision":4,"remaining":2,"retry_after_ms":0,"reset_after_ms":0,"reservation":"res-1","expires_in_ms":30000}`))
			case b.Reservation != "res-1":
				_ = req.Error("404", "reservation not found", []byte(`{"error":"not_found","message":"reservation `+b.Reservation+` is unknown or expired"}`))
			case endpoint == "settle" && strings.HasPrefix(string(b.Cost), `"`):
				_ = req.Error("400", "invalid cost", []byte(`{"error":"bad_request","message":"cost `+string(b.Cost)+` is not a decimal"}`))
			case endpoint == "settle" && b.Cost != nil && costAbove(b.Cost, 10):
				_ = req.Error("400", "cost above the reserved cost", []byte(`{"error":"bad_request","message":"cost above the reserved cost 10"}`))
			case endpoint == "renew":
				_ = req.Respond([]byte(`{"reservation":"res-1","outcome":"renewed","settled":0,"returned":0,"remaining":2,"expires_in_ms":60000}`))
			case endpoint == "release":
				_ = req.Respond([]byte(`{"reservation":"res-1","outcome":"released","settled":0,"returned":10,"remaining":12}`))
			default:
				_ = req.Respond([]byte(`{"reservation":"res-1","outcome":"settled","settled":2.5,"returned":7.5,"remaining":4.5}`))
			}
		}))
		if err != nil {
			t.Fatal(err)
		}
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	return f
}

// costAbove reports whether the JSON number cost is above limit.
func costAbove(cost json.RawMessage, limit float64) bool {
	v, err := strconv.ParseFloat(string(cost), 64)
	return err != nil || v > limit
}

// last returns the last body endpoint received, with its keys sorted.
func (f *fakeReservations) last(t *testing.T, endpoint string) string {
	t.Helper()
	f.mu.Lock()
	defer f.mu.Unlock()
	bodies := f.seen[endpoint]
	if len(bodies) == 0 {
		t.Fatalf("no %s request", endpoint)
	}
	var v any
	if err := json.Unmarshal([]byte(bodies[len(bodies)-1]), &v); err != nil {
		t.Fatalf("%s body %q: %v", endpoint, bodies[len(bodies)-1], err)
	}
	b, _ := json.Marshal(v)
	return string(b)
}

func (f *fakeReservations) count(endpoint string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.seen[endpoint])
}

func TestReserveCommand(t *testing.T) {
	f := startFakeReservations(t, "rl")
	code, out, errOut := run(t, nil, "reserve", "--nats-url", f.url, "-d", "tenant=acme", "-d", "operation=export",
		"--cost", "10", "--ttl", "45s", "--request-id", "job-7")
	if code != 0 || out != `{"allowed":true,"policy":"exports","revision":4,"remaining":2,"retry_after_ms":0,"reset_after_ms":0,"reservation":"res-1","expires_in_ms":30000}`+"\n" || errOut != "" {
		t.Fatalf("reserve: exit %d\n%s%s", code, out, errOut)
	}
	if got, want := f.last(t, "reserve"), `{"cost":10,"descriptor":{"operation":"export","tenant":"acme"},"request_id":"job-7","ttl":"45s"}`; got != want {
		t.Errorf("body %s, want %s", got, want)
	}

	// Without --ttl the body has none (the node's default); --dry-run.
	if code, _, errOut := run(t, nil, "reserve", "--nats-url", f.url, "-d", "tenant=acme", "--dry-run"); code != 0 {
		t.Fatalf("dry run: exit %d: %s", code, errOut)
	}
	if got, want := f.last(t, "reserve"), `{"descriptor":{"tenant":"acme"},"dry_run":true}`; got != want {
		t.Errorf("body %s, want %s", got, want)
	}

	// The ttl goes as given, for the node to judge; so does --json.
	run(t, nil, "reserve", "--nats-url", f.url, "-d", "tenant=acme", "--ttl", "soon")
	if got := f.last(t, "reserve"); !strings.Contains(got, `"ttl":"soon"`) {
		t.Errorf("body %s", got)
	}
	raw := `{"descriptor":{"tenant":"acme"},"cost":3,"ttl":"2m"}`
	if code, _, errOut := run(t, nil, "reserve", "--nats-url", f.url, raw); code != 0 || f.last(t, "reserve") != `{"cost":3,"descriptor":{"tenant":"acme"},"ttl":"2m"}` {
		t.Errorf("positional JSON: exit %d %s, body %s", code, errOut, f.last(t, "reserve"))
	}

	// A denial is a reply like any other: printed, exit 0.
	code, out, _ = run(t, nil, "reserve", "--nats-url", f.url, "-d", "tenant=full")
	if code != 0 || !strings.HasPrefix(out, `{"allowed":false,"policy":"exports"`) {
		t.Errorf("denied: exit %d, %s", code, out)
	}

	n := f.count("reserve")
	for _, args := range [][]string{
		{"--json", raw, "--ttl", "1m"},
		{"-d", "novalue"},
		{},
	} {
		code, _, errOut := run(t, nil, append([]string{"reserve", "--nats-url", f.url}, args...)...)
		if code != 1 || strings.Count(errOut, "\n") != 1 {
			t.Errorf("reserve %q: exit %d, stderr %q; want 1 and one line", args, code, errOut)
		}
	}
	if f.count("reserve") != n {
		t.Error("invalid reserves were sent")
	}
}

func TestSettleReleaseRenewCommands(t *testing.T) {
	f := startFakeReservations(t, "rl")
	for _, tc := range []struct {
		args []string
		body string // the request, keys sorted
		out  string
	}{
		{[]string{"settle", "res-1", "--cost", "2.5"}, `{"cost":2.5,"reservation":"res-1"}`,
			`{"reservation":"res-1","outcome":"settled","settled":2.5,"returned":7.5,"remaining":4.5}`},
		{[]string{"settle", "--cost", "0", "res-1"}, `{"cost":0,"reservation":"res-1"}`, ""},
		{[]string{"settle", "res-1"}, `{"reservation":"res-1"}`, ""},
		{[]string{"release", "res-1"}, `{"reservation":"res-1"}`,
			`{"reservation":"res-1","outcome":"released","settled":0,"returned":10,"remaining":12}`},
		{[]string{"renew", "res-1", "--ttl", "1m"}, `{"reservation":"res-1","ttl":"1m"}`,
			`{"reservation":"res-1","outcome":"renewed","settled":0,"returned":0,"remaining":2,"expires_in_ms":60000}`},
		{[]string{"renew", "res-1"}, `{"reservation":"res-1"}`, ""},
	} {
		code, out, errOut := run(t, nil, append(tc.args, "--nats-url", f.url)...)
		if code != 0 || errOut != "" || (tc.out != "" && out != tc.out+"\n") {
			t.Errorf("%q: exit %d\n%s%s", tc.args, code, out, errOut)
		}
		if got := f.last(t, tc.args[0]); got != tc.body {
			t.Errorf("%q: body %s, want %s", tc.args, got, tc.body)
		}
	}
}

// TestReservationCommandErrors: a 404 is one clear line on stderr, nothing
// on stdout, exit 1; another error answer prints the node's body and says
// the code (as decide does); bad usage is exit 2; no node is one line.
func TestReservationCommandErrors(t *testing.T) {
	f := startFakeReservations(t, "rl")
	for _, cmd := range [][]string{{"settle", "res-9", "--cost", "1"}, {"release", "res-9"}, {"renew", "res-9", "--ttl", "1m"}} {
		code, out, errOut := run(t, nil, append(cmd, "--nats-url", f.url)...)
		if want := "limitmesh " + cmd[0] + `: reservation "res-9" not found: it is unknown or expired` + "\n"; code != 1 || out != "" || errOut != want {
			t.Errorf("%q: exit %d, stdout %q, stderr %q; want exit 1 and %q", cmd, code, out, errOut, want)
		}
	}

	code, out, errOut := run(t, nil, "settle", "res-1", "--cost", "11", "--nats-url", f.url)
	if code != 1 || out != `{"error":"bad_request","message":"cost above the reserved cost 10"}`+"\n" ||
		errOut != "limitmesh settle: the node answered 400: cost above the reserved cost\n" {
		t.Errorf("400: exit %d, stdout %q, stderr %q", code, out, errOut)
	}

	// A cost that is not a plain number goes as a string for the node to judge.
	code, out, errOut = run(t, nil, "settle", "res-1", "--cost", "1e3", "--nats-url", f.url)
	if code != 1 || f.last(t, "settle") != `{"cost":"1e3","reservation":"res-1"}` || !strings.Contains(out, `is not a decimal`) {
		t.Errorf("--cost 1e3: exit %d, body %s, stdout %q, stderr %q", code, f.last(t, "settle"), out, errOut)
	}

	n := f.count("settle") + f.count("release") + f.count("renew")
	for _, args := range [][]string{{"settle"}, {"settle", "a", "b"}, {"release"}, {"renew", "--bogus", "res-1"}, {"release", ""}} {
		if code, _, errOut := run(t, nil, append(args, "--nats-url", f.url)...); code != 2 {
			t.Errorf("%q: exit %d, want 2; stderr %q", args, code, errOut)
		}
	}
	if f.count("settle")+f.count("release")+f.count("renew") != n {
		t.Error("requests were sent on bad usage")
	}

	// Another prefix: nobody answers there.
	code, _, errOut = run(t, nil, "release", "res-1", "--nats-url", f.url, "--prefix", "other")
	if code != 1 || errOut != "limitmesh release: no limitmesh node answers on other.v1.release (is `limitmesh serve` running, at version 1.2 or later?)\n" {
		t.Errorf("no responders: exit %d, stderr %q", code, errOut)
	}
}

// TestReservationCommandsPrefix: --prefix moves the subjects.
func TestReservationCommandsPrefix(t *testing.T) {
	f := startFakeReservations(t, "edge")
	for _, args := range [][]string{{"reserve", "-d", "tenant=acme"}, {"settle", "res-1"}, {"release", "res-1"}, {"renew", "res-1"}} {
		if code, out, errOut := run(t, []string{"LIMITMESH_PREFIX=edge"}, append(args, "--nats-url", f.url)...); code != 0 {
			t.Errorf("%q with LIMITMESH_PREFIX=edge: exit %d\n%s%s", args, code, out, errOut)
		}
	}
}
