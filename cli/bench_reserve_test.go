package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/limitmesh/limitmesh/mesh"
)

// checkReserveRun checks what every run of a reserve mode against a
// correct node must report: the contract's fields and the reserve modes',
// operations that add up, an echo baseline, the CPU per pair, no
// overshoot, and a clean leak check with every ended reservation counted
// by the node.
func checkReserveRun(t *testing.T, m map[string]any, mode string) {
	t.Helper()
	for _, k := range []string{"decisions_per_sec", "echo_per_sec", "ratio", "p50_ms", "p99_ms", "echo_p99_ms",
		"admitted", "denied", "overshoot", "requests", "cpu_us_per_decision", "cpu_us_per_pair", "cpu_us_per_request",
		"echo_cpu_us_per_request", "leaked_units", "leaked_keys", "keys_checked", "open_reservations", "leak_wait_s",
		"abandoned", "expired_before_end", "end_unknown"} {
		num(t, m, k)
	}
	if m["mode"] != mode {
		t.Errorf("mode = %v, want %s", m["mode"], mode)
	}
	admitted, denied, decisions := num(t, m, "admitted"), num(t, m, "denied"), num(t, m, "decisions")
	if admitted <= 0 || denied <= 0 || admitted+denied != decisions {
		t.Errorf("admitted %v, denied %v, decisions %v: want both and a sum", admitted, denied, decisions)
	}
	if num(t, m, "errors") != 0 || num(t, m, "unmatched") != 0 || num(t, m, "end_unknown") != 0 || num(t, m, "expired_before_end") != 0 {
		t.Errorf("errors %v, unmatched %v, end_unknown %v, expired_before_end %v: want 0 against an embedded node",
			m["errors"], m["unmatched"], m["end_unknown"], m["expired_before_end"])
	}
	// Every admitted reserve is followed by its end; a denied one is alone.
	if req := num(t, m, "requests"); req != 2*admitted+denied {
		t.Errorf("requests %v, want 2 × admitted %v + denied %v", req, admitted, denied)
	}
	if num(t, m, "echo_per_sec") <= 0 || num(t, m, "echo_requests") <= 0 {
		t.Errorf("no echo baseline: %v", m)
	}
	if pair, dec := num(t, m, "cpu_us_per_pair"), num(t, m, "cpu_us_per_decision"); pair <= 0 || pair < dec {
		t.Errorf("cpu_us_per_pair %v, cpu_us_per_decision %v: want a positive pair, at least an operation's", pair, dec)
	}
	if o := num(t, m, "overshoot"); o != 0 {
		t.Errorf("overshoot = %v units on %v keys, want 0", o, m["overshoot_keys"])
	}
	if l, k, open := num(t, m, "leaked_units"), num(t, m, "leaked_keys"), num(t, m, "open_reservations"); l != 0 || k != 0 || open != 0 {
		t.Errorf("leaked_units %v on %v keys, open_reservations %v: want 0", l, k, open)
	}
	if k := num(t, m, "keys_checked"); k < num(t, m, "keys_admitted") || k > num(t, m, "keys") {
		t.Errorf("keys_checked %v: want every key with admissions (%v) and at most --keys", k, m["keys_admitted"])
	}
	// The node ended each admitted reservation once, plus the probe.
	ended, _ := m["reservations_ended"].(map[string]any)
	outcome := "settled"
	if mode == "concurrency" {
		outcome = "released"
	}
	if got, _ := ended[outcome].(float64); got != admitted+1 || ended["expired"] != nil && ended["expired"] != 0.0 {
		t.Errorf("reservations_ended %v: want %v %s (the admitted and bench's probe), none expired", ended, admitted+1, outcome)
	}
}

// TestBenchReserve runs --mode reserve against the embedded node with a
// limit far below the load (5/s, burst 5 on 10 keys used uniformly, random
// costs up to 2): many reserves are denied, the settled units stay within
// the contract, and after the run every key is full again and nothing is
// open.
func TestBenchReserve(t *testing.T) {
	code, m, out, errOut := benchJSON(t, "--mode", "reserve", "--duration", "400ms", "--echo-duration", "300ms",
		"--keys", "10", "--zipf", "0", "--concurrency", "8", "--conns", "2", "--rate", "5/s", "--burst", "5",
		"--cost", "2", "--random-cost")
	if code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	checkReserveRun(t, m, "reserve")
	if m["ttl"] != "2s" || m["random_cost"] != true || m["cost"] != "2" {
		t.Errorf("flags not reported: ttl %v, random_cost %v, cost %v", m["ttl"], m["random_cost"], m["cost"])
	}
	for _, want := range []string{"mode reserve", "reserve+settle", "raw NATS echo", "overshoot: 0 units",
		"leaks: 0 of ", "open reservations 0", "µs per reserve+settle pair", "cost random up to 2"} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q:\n%s", want, out)
		}
	}
}

// TestBenchConcurrency runs --mode concurrency against the embedded node:
// 16 workers on 4 keys of 2 slots each, holding up to 2ms, so some
// acquires are denied; the clients never hold more than 2 slots of a key
// at once, and after the run every key's slots are free and nothing is
// open.
func TestBenchConcurrency(t *testing.T) {
	code, m, out, errOut := benchJSON(t, "--mode", "concurrency", "--duration", "400ms", "--echo-duration", "300ms",
		"--keys", "4", "--zipf", "0", "--concurrency", "16", "--conns", "2")
	if code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	checkReserveRun(t, m, "concurrency")
	// The default slots: --concurrency / --keys / 2.
	if m["slots"] != "2" || num(t, m, "hold_max_ms") != 2 {
		t.Errorf("slots %v, hold_max_ms %v: want 2 and 2", m["slots"], m["hold_max_ms"])
	}
	for _, want := range []string{"mode concurrency", "acquire+release", "concurrency 2 per key", "overshoot: 0 units",
		"(allowed: 2 units held at once per key)", "µs per acquire+release pair"} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q:\n%s", want, out)
		}
	}
}

// TestBenchReserveLeakCheckFails shows the leak check failing: workers
// abandon half their reservations with a ttl of a minute, far beyond
// --leak-wait, so they are still open when the check gives up, and in
// concurrency mode their slots keep the keys below full. bench reports
// them and exits 1. With a short ttl, the same abandoned reservations
// expire and the check passes.
func TestBenchReserveLeakCheckFails(t *testing.T) {
	for _, mode := range []string{"reserve", "concurrency"} {
		t.Run(mode, func(t *testing.T) {
			code, m, out, errOut := benchJSON(t, "--mode", mode, "--duration", "200ms", "--echo-duration", "200ms",
				"--keys", "8", "--zipf", "0", "--concurrency", "4", "--conns", "1", "--slots", "3",
				"--abandon", "0.5", "--ttl", "1m", "--leak-wait", "300ms")
			if code != 1 || !strings.Contains(errOut, "reservations still open") {
				t.Fatalf("exit %d, stderr %q: want 1 and the open reservations\nstdout:\n%s", code, errOut, out)
			}
			abandoned, open := num(t, m, "abandoned"), num(t, m, "open_reservations")
			if abandoned <= 0 || open != abandoned {
				t.Errorf("abandoned %v, open_reservations %v: want the abandoned ones open", abandoned, open)
			}
			if mode == "concurrency" {
				if num(t, m, "leaked_units") <= 0 || num(t, m, "leaked_keys") <= 0 || !strings.Contains(errOut, "not back to full") {
					t.Errorf("leaked_units %v on %v keys (stderr %q): want the abandoned slots missing", m["leaked_units"], m["leaked_keys"], errOut)
				}
			}
			if w := num(t, m, "leak_wait_s"); w < 0.3 {
				t.Errorf("leak_wait_s %v: the check gave up before --leak-wait", w)
			}
		})
	}
	t.Run("expired", func(t *testing.T) {
		code, m, out, errOut := benchJSON(t, "--mode", "concurrency", "--duration", "200ms", "--echo-duration", "200ms",
			"--rounds", "1", "--keys", "8", "--zipf", "0", "--concurrency", "4", "--conns", "1", "--slots", "3",
			"--abandon", "0.5", "--ttl", "300ms")
		if code != 0 {
			t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
		}
		ended, _ := m["reservations_ended"].(map[string]any)
		if num(t, m, "abandoned") <= 0 || ended["expired"] != num(t, m, "abandoned") {
			t.Errorf("abandoned %v, reservations_ended %v: want every abandoned one expired", m["abandoned"], ended)
		}
		if num(t, m, "open_reservations") != 0 || num(t, m, "leaked_units") != 0 {
			t.Errorf("open_reservations %v, leaked_units %v after expiry: want 0", m["open_reservations"], m["leaked_units"])
		}
	})
}

// fakeReserveNode answers the reserve endpoints on nc as a node of bench's
// policy in mode that admits every reserve, whatever its limit, and
// confirms every settle and release: the overshoot checks must catch it.
func fakeReserveNode(t *testing.T, nc *nats.Conn, mode string) {
	t.Helper()
	reply := func(m *nats.Msg, v string) { _ = m.Respond([]byte(v)) }
	sub := func(subject string, h nats.MsgHandler) {
		if _, err := nc.Subscribe(subject, h); err != nil {
			t.Fatal(err)
		}
	}
	sub("rl.v1.reserve", func(m *nats.Msg) {
		var req struct {
			Descriptor map[string]string `json:"descriptor"`
		}
		_ = json.Unmarshal(m.Data, &req)
		policy := "bench-" + mode + "-" + req.Descriptor["bench_run"]
		reply(m, fmt.Sprintf(`{"allowed":true,"policy":%q,"revision":1000000,"remaining":0,"retry_after_ms":0,"reset_after_ms":0,`+
			`"reservation":"r1.0.%s","expires_in_ms":2000}`, policy, req.Descriptor["key"]))
	})
	sub("rl.v1.settle", func(m *nats.Msg) {
		var req struct {
			Reservation string `json:"reservation"`
			Cost        string `json:"cost"`
		}
		_ = json.Unmarshal(m.Data, &req)
		reply(m, fmt.Sprintf(`{"reservation":%q,"outcome":"settled","settled":%s,"returned":0,"remaining":0,"policy":"p","revision":1}`, req.Reservation, req.Cost))
	})
	sub("rl.v1.release", func(m *nats.Msg) {
		var req struct {
			Reservation string `json:"reservation"`
		}
		_ = json.Unmarshal(m.Data, &req)
		reply(m, fmt.Sprintf(`{"reservation":%q,"outcome":"released","settled":0,"returned":1,"remaining":0,"policy":"p","revision":1}`, req.Reservation))
	})
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
}

// TestBenchReserveOvershootCheckFails runs both modes against a stand-in
// node that admits everything (on a real NATS server, with a policy
// bucket): the settled units beyond the token bucket, and the slots beyond
// the concurrency limit, are reported as overshoot and bench exits 1.
func TestBenchReserveOvershootCheckFails(t *testing.T) {
	for _, mode := range []string{"reserve", "concurrency"} {
		t.Run(mode, func(t *testing.T) {
			emb, err := mesh.StartEmbedded(mesh.EmbeddedConfig{Listen: "127.0.0.1:-1", DataDir: t.TempDir()})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(emb.Shutdown)
			nc, err := emb.Connect()
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(nc.Close)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			js, err := jetstream.New(nc)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "rl_policies"}); err != nil {
				t.Fatal(err)
			}
			fakeReserveNode(t, nc, mode)
			code, m, out, errOut := benchJSON(t, "--nats-url", emb.ClientURL(), "--mode", mode,
				"--duration", "200ms", "--echo-duration", "100ms", "--keys", "2", "--zipf", "0", "--concurrency", "8",
				"--rate", "1/s", "--burst", "1", "--slots", "1")
			if code != 1 || !strings.Contains(errOut, "this is a bug") {
				t.Fatalf("exit %d, stderr %q: want 1 and the overshoot\nstdout:\n%s", code, errOut, out)
			}
			if o, k := num(t, m, "overshoot"), num(t, m, "overshoot_keys"); o <= 0 || k != 2 {
				t.Errorf("overshoot %v on %v keys: want some on both keys", o, k)
			}
			// Against a deployment without --metrics-url the open
			// reservations are not measured, and absent.
			if _, ok := m["open_reservations"]; ok {
				t.Errorf("open_reservations = %v without --metrics-url: want it absent", m["open_reservations"])
			}
		})
	}
}

func TestBenchReserveBadFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--ttl", "5s"}, "--ttl is for --mode reserve and concurrency"},
		{[]string{"--slots", "3"}, "--slots is for"},
		{[]string{"--mode", "reserve", "--ttl", "0s"}, "--ttl"},
		{[]string{"--mode", "reserve", "--ttl", "2h"}, "--ttl"},
		{[]string{"--mode", "concurrency", "--hold", "3s", "--ttl", "2s"}, "--hold"},
		{[]string{"--mode", "reserve", "--abandon", "1.5"}, "--abandon"},
		{[]string{"--mode", "concurrency", "--slots", "-1"}, "--slots"},
		{[]string{"--mode", "reserve", "--candidates", "2"}, "--candidates and --flood"},
		{[]string{"--mode", "reserve", "--flood", "3"}, "--candidates and --flood"},
		{[]string{"--mode", "reserve", "--metrics-url", "http://127.0.0.1:9090/metrics"}, "--metrics-url is for a deployment"},
		{[]string{"--mode", "reserve", "--nats-url", "nats://127.0.0.1:1", "--metrics-url", "127.0.0.1:9090"}, "--metrics-url"},
	} {
		code, _, errOut := run(t, nil, append([]string{"bench"}, tc.args...)...)
		if code != 2 || !strings.Contains(errOut, tc.want) {
			t.Errorf("bench %v: exit %d, stderr %q; want 2 and %q", tc.args, code, errOut, tc.want)
		}
	}
	// Fewer slots than the cost: every acquire would be denied.
	code, _, errOut := run(t, nil, "bench", "--mode", "concurrency", "--slots", "1", "--cost", "2")
	if code != 1 || !strings.Contains(errOut, "--slots 1 is below --cost 2") {
		t.Errorf("--slots below --cost: exit %d, stderr %q", code, errOut)
	}
}
