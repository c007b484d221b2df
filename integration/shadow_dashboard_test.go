package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/jstest"
	"github.com/limitmesh/limitmesh/internal/usagetest"
	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/limitmesh/limitmesh/policies"
	"github.com/limitmesh/limitmesh/shadow"
	"github.com/limitmesh/limitmesh/usage"
)

// domCandidate is what the dashboard shows of one candidate, read from the
// rendered DOM.
type domCandidate struct {
	Policy   string            `json:"policy"`
	Revision string            `json:"revision"`
	Fields   map[string]string `json:"fields"`
	Keys     []domKey          `json:"keys"`
	Lines    map[string]int    `json:"lines"` // chart series -> number of points drawn
}

type domKey struct {
	Key       string `json:"key"`
	WouldDeny string `json:"would_deny"`
}

// readDashboard is evaluated in the page: every candidate card, its
// numbers as displayed, its top keys and the points of its chart lines.
const readDashboard = `[...document.querySelectorAll("section.candidate")].map(c => ({
  policy: c.dataset.policy,
  revision: c.dataset.revision,
  fields: Object.fromEntries([...c.querySelectorAll(".stats [data-field]")].map(e => [e.dataset.field, e.textContent])),
  keys: [...c.querySelectorAll("tr[data-key]")].map(r => ({key: r.dataset.key, would_deny: r.querySelector("[data-field=key_would_deny]").textContent})),
  lines: Object.fromEntries([...c.querySelectorAll("polyline[data-series]")].map(l => [l.dataset.series, l.getAttribute("points").trim() === "" ? 0 : l.getAttribute("points").trim().split(/\s+/).length])),
}))`

// plain removes the thousands separators of a displayed number.
func plain(s string) string { return strings.ReplaceAll(s, ",", "") }

// showsSummary reports why the card c does not show s ("" when it does).
func showsSummary(c domCandidate, s shadow.Summary) string {
	want := map[string]string{
		"evaluated": fmt.Sprint(s.Evaluated), "would_allow": fmt.Sprint(s.WouldAllow),
		"would_deny": fmt.Sprint(s.WouldDeny), "live_denied": fmt.Sprint(s.LiveDenied),
		"both_denied": fmt.Sprint(s.BothDenied), "only_candidate_denied": fmt.Sprint(s.OnlyCandidateDenied),
		"only_live_denied": fmt.Sprint(s.OnlyLiveDenied), "would_deny_units": s.WouldDenyUnits.String(),
		"keys": fmt.Sprint(s.Keys),
	}
	for f, w := range want {
		if got := plain(c.Fields[f]); got != w {
			return fmt.Sprintf("%s: %s shows %q, the bucket holds %s", s.Policy, f, c.Fields[f], w)
		}
	}
	if c.Revision != strconv.FormatUint(s.Revision, 10) {
		return fmt.Sprintf("%s: revision %s, the bucket holds %d", s.Policy, c.Revision, s.Revision)
	}
	if len(c.Keys) != len(s.TopDenied) {
		return fmt.Sprintf("%s: %d top keys shown, the bucket holds %d", s.Policy, len(c.Keys), len(s.TopDenied))
	}
	for i, k := range s.TopDenied {
		if c.Keys[i].Key != k.Key || plain(c.Keys[i].WouldDeny) != fmt.Sprint(k.WouldDeny) {
			return fmt.Sprintf("%s: top key %d shows %+v, the bucket holds %+v", s.Policy, i, c.Keys[i], k)
		}
	}
	drawn := 0
	for _, p := range s.Series {
		if p.Evaluated > 0 {
			drawn++
		}
	}
	if drawn > 1 && (c.Lines["candidate"] != drawn || c.Lines["live"] != drawn) {
		return fmt.Sprintf("%s: chart lines %v, want %d points each", s.Policy, c.Lines, drawn)
	}
	return ""
}

// dashboardShows waits until the page shows exactly the summaries the
// bucket holds.
func dashboardShows(t *testing.T, page *browserPage, js jetstream.JetStream, what string) []domCandidate {
	t.Helper()
	var cards []domCandidate
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	jstest.EventuallyWhy(t, 60*time.Second, what+" (the dashboard shows the bucket's summaries)", func() (bool, string) {
		want := bucketSummaries(t, ctx, js)
		page.eval(readDashboard, &cards)
		if len(cards) != len(want) {
			return false, fmt.Sprintf("%d cards, %d summaries", len(cards), len(want))
		}
		for i, c := range cards {
			if c.Policy != want[i].Policy {
				return false, fmt.Sprintf("card %d is %s, want %s", i, c.Policy, want[i].Policy)
			}
			if why := showsSummary(c, want[i]); why != "" {
				return false, why
			}
		}
		return true, ""
	})
	return cards
}

// bucketSummaries reads every summary of rl_shadow, by name. It lists
// the keys with kvstate.Keys: a kv.ListKeys listing, while the evaluator
// rewrites the summaries, can miss one.
func bucketSummaries(t testing.TB, ctx context.Context, js jetstream.JetStream) []shadow.Summary {
	t.Helper()
	kv, err := js.KeyValue(ctx, shadow.Bucket("rl"))
	if err != nil {
		t.Fatal(err)
	}
	keys, err := kvstate.Keys(ctx, js, kv.Bucket(), "")
	if err != nil {
		t.Fatal(err)
	}
	var out []shadow.Summary
	for _, k := range keys {
		if policies.ValidateName(k) != nil {
			continue // the elector's and the checkpoint's entries
		}
		e, err := kv.Get(ctx, k)
		if err != nil {
			continue
		}
		var s shadow.Summary
		if err := json.Unmarshal(e.Value(), &s); err != nil {
			t.Fatalf("summary %s: %v", k, err)
		}
		out = append(out, s)
	}
	sortSummaries(out)
	return out
}

func sortSummaries(s []shadow.Summary) {
	for i := 1; i < len(s); i++ {
		for j := i; j > 0 && s[j].Policy < s[j-1].Policy; j-- {
			s[j], s[j-1] = s[j-1], s[j]
		}
	}
}

// dashboardServer serves the dashboard handler as a node would mount it.
func dashboardServer(t testing.TB, js jetstream.JetStream, prefix string) *httptest.Server {
	h := shadow.NewDashboard(js, shadow.DashboardConfig{Prefix: prefix})
	mux := http.NewServeMux()
	mux.Handle("/shadow", h)
	mux.Handle("/shadow/", h)
	hs := httptest.NewServer(mux)
	t.Cleanup(hs.Close)
	return hs
}

// saveScreenshot checks png is a PNG image and writes it to the file named
// by LIMITMESH_SHADOW_SCREENSHOT, if set (relative to the repository
// root), e.g. LIMITMESH_SHADOW_SCREENSHOT=docs/shadow-dashboard.png.
func saveScreenshot(t *testing.T, png []byte) {
	if !bytes.HasPrefix(png, []byte("\x89PNG\r\n\x1a\n")) || len(png) < 1000 {
		t.Fatalf("screenshot is not a PNG image (%d bytes)", len(png))
	}
	path := os.Getenv("LIMITMESH_SHADOW_SCREENSHOT")
	if path == "" {
		return
	}
	if !strings.HasPrefix(path, "/") {
		path = "../" + path
	}
	if err := os.WriteFile(path, png, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshot written to %s", path)
}

// noPageProblems fails the test on script errors or blocked loads (a
// Content-Security-Policy violation is a log entry of level error).
func noPageProblems(t *testing.T, page *browserPage) {
	t.Helper()
	if p := page.pageProblems(); len(p) > 0 {
		t.Fatalf("the page reported %d problems, the first:\n%s", len(p), strings.Join(p[:min(len(p), 3)], "\n"))
	}
}

// The candidates of the dashboard test.
var dashboardCandidates = map[string]string{
	"acme-search-v2": `{"match": {"tenant": "acme", "operation": "search"}, "key": ["tenant", "plan"],
		"limits": [{"name": "rate", "algorithm": "token_bucket", "rate": "4/s", "burst": 10}], "shadow": true,
		"description": "halve acme's search rate"}`,
	"per-user-cap": `{"match": {"user": "*"}, "key": ["tenant", "user"],
		"limits": [{"algorithm": "sliding_window", "limit": 12, "window": "10s"}], "shadow": true}`,
	"writes-strict": `{"match": {"operation": "write"}, "key": ["tenant"],
		"limits": [{"algorithm": "gcra", "rate": "2/s", "burst": 4}], "shadow": true}`,
}

// dashboardTraffic returns the usage records of seconds of traffic from
// startUs: a load that swells and ebbs over a few tenants and users, with
// live denials where the load is high.
func dashboardTraffic(startUs int64, seconds int, seed uint64) []usage.Record {
	rng := rand.New(rand.NewPCG(seed, 3))
	tenants := []string{"acme", "acme", "acme", "birch", "cedar", "dune"}
	var out []usage.Record
	for s := 0; s < seconds; s++ {
		load := 30 + 25*math.Sin(float64(startUs/1_000_000+int64(s))/25)
		n := int(load)
		for i := 0; i < n; i++ {
			op := "search"
			if rng.IntN(4) == 0 {
				op = "write"
			}
			d, _ := policies.NewDescriptor([]policies.Dim{
				{Name: "tenant", Value: tenants[rng.IntN(len(tenants))]},
				{Name: "operation", Value: op},
				{Name: "plan", Value: []string{"free", "pro"}[rng.IntN(2)]},
				{Name: "user", Value: fmt.Sprintf("u%d", rng.IntN(12))},
			})
			at := startUs + int64(s)*1_000_000 + int64(i)*1_000_000/int64(n)
			out = append(out, usage.Record{ID: fmt.Sprintf("n1.%d.%d", at, i), TimeUs: at, Descriptor: d,
				Cost: 1_000_000, Allowed: rng.Float64()*60 > load-15})
		}
	}
	return out
}

// publishUsage publishes recs as unmatched-policy batches of 200.
func publishUsage(t *testing.T, js jetstream.JetStream, recs []usage.Record) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	for i := 0; i < len(recs); i += 200 {
		b := usagetest.AppendBatch(nil, &usage.Batch{Node: "n1", Policy: "", Records: recs[i:min(i+200, len(recs))]})
		m := nats.NewMsg(usage.Subject("rl", ""))
		m.Data = b
		m.Header.Set(jetstream.MsgIDHeader, recs[i].ID)
		if _, err := js.PublishMsg(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
}

// totalEvaluated sums the bucket's evaluated counts.
func totalEvaluated(t testing.TB, js jetstream.JetStream) uint64 {
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	var n uint64
	for _, s := range bucketSummaries(t, ctx, js) {
		n += s.Evaluated
	}
	return n
}

// TestShadowDashboardBrowser: a live evaluator writes the summaries of
// three candidates to rl_shadow from usage traffic; the dashboard, loaded
// in a headless Chromium, shows exactly the numbers the bucket holds
// (counts, top denied keys, a chart point per series bucket), then the new
// numbers once more traffic arrives, and drops a deleted candidate. No
// script error and no blocked load (nothing outside the binary).
func TestShadowDashboardBrowser(t *testing.T) {
	chromiumPath(t)
	e := server(t, t.TempDir())
	nc := connect(t, e)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	pkv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "rl_policies", History: 16})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: usage.StreamName("rl"), Subjects: []string{usage.Subjects("rl")}}); err != nil {
		t.Fatal(err)
	}
	for name, doc := range dashboardCandidates {
		putPolicy(t, nc, "rl_policies", name, doc)
	}
	ev, err := shadow.NewEvaluator(js, shadow.Config{NodeID: "n1", Lease: 500 * time.Millisecond,
		FlushInterval: 100 * time.Millisecond, CheckpointInterval: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ectx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ev.Run(ectx) }()
	t.Cleanup(func() { stop(); <-done })

	now := time.Now().UnixMicro() / 1_000_000 * 1_000_000
	first := dashboardTraffic(now-300_000_000, 240, 1)
	publishUsage(t, js, first)
	_, err = js.KeyValue(ctx, "rl_shadow") // the evaluator creates it
	for err != nil && ctx.Err() == nil {
		time.Sleep(20 * time.Millisecond)
		_, err = js.KeyValue(ctx, "rl_shadow")
	}
	if err != nil {
		t.Fatal(err)
	}
	waitWithin(t, 60*time.Second, "the evaluator to summarize the first traffic", func() bool {
		s := bucketSummaries(t, ctx, js)
		return len(s) == 3 && s[2].Evaluated > 0 && s[0].Evaluated+s[1].Evaluated+s[2].Evaluated == expectedEvaluated(t, first)
	})

	hs := dashboardServer(t, js, "rl")
	page := startBrowser(t, 1280, 900)
	page.navigate(hs.URL + "/shadow")
	before := dashboardShows(t, page, js, "the first traffic")
	var status string
	page.eval(`document.getElementById("status").dataset.state`, &status)
	if status != "live" {
		t.Errorf("connection status %q, want live", status)
	}

	second := dashboardTraffic(now-60_000_000, 60, 2)
	publishUsage(t, js, second)
	want := expectedEvaluated(t, append(first, second...))
	waitWithin(t, 60*time.Second, "the evaluator to summarize the second traffic", func() bool { return totalEvaluated(t, js) == want })
	after := dashboardShows(t, page, js, "the second traffic")
	for i := range after {
		if after[i].Fields["evaluated"] == before[i].Fields["evaluated"] {
			t.Errorf("%s: evaluated still shows %s after more traffic", after[i].Policy, after[i].Fields["evaluated"])
		}
	}
	saveScreenshot(t, page.screenshot())

	deletePolicy(t, nc, "rl_policies", "writes-strict")
	waitWithin(t, 60*time.Second, "the evaluator to delete the summary", func() bool { return len(bucketSummaries(t, ctx, js)) == 2 })
	cards := dashboardShows(t, page, js, "the deleted candidate gone")
	if len(cards) != 2 {
		t.Errorf("%d cards after deleting a candidate, want 2", len(cards))
	}
	noPageProblems(t, page)
	_ = pkv
}

// expectedEvaluated is the number of (record, candidate) evaluations the
// dashboard candidates make of recs.
func expectedEvaluated(t testing.TB, recs []usage.Record) uint64 {
	var ps []*policies.Policy
	for name, doc := range dashboardCandidates {
		p, err := policies.Parse(name, []byte(doc))
		if err != nil {
			t.Fatal(err)
		}
		ps = append(ps, p)
	}
	r := shadow.NewReplay(shadow.Options{})
	r.SetCandidates(ps)
	for i := range recs {
		r.Apply(&recs[i])
	}
	var n uint64
	for _, s := range r.Summaries() {
		n += s.Evaluated
	}
	return n
}
