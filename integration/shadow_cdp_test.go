package integration

// A headless Chromium driven over the DevTools protocol by chromedp, for
// the dashboard tests.

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/log"
	"github.com/chromedp/cdproto/runtime"
	"github.com/chromedp/chromedp"
)

// browserPage is one tab of a headless Chromium started for a test.
type browserPage struct {
	t   testing.TB
	ctx context.Context // the tab's chromedp context

	mu       sync.Mutex
	problems []string // see pageProblems
}

// chromiumPath returns the Chromium binary, or skips the test when there
// is none and LIMITMESH_REQUIRE_BROWSER is unset (CI sets it, so there a
// missing browser fails the test).
func chromiumPath(t testing.TB) string {
	for _, p := range []string{"chromium", "chromium-browser"} {
		if path, err := exec.LookPath(p); err == nil {
			return path
		}
	}
	if os.Getenv("LIMITMESH_REQUIRE_BROWSER") != "" {
		t.Fatal("chromium is not installed and LIMITMESH_REQUIRE_BROWSER is set (apt-get install -y chromium)")
	}
	t.Skip("chromium is not installed (apt-get install -y chromium); set LIMITMESH_REQUIRE_BROWSER=1 to fail instead")
	return ""
}

// startBrowser starts a headless Chromium with a fresh profile and opens
// one page of width x height CSS pixels; everything is stopped at cleanup.
func startBrowser(t testing.TB, width, height int) *browserPage {
	t.Helper()
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(chromiumPath(t)),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.NoSandbox,
		chromedp.Flag("disable-gpu", true),
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("hide-scrollbars", true),
		chromedp.Flag("mute-audio", true),
		chromedp.WindowSize(width, height),
	)
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	p := &browserPage{t: t}
	ctx, cancel := chromedp.NewContext(actx, chromedp.WithListener(p.record))
	p.ctx = ctx
	t.Cleanup(func() {
		cancel() // closes the browser
		cancelAlloc()
	})
	// The first run starts the browser and attaches the tab; it must not
	// have a deadline (the browser lives as long as its context).
	if err := chromedp.Do(ctx); err != nil {
		t.Fatalf("start chromium: %v", err)
	}
	p.do(chromedp.EmulateViewport(int64(width), int64(height)))
	return p
}

// record keeps the page errors among the tab's events: exceptions, console
// errors and browser log entries of level error (CSP violations among
// them). It runs in the tab's event loop.
func (p *browserPage) record(ev any) {
	var method string
	switch e := ev.(type) {
	case *runtime.EventExceptionThrown:
		method = "Runtime.exceptionThrown"
	case *runtime.EventConsoleAPICalled:
		if e.Type != runtime.ConsoleAPICalledTypeError {
			return
		}
		method = "Runtime.consoleAPICalled"
	case *log.EventEntryAdded:
		if e.Entry == nil || e.Entry.Level != log.EntryLevelError {
			return
		}
		method = "Log.entryAdded"
	default:
		return
	}
	b, _ := json.Marshal(ev)
	p.mu.Lock()
	p.problems = append(p.problems, method+" "+string(b))
	p.mu.Unlock()
}

// pageProblems returns the page errors seen so far.
func (p *browserPage) pageProblems() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.problems...)
}

// do runs actions in the page within 30s; an error fails the test.
func (p *browserPage) do(actions ...chromedp.Action[chromedp.Void]) {
	p.t.Helper()
	ctx, cancel := context.WithTimeout(p.ctx, 30*time.Second)
	defer cancel()
	if err := chromedp.Do(ctx, actions...); err != nil {
		p.t.Fatalf("devtools: %v", err)
	}
}

// navigate loads url in the page.
func (p *browserPage) navigate(url string) {
	p.t.Helper()
	p.do(chromedp.Navigate(url))
}

// eval evaluates a JavaScript expression in the page and decodes its
// (JSON-serializable) value into out.
func (p *browserPage) eval(expr string, out any) {
	p.t.Helper()
	ctx, cancel := context.WithTimeout(p.ctx, 30*time.Second)
	defer cancel()
	raw, err := chromedp.Run(ctx, chromedp.Evaluate[[]byte](expr, chromedp.EvalAwaitPromise))
	if err != nil {
		p.t.Fatalf("evaluate %s: %v", expr, err)
	}
	if out != nil && raw != nil {
		if err := json.Unmarshal(raw, out); err != nil {
			p.t.Fatalf("evaluate %s: value %s: %v", expr, raw, err)
		}
	}
}

// screenshot returns a PNG of the whole page.
func (p *browserPage) screenshot() []byte {
	p.t.Helper()
	ctx, cancel := context.WithTimeout(p.ctx, 30*time.Second)
	defer cancel()
	b, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err != nil {
		p.t.Fatalf("screenshot: %v", err)
	}
	return b
}
