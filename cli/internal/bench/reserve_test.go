package bench

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
)

func TestReservePlanBodies(t *testing.T) {
	c := &Config{Mode: Reserve, Rate: "10/s", Burst: "20", Cost: "1.5", Concurrency: 64, Keys: 10}
	c.Prefix = "rl"
	c.Reserve.TTL = 2 * time.Second
	p, err := newBenchPlan(c, "abcd0123")
	if err != nil {
		t.Fatal(err)
	}
	if p.decideSubj != "rl.v1.reserve" || p.res.endSubj != "rl.v1.settle" || p.res.capacity != 20*kvstate.Unit || p.policyName != "bench-reserve-abcd0123" {
		t.Errorf("plan %+v, res %+v", p, p.res)
	}
	if !strings.Contains(string(p.policyDoc), `"mode":"strict"`) || !strings.Contains(string(p.policyDoc), `"algorithm":"token_bucket"`) {
		t.Errorf("policy %s: want a strict token_bucket", p.policyDoc)
	}
	var req struct {
		Descriptor map[string]string `json:"descriptor"`
		Cost       string            `json:"cost"`
		TTL        string            `json:"ttl"`
	}
	if body := p.appendReserve(nil, 7, 1_250_000); json.Unmarshal(body, &req) != nil || req.Descriptor["key"] != "k7" ||
		req.Descriptor["bench_run"] != "abcd0123" || req.Cost != "1.25" || req.TTL != "2s" {
		t.Errorf("reserve body %s", body)
	}
	// An id with escapes is copied as its JSON token and names the same id.
	reply := []byte(`{"allowed":true,"policy":"bench-reserve-abcd0123","revision":1,"remaining":0,"retry_after_ms":0,"reset_after_ms":0,"reservation":"r1.00ab.x\"y\\z","expires_in_ms":2000}`)
	id, ok := scanReservation(reply)
	if !ok || string(id) != `"r1.00ab.x\"y\\z"` {
		t.Fatalf("scanReservation = %s, %v", id, ok)
	}
	var end struct {
		Reservation string `json:"reservation"`
		Cost        string `json:"cost"`
	}
	if body := p.appendEnd(nil, id, 0); json.Unmarshal(body, &end) != nil || end.Reservation != `r1.00ab.x"y\z` || end.Cost != "0" {
		t.Errorf("settle body %s", body)
	}
	if _, ok := scanReservation([]byte(`{"allowed":false,"policy":"p"}`)); ok {
		t.Error("a reply without a reservation has none")
	}
	if id, ok := scanReservation([]byte(`{ "reservation" : "r2.ff.k" }`)); !ok || string(id) != `"r2.ff.k"` {
		t.Errorf("another layout: %s, %v", id, ok)
	}
	for _, tc := range []struct {
		reply string
		units int64
		want  bool
	}{
		{`{"reservation":"r","outcome":"settled","settled":0.5,"returned":1}`, 500_000, true},
		{`{"reservation":"r","outcome":"settled","settled":0.55,"returned":1}`, 500_000, false},
		{`{"reservation":"r","outcome":"settled","settled":0,"returned":1}`, 0, true},
		{`{"reservation":"r","outcome":"released","settled":0,"returned":1}`, 0, false},
		{`{"reservation":"r","outcome":"settled","settled":3}`, 3 * kvstate.Unit, true},
		{`{"error":"not_found","message":"x"}`, 0, false},
	} {
		if got := p.endConfirmed([]byte(tc.reply), tc.units); got != tc.want {
			t.Errorf("endConfirmed(%s, %d) = %v", tc.reply, tc.units, got)
		}
	}

	c.Mode = "concurrency"
	if p, err = newBenchPlan(c, "abcd0123"); err != nil {
		t.Fatal(err)
	}
	// 64 workers on 10 keys: 3 slots each.
	if p.res.endSubj != "rl.v1.release" || p.res.capacity != 3*kvstate.Unit || !strings.Contains(string(p.policyDoc), `"algorithm":"concurrency","limit":3`) {
		t.Errorf("concurrency plan: %s, %+v", p.policyDoc, p.res)
	}
	if body := p.appendEnd(nil, []byte(`"r1.0.k"`), 0); string(body) != `{"reservation":"r1.0.k"}` {
		t.Errorf("release body %s", body)
	}
	if !p.endConfirmed([]byte(`{"reservation":"r","outcome":"released","settled":0}`), 0) {
		t.Error("a release reply not confirmed")
	}
}

// TestSlotOvershoot plants the bug the concurrency check exists to find:
// a third holder of a key with 2 slots is an excess of one slot, the
// largest excess is what counts, and releases bring the count back.
func TestSlotOvershoot(t *testing.T) {
	rb := &resBench{rp: &resPlan{concurrency: true, capacity: 2 * kvstate.Unit}, slots: make([]slotTally, 2)}
	u := kvstate.Unit
	rb.acquired(0, u)
	rb.acquired(0, u)
	if e := rb.slots[0].excess.Load(); e != 0 {
		t.Fatalf("two holders of 2 slots: excess %d", e)
	}
	rb.acquired(0, u)
	rb.acquired(0, u/2)
	rb.slots[0].held.Add(-2 * u)
	rb.acquired(0, u)
	if e := rb.slots[0].excess.Load(); e != 3*u/2 {
		t.Errorf("excess %d, want 1.5 slots (the largest seen)", e)
	}
	if e := rb.slots[1].excess.Load(); e != 0 {
		t.Errorf("another key's excess %d", e)
	}
}

func TestReservationMetrics(t *testing.T) {
	text := []byte(`# HELP limitmesh_reservations_open Open reservations.
# TYPE limitmesh_reservations_open gauge
limitmesh_reservations_open{policy="bench-reserve-1"} 3
limitmesh_reservations_open{policy="other"} 7
limitmesh_reservations_total{outcome="settled",policy="bench-reserve-1"} 120
limitmesh_reservations_total{policy="bench-reserve-1",outcome="expired"} 2 1700000000000
limitmesh_reservations_total{outcome="released",policy="other"} 9
limitmesh_decisions_total{policy="bench-reserve-1",result="allowed"} 5
limitmesh_reservations_open{policy="odd \"name\""} 11
broken{policy="bench-reserve-1" 4
`)
	ended := map[string]float64{}
	if open := reservationMetrics(text, "bench-reserve-1", ended); open != 3 {
		t.Errorf("open = %v, want 3", open)
	}
	if len(ended) != 2 || ended["settled"] != 120 || ended["expired"] != 2 {
		t.Errorf("ended = %v", ended)
	}
	if open := reservationMetrics(text, `odd "name"`, map[string]float64{}); open != 11 {
		t.Errorf("an escaped label value: open = %v, want 11", open)
	}
	if open := reservationMetrics(text, "absent", map[string]float64{}); open != 0 {
		t.Errorf("a policy without the series has none open: %v", open)
	}
}
