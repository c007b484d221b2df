package client

import (
	"encoding/json"
	"math/big"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
)

// resService is a reservation service written for the tests: the four
// endpoints of CONTRACT.md §10 on a NATS micro service, over one limit of
// capacity limit units shared by every descriptor. With concurrency set,
// the limit counts the units of open reservations (a concurrency limit);
// without, units settled stay spent (a quota). It decodes requests with
// encoding/json and math/big, independently of the client's encoders.
type resService struct {
	t           testing.TB
	limit       int64 // micro-units
	concurrency bool

	mu      sync.Mutex
	held    int64 // micro-units of open reservations
	spent   int64 // micro-units settled (quota) or expired at their cost
	settled int64 // micro-units settled, over all reservations
	next    int
	open    map[string]*fakeReservation
	ended   map[string][]byte // the first ending reply of each ended reservation
	byRID   map[string][]byte // reserve replies by request_id
	calls   map[string][]map[string]json.RawMessage
	// fault, when set, can replace the handling of an endpoint's n-th call
	// (from 0); nil means handle it normally.
	fault func(endpoint string, n int) *fault
}

type fakeReservation struct {
	cost int64 // micro-units
	ttl  string
}

// fault replaces the normal handling of one request.
type fault struct {
	answer answer // an error (Code != 0) or silence, without handling the request
	drop   bool   // handle the request but send no reply (a lost reply)
}

// startResService serves the reservation endpoints under prefix on a
// connection of its own to s, with a limit of limit units.
func startResService(t testing.TB, nc *nats.Conn, prefix string, limit int64, concurrency bool) *resService {
	t.Helper()
	f := &resService{t: t, limit: limit * 1_000_000, concurrency: concurrency, open: map[string]*fakeReservation{},
		ended: map[string][]byte{}, byRID: map[string][]byte{}, calls: map[string][]map[string]json.RawMessage{}}
	svc, err := micro.AddService(nc, micro.Config{Name: "limitmesh", Version: "0.0.1", QueueGroup: "limitmesh"})
	if err != nil {
		t.Fatal(err)
	}
	g := svc.AddGroup(prefix + ".v1")
	for name, h := range map[string]func(map[string]json.RawMessage) (int, []byte){
		"reserve": f.reserve, "settle": f.settle, "release": f.release, "renew": f.renew,
	} {
		err := g.AddEndpoint(name, micro.HandlerFunc(func(req micro.Request) {
			var body map[string]json.RawMessage
			if err := json.Unmarshal(req.Data(), &body); err != nil {
				respondError(req, 400, "bad_request", err.Error())
				return
			}
			f.mu.Lock()
			n := len(f.calls[name])
			f.calls[name] = append(f.calls[name], body)
			var ft *fault
			if f.fault != nil {
				ft = f.fault(name, n)
			}
			if ft != nil && !ft.drop {
				f.mu.Unlock()
				if ft.answer.Code != 0 {
					respondError(req, ft.answer.Code, ft.answer.Symbol, ft.answer.Message)
				}
				return
			}
			code, reply := h(body)
			f.mu.Unlock()
			switch {
			case ft != nil: // dropped
			case code != 0:
				respondError(req, code, map[int]string{400: "bad_request", 404: "not_found"}[code], string(reply))
			default:
				_ = req.Respond(reply)
			}
		}))
		if err != nil {
			t.Fatal(err)
		}
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = svc.Stop() })
	return f
}

func respondError(req micro.Request, code int, symbol, message string) {
	body, _ := json.Marshal(map[string]string{"error": symbol, "message": message})
	_ = req.Error(strconv.Itoa(code), message, body)
}

// units parses a JSON cost (number or decimal string) to micro-units, or
// returns false when it is not a decimal with at most 6 fractional digits.
func units(raw json.RawMessage) (int64, bool) {
	s := string(raw)
	if uq, err := strconv.Unquote(s); err == nil {
		s = uq
	}
	r, ok := new(big.Rat).SetString(s)
	if !ok || r.Sign() < 0 {
		return 0, false
	}
	r.Mul(r, big.NewRat(1_000_000, 1))
	if !r.IsInt() || !r.Num().IsInt64() {
		return 0, false
	}
	return r.Num().Int64(), true
}

// decimal formats micro-units as a JSON number.
func decimal(m int64) json.RawMessage {
	s := new(big.Rat).SetFrac64(m, 1_000_000).FloatString(6)
	s = strings.TrimRight(strings.TrimRight(s, "0"), ".")
	return json.RawMessage(s)
}

func (f *resService) used() int64 {
	if f.concurrency {
		return f.held
	}
	return f.held + f.spent
}

func str(raw json.RawMessage) string {
	var s string
	_ = json.Unmarshal(raw, &s)
	return s
}

// ttl parses a request's ttl: default 30s, at most 1h.
func ttlOf(raw json.RawMessage) (time.Duration, string, bool) {
	if raw == nil {
		return 30 * time.Second, "", true
	}
	s := str(raw)
	d, err := time.ParseDuration(s)
	return d, s, err == nil && d > 0 && d <= time.Hour
}

func (f *resService) reserve(b map[string]json.RawMessage) (int, []byte) {
	if rid := str(b["request_id"]); rid != "" && f.byRID[rid] != nil {
		return 0, f.byRID[rid]
	}
	var d map[string]string
	if json.Unmarshal(b["descriptor"], &d) != nil || len(d) == 0 {
		return 400, []byte("descriptor")
	}
	cost := int64(1_000_000)
	if b["cost"] != nil {
		c, ok := units(b["cost"])
		if !ok || c == 0 {
			return 400, []byte("cost")
		}
		cost = c
	}
	ttl, ttlText, ok := ttlOf(b["ttl"])
	if !ok {
		return 400, []byte("ttl")
	}
	dry := string(b["dry_run"]) == "true"
	allowed := f.used()+cost <= f.limit
	reply := map[string]any{"allowed": allowed, "policy": "p", "revision": 7, "retry_after_ms": 0, "reset_after_ms": 1000}
	if allowed && !dry {
		f.next++
		id := "res-" + strconv.Itoa(f.next)
		f.open[id] = &fakeReservation{cost: cost, ttl: ttlText}
		f.held += cost
		reply["reservation"] = id
		reply["expires_in_ms"] = ttl.Milliseconds()
	}
	if !allowed {
		reply["retry_after_ms"] = 250
	}
	reply["remaining"] = decimal(max(f.limit-f.used(), 0))
	body, _ := json.Marshal(reply)
	if rid := str(b["request_id"]); rid != "" && !dry {
		f.byRID[rid] = body
	}
	return 0, body
}

// end ends reservation id with settled micro-units of it spent.
func (f *resService) end(id string, settled int64, outcome string) []byte {
	r := f.open[id]
	delete(f.open, id)
	f.held -= r.cost
	if !f.concurrency {
		f.spent += settled
	}
	f.settled += settled
	body, _ := json.Marshal(map[string]any{"reservation": id, "outcome": outcome, "settled": decimal(settled),
		"returned": decimal(r.cost - settled), "remaining": decimal(max(f.limit-f.used(), 0))})
	f.ended[id] = body
	return body
}

func (f *resService) settle(b map[string]json.RawMessage) (int, []byte) {
	id := str(b["reservation"])
	if f.ended[id] != nil {
		return 0, f.ended[id]
	}
	r := f.open[id]
	if r == nil {
		return 404, []byte("reservation " + id + " unknown or expired")
	}
	cost := r.cost
	if b["cost"] != nil {
		c, ok := units(b["cost"])
		if !ok || c > r.cost {
			return 400, []byte("cost above the reserved cost")
		}
		cost = c
	}
	return 0, f.end(id, cost, "settled")
}

func (f *resService) release(b map[string]json.RawMessage) (int, []byte) {
	id := str(b["reservation"])
	if f.ended[id] != nil {
		return 0, f.ended[id]
	}
	if f.open[id] == nil {
		return 404, []byte("reservation " + id + " unknown or expired")
	}
	return 0, f.end(id, 0, "released")
}

func (f *resService) renew(b map[string]json.RawMessage) (int, []byte) {
	id := str(b["reservation"])
	if f.ended[id] != nil {
		return 0, f.ended[id]
	}
	r := f.open[id]
	if r == nil {
		return 404, []byte("reservation " + id + " unknown or expired")
	}
	ttl, ttlText, ok := ttlOf(b["ttl"])
	if !ok {
		return 400, []byte("ttl")
	}
	r.ttl = ttlText
	body, _ := json.Marshal(map[string]any{"reservation": id, "outcome": "renewed", "settled": 0, "returned": 0,
		"remaining": decimal(max(f.limit-f.used(), 0)), "expires_in_ms": ttl.Milliseconds()})
	return 0, body
}

// expire ends reservation id as its expiry does: counted at its reserved
// cost (quota) or given back (concurrency); then it is unknown (404).
func (f *resService) expire(id string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	r := f.open[id]
	if r == nil {
		f.t.Fatalf("expire %s: not open", id)
	}
	delete(f.open, id)
	f.held -= r.cost
	if !f.concurrency {
		f.spent += r.cost
	}
}

// state returns the micro-units held by open reservations, spent, and
// settled over all reservations, and the number of open reservations.
func (f *resService) state() (held, spent, settled int64, open int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.held, f.spent, f.settled, len(f.open)
}

// openIDs returns the ids of the open reservations.
func (f *resService) openIDs() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var ids []string
	for id := range f.open {
		ids = append(ids, id)
	}
	return ids
}

// requests returns the requests an endpoint received so far.
func (f *resService) requests(endpoint string) []map[string]json.RawMessage {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]map[string]json.RawMessage(nil), f.calls[endpoint]...)
}

// count returns the number of requests an endpoint received so far.
func (f *resService) count(endpoint string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.calls[endpoint])
}

func (f *resService) setFault(fn func(endpoint string, n int) *fault) {
	f.mu.Lock()
	f.fault = fn
	f.mu.Unlock()
}
