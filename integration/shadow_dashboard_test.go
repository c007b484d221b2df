package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/limitmesh/limitmesh/policies"
	"github.com/limitmesh/limitmesh/shadow"
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
func dashboardShows(t *testing.T, page *browserPage, kv jetstream.KeyValue, what string) []domCandidate {
	t.Helper()
	var cards []domCandidate
	var why string
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	waitFor(t, what+" (the dashboard shows the bucket's summaries)", func() bool {
		want := bucketSummaries(t, ctx, kv)
		page.eval(readDashboard, &cards)
		if len(cards) != len(want) {
			why = fmt.Sprintf("%d cards, %d summaries", len(cards), len(want))
			return false
		}
		for i, c := range cards {
			if c.Policy != want[i].Policy {
				why = fmt.Sprintf("card %d is %s, want %s", i, c.Policy, want[i].Policy)
				return false
			}
			if why = showsSummary(c, want[i]); why != "" {
				return false
			}
		}
		return true
	})
	_ = why
	return cards
}

// bucketSummaries reads every summary of the bucket, by name.
func bucketSummaries(t testing.TB, ctx context.Context, kv jetstream.KeyValue) []shadow.Summary {
	t.Helper()
	lister, err := kv.ListKeys(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var out []shadow.Summary
	for k := range lister.Keys() {
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
	if p := page.cdp.problems(); len(p) > 0 {
		t.Fatalf("the page reported problems:\n%s", strings.Join(p, "\n"))
	}
}

var _ = time.Second
