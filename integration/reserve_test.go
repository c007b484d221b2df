package integration

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/mesh"
	"github.com/limitmesh/limitmesh/mesh/client"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
)

// resReply is a reserve, settle, release or renew reply, or a micro error.
type resReply struct {
	reply
	Reservation string  `json:"reservation"`
	ExpiresInMs int64   `json:"expires_in_ms"`
	Outcome     string  `json:"outcome"`
	Settled     float64 `json:"settled"`
	Returned    float64 `json:"returned"`
	Again       bool    `json:"again"`
}

// resRequest sends body to subject and decodes the reply.
func resRequest(t testing.TB, nc *nats.Conn, subject, body string) resReply {
	t.Helper()
	m, err := nc.Request(subject, []byte(body), testTimeout)
	if err != nil {
		t.Fatalf("%s request: %v", subject, err)
	}
	r := resReply{reply: reply{Partition: -1}}
	if err := json.Unmarshal(m.Data, &r); err != nil {
		t.Fatalf("%s reply %q: %v", subject, m.Data, err)
	}
	if m.Header != nil {
		r.Code = m.Header.Get(micro.ErrorCodeHeader)
	}
	return r
}

func settleBody(id, extra string) string {
	b, _ := json.Marshal(map[string]string{"reservation": id})
	if extra != "" {
		return strings.TrimSuffix(string(b), "}") + "," + extra + "}"
	}
	return string(b)
}

// TestReservations: the seed's export job (reserve 100, settle 37) on one
// node over NATS: the reserve holds the units, the settle gives 63 back
// and is answered again with its first outcome, an unknown id is a 404,
// a reserve retried with its request_id gets the same reservation; a
// concurrency policy admits N holders and denies the next until a
// release, refuses decide with a 400 naming rl.v1.reserve, and gets an
// abandoned holder's slot back at its expiry; the ledger counts the
// settled units, and the metrics the ends.
func TestReservations(t *testing.T) {
	e := server(t, t.TempDir())
	tn := startNode(t, e, mesh.NodeConfig{UsageInterval: 50 * time.Millisecond, LeaseTime: ownershipLease})
	rev := putPolicy(t, tn.nc, "rl_policies", "export",
		`{"match":{"tenant":"*","job":"export"},"key":["tenant"],"limits":[{"algorithm":"token_bucket","rate":"1/h","burst":100}]}`)
	crev := putPolicy(t, tn.nc, "rl_policies", "render",
		`{"match":{"tenant":"*","op":"render"},"key":["tenant"],"limits":[{"algorithm":"concurrency","limit":2}]}`)
	job := map[string]string{"tenant": "acme", "job": "export"}
	render := map[string]string{"tenant": "acme", "op": "render"}
	waitRevision(t, tn.nc, job, rev)
	waitApplied(t, "render", crev, tn)

	r := resRequest(t, tn.nc, "rl.v1.reserve", req(job, `"cost":100,"ttl":"1m"`))
	if r.Code != "" || !r.Allowed || r.Reservation == "" || r.Remaining != 0 || r.ExpiresInMs != 60000 {
		t.Fatalf("reserve: %+v", r)
	}
	if d := decide(t, tn.nc, "rl.v1.decide", req(job, `"dry_run":true`)); d.Allowed {
		t.Fatalf("the reserved units are free: %+v", d)
	}
	s := resRequest(t, tn.nc, "rl.v1.settle", settleBody(r.Reservation, `"cost":37`))
	if s.Code != "" || s.Outcome != "settled" || s.Settled != 37 || s.Returned != 63 || s.Remaining < 63 || s.Remaining > 63.1 {
		t.Fatalf("settle: %+v", s)
	}
	again := resRequest(t, tn.nc, "rl.v1.settle", settleBody(r.Reservation, `"cost":10`))
	if again.Code != "" || !again.Again || again.Settled != 37 || again.Returned != 63 {
		t.Fatalf("settle sent again: %+v", again)
	}
	if nf := resRequest(t, tn.nc, "rl.v1.release", settleBody("r1.000000000001.p.export.tenant=acme", "")); nf.Code != "404" || nf.Error != "not_found" {
		t.Fatalf("unknown id: %+v", nf)
	}
	if nf := resRequest(t, tn.nc, "rl.v1.renew", settleBody("not an id", "")); nf.Code != "404" {
		t.Fatalf("not an id: %+v", nf)
	}
	r1 := resRequest(t, tn.nc, "rl.v1.reserve", req(job, `"cost":5,"request_id":"job-7"`))
	r2 := resRequest(t, tn.nc, "rl.v1.reserve", req(job, `"cost":5,"request_id":"job-7"`))
	if !r1.Allowed || r1.Reservation != r2.Reservation || r2.Remaining < r1.Remaining || r2.Remaining > r1.Remaining+0.01 {
		t.Fatalf("reserve retried: %+v then %+v", r1, r2)
	}
	if rel := resRequest(t, tn.nc, "rl.v1.release", settleBody(r1.Reservation, "")); rel.Outcome != "released" || rel.Returned != 5 {
		t.Fatalf("release: %+v", rel)
	}

	// Concurrency: two slots.
	if d := decide(t, tn.nc, "rl.v1.decide", req(render, "")); d.Code != "400" || !strings.Contains(d.Msg, "rl.v1.reserve") {
		t.Fatalf("decide of a concurrency policy: %+v", d)
	}
	a := resRequest(t, tn.nc, "rl.v1.reserve", req(render, `"ttl":"1s"`))
	b := resRequest(t, tn.nc, "rl.v1.reserve", req(render, `"ttl":"1m"`))
	c := resRequest(t, tn.nc, "rl.v1.reserve", req(render, `"ttl":"1m"`))
	if !a.Allowed || !b.Allowed || c.Allowed || c.RetryAfterMs <= 0 || c.RetryAfterMs > 1000 {
		t.Fatalf("three holders of two slots: %+v, %+v, %+v", a, b, c)
	}
	resRequest(t, tn.nc, "rl.v1.release", settleBody(b.Reservation, ""))
	d := resRequest(t, tn.nc, "rl.v1.reserve", req(render, `"ttl":"1m"`))
	if !d.Allowed {
		t.Fatalf("after a release: %+v", d)
	}
	// a is abandoned: its slot comes back at its expiry, and the sweep
	// ends it as expired.
	waitFor(t, "the abandoned slot back", func() bool {
		return resRequest(t, tn.nc, "rl.v1.reserve", req(render, `"ttl":"1m","dry_run":true`)).Allowed
	})
	waitMetric(t, tn, `limitmesh_reservations_total{outcome="expired",policy="render"}`, 1)
	if nf := resRequest(t, tn.nc, "rl.v1.settle", settleBody(a.Reservation, "")); nf.Code != "404" {
		t.Fatalf("settle after the expiry: %+v", nf)
	}
	if v := metricValue(t, tn, `limitmesh_reservations_open{policy="render"}`); v != 1 {
		t.Fatalf("open render reservations %v, want 1", v)
	}
	if v := metricValue(t, tn, `limitmesh_reservations_total{outcome="settled",policy="export"}`); v != 1 {
		t.Fatalf("settled export reservations %v, want 1", v)
	}

	// The ledger: 37 + 0 units in two allowed records for export, the
	// expired render slot at 1 unit.
	day := time.Now().UTC().Format("2006-01-02")
	waitFor(t, "the ledger's export and render totals", func() bool {
		ex, ok1 := ledgerTotals(t, tn.nc, "export", day, "p.export.tenant=acme")
		rd, ok2 := ledgerTotals(t, tn.nc, "render", day, "p.render.tenant=acme")
		return ok1 && ok2 && ex.Allowed == 2 && ex.AllowedUnits.String() == "37" &&
			rd.Allowed == 2 && rd.AllowedUnits.String() == "1" && rd.Denied == 1
	})
	recs := usageRecords(t, tn.nc)
	ends := 0
	for _, rec := range recs["rl.usage.export"] {
		if rec.Reservation != "" {
			ends++
			if rec.Reservation != r.Reservation && rec.Reservation != r1.Reservation {
				t.Errorf("record of reservation %q", rec.Reservation)
			}
		}
	}
	if ends != 2 {
		t.Fatalf("%d reservation records for export, want 2: %+v", ends, recs["rl.usage.export"])
	}
}

// TestReservationsOwnerKilled: reservations on keys spread over the
// partitions of three serve processes; the owner of one of them is
// SIGKILLed with reservations open. Every reservation is then settled
// through the survivors: none is lost (no 404), each is answered once as
// settled and again with its first outcome, and the ledger counts each
// key's settled units exactly once.
func TestReservationsOwnerKilled(t *testing.T) {
	if testing.Short() {
		t.Skip("kill test with three processes")
	}
	procs := startProcs(t, procSpec{n: 3, extra: []string{"--usage-interval", "100ms"}})
	urls := clientURLs(procs)
	admin := connectURLs(t, urls...)
	rev := putPolicy(t, admin, "rl_policies", "jobs",
		`{"match":{"tenant":"*","job":"*"},"key":["tenant"],"limits":[{"algorithm":"token_bucket","rate":"1/h","burst":1000}]}`)
	waitProcsApplied(t, "jobs", rev, procs...)
	conns := make([]*nats.Conn, len(procs))
	for i := range procs {
		conns[i] = connectURLs(t, append(urls[i:i+1:i+1], urls...)...)
	}
	const tenants = 24
	type open struct {
		tenant, id string
		part       int
		settle     int
	}
	var all []open
	for i := range tenants {
		tenant := fmt.Sprintf("t%02d", i)
		r := resRequest(t, conns[i%3], "rl.v1.reserve", req(map[string]string{"tenant": tenant, "job": "export"}, `"cost":10,"ttl":"10m"`))
		if r.Code != "" || !r.Allowed || r.Partition < 0 {
			t.Fatalf("reserve for %s: %+v", tenant, r)
		}
		all = append(all, open{tenant: tenant, id: r.Reservation, part: r.Partition, settle: i % 11})
	}
	victim := procOfNode(t, procs, partOwner(admin, all[0].part))
	if victim < 0 {
		t.Fatalf("no process owns partition %d", all[0].part)
	}
	held := 0
	for _, o := range all {
		if procOfNode(t, procs, partOwner(admin, o.part)) == victim {
			held++
		}
	}
	procs[victim].kill()
	t.Logf("killed %s, owner of %d of the %d reserved keys", procs[victim].name, held, len(all))
	survivor := conns[(victim+1)%3]
	for _, o := range all {
		var s resReply
		waitWithin(t, faultTimeout, "settling "+o.id, func() bool {
			// While the partition moves a request may go unanswered, or
			// be answered 503: ask again.
			m, err := survivor.Request("rl.v1.settle", []byte(settleBody(o.id, fmt.Sprintf(`"cost":%d`, o.settle))), testTimeout)
			if err != nil {
				return false
			}
			s = resReply{reply: reply{Partition: -1}}
			if err := json.Unmarshal(m.Data, &s); err != nil {
				t.Fatalf("settle reply %q: %v", m.Data, err)
			}
			s.Code = m.Header.Get(micro.ErrorCodeHeader)
			return s.Code != "503"
		})
		if s.Code != "" || s.Outcome != "settled" || s.Settled != float64(o.settle) || s.Returned != float64(10-o.settle) {
			t.Fatalf("settle of %s after the kill: %+v", o.id, s)
		}
		if a := resRequest(t, survivor, "rl.v1.settle", settleBody(o.id, `"cost":1`)); !a.Again || a.Settled != float64(o.settle) {
			t.Fatalf("settle of %s again: %+v", o.id, a)
		}
	}
	day := time.Now().UTC().Format("2006-01-02")
	waitWithin(t, faultTimeout, "the ledger's settled units", func() bool {
		for _, o := range all {
			tot, ok := ledgerTotals(t, survivor, "jobs", day, "p.jobs.tenant="+o.tenant)
			if !ok || tot.Allowed != 1 || tot.AllowedUnits.String() != fmt.Sprint(o.settle) {
				return false
			}
		}
		return true
	})
}

// TestReservationsSDK: the Go SDK against a real node: Reserve and
// Settle, a concurrency slot held by Acquire and by the HTTP middleware
// (429 while both slots are taken, the slot back when the handler
// returns), and a Meter whose stream is stopped by a denied chunk, with
// exactly the units it used settled in the ledger.
func TestReservationsSDK(t *testing.T) {
	e := server(t, t.TempDir())
	tn := startNode(t, e, mesh.NodeConfig{UsageInterval: 50 * time.Millisecond, LeaseTime: ownershipLease})
	rev := putPolicy(t, tn.nc, "rl_policies", "tokens",
		`{"match":{"tenant":"*","op":"chat"},"key":["tenant"],"limits":[{"algorithm":"token_bucket","rate":"1/h","burst":1000}]}`)
	crev := putPolicy(t, tn.nc, "rl_policies", "slots",
		`{"match":{"tenant":"*","op":"render"},"key":["tenant"],"limits":[{"algorithm":"concurrency","limit":2}]}`)
	chat := map[string]string{"tenant": "acme", "op": "chat"}
	render := map[string]string{"tenant": "acme", "op": "render"}
	waitRevision(t, tn.nc, chat, rev)
	waitApplied(t, "slots", crev, tn)
	c, err := client.New(connect(t, e))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()

	r, err := c.Reserve(ctx, chat, 100, time.Minute)
	if err != nil || !r.Allowed || r.ID == "" {
		t.Fatalf("Reserve: %+v, %v", r, err)
	}
	st, err := c.Settle(ctx, r.ID, 37)
	if err != nil || st.Outcome != client.OutcomeSettled || st.Settled != "37" || st.Returned != "63" {
		t.Fatalf("Settle: %+v, %v", st, err)
	}
	if _, err := c.Release(ctx, "r1.000000000000.p.tokens.tenant=acme"); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("Release of an unknown id: %v", err)
	}

	slot, res, err := c.Acquire(ctx, render, 1, 10*time.Second)
	if err != nil || slot == nil {
		t.Fatalf("Acquire: %+v, %v", res, err)
	}
	inHandler := make(chan struct{})
	leave := make(chan struct{})
	h := client.ConcurrencyMiddleware(c, func(*http.Request) (client.Request, bool) {
		return client.Request{Descriptor: render, Cost: 1}, true
	}, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		inHandler <- struct{}{}
		<-leave
	}))
	srv := httptest.NewServer(h)
	defer srv.Close()
	first := make(chan int, 1)
	go func() {
		resp, err := http.Get(srv.URL)
		if err != nil {
			first <- 0
			return
		}
		resp.Body.Close()
		first <- resp.StatusCode
	}()
	<-inHandler // two slots held: the Acquire's and the handler's
	resp, err := http.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("a third holder: %d %v", resp.StatusCode, resp.Header)
	}
	close(leave)
	if code := <-first; code != http.StatusOK {
		t.Fatalf("the handler's request: %d", code)
	}
	if err := slot.Release(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "both slots back", func() bool {
		s, _, err := c.Acquire(ctx, render, 2, time.Second)
		if err != nil || s == nil {
			return false
		}
		return s.Release(ctx) == nil
	})

	// The meter: chunks of 300 of the 963 units left (1000 less the 37
	// settled): three chunks, and the fourth is denied at the 901st unit
	// (63 left): the stream stops with 900 used, all settled.
	m, err := client.NewMeter(c, chat, 300, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	used := 0
	for range 1000 {
		if err := m.Add(ctx, 1); err != nil {
			if !errors.Is(err, client.ErrChunkDenied) {
				t.Fatalf("Add: %v", err)
			}
			break
		}
		used++
	}
	if err := m.Close(ctx); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if used != 900 || m.Used() != 900 {
		t.Fatalf("the meter admitted %d units (Used %d), want 900", used, m.Used())
	}
	day := time.Now().UTC().Format("2006-01-02")
	waitFor(t, "the ledger's chat units", func() bool {
		tot, ok := ledgerTotals(t, tn.nc, "tokens", day, "p.tokens.tenant=acme")
		return ok && tot.AllowedUnits.String() == "937"
	})
}

// TestSecuredReservations: in a secured deployment a tenant reserves and
// settles through the imports of its account (its tenant bound from the
// account), and another tenant cannot settle its reservation (403).
func TestSecuredReservations(t *testing.T) {
	s := startSecured(t)
	node := s.dial(t, s.d.NodeCreds(), nil)
	startNodeOn(t, node, mesh.NodeConfig{Binder: binder(t, s, node)})
	admin := s.dial(t, s.d.AdminCreds(), nil)
	putPolicy(t, admin, "rl_policies", "jobs", `{"match":{"tenant":"*","job":"*"},"key":["tenant"],"limits":[{"algorithm":"token_bucket","rate":"1/h","burst":100}]}`)
	acme := s.dial(t, s.d.TenantCreds("acme"), nil)
	birch := s.dial(t, s.d.TenantCreds("birch"), nil)
	job := map[string]string{"job": "export"}
	var r resReply
	waitFor(t, "the policy on the node", func() bool {
		r = resRequest(t, acme, "rl.v1.reserve", req(job, `"cost":100`))
		return r.Policy == "jobs"
	})
	if !r.Allowed || !strings.HasSuffix(r.Reservation, ".p.jobs.tenant=acme") || r.Partition != -1 {
		t.Fatalf("acme's reserve: %+v", r)
	}
	if f := resRequest(t, birch, "rl.v1.settle", settleBody(r.Reservation, `"cost":1`)); f.Code != "403" {
		t.Fatalf("birch settling acme's reservation: %+v", f)
	}
	if f := resRequest(t, acme, "rl.v1.reserve", req(map[string]string{"job": "export", "tenant": "birch"}, "")); f.Code != "403" {
		t.Fatalf("acme reserving for birch: %+v", f)
	}
	if st := resRequest(t, acme, "rl.v1.settle", settleBody(r.Reservation, `"cost":40`)); st.Code != "" || st.Settled != 40 || st.Returned != 60 {
		t.Fatalf("acme's settle: %+v", st)
	}
}
