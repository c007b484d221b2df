package shadow

import (
	"bufio"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// TestDashboardPage: the page is self-contained (its style and script
// inline, no URL of another origin anywhere) and its CSP allows exactly
// them; other paths and methods are refused.
func TestDashboardPage(t *testing.T) {
	s := startServer(t)
	_, js := connectJS(t, s)
	hs := httptest.NewServer(NewDashboard(js, DashboardConfig{}))
	defer hs.Close()
	for _, path := range []string{"/shadow", "/shadow/"} {
		resp, err := http.Get(hs.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		body := new(strings.Builder)
		bufio.NewReader(resp.Body).WriteTo(body)
		resp.Body.Close()
		if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/html") {
			t.Fatalf("%s: %d %s", path, resp.StatusCode, resp.Header.Get("Content-Type"))
		}
		page := body.String()
		if strings.Contains(page, "{{") || !strings.Contains(page, "<style>") || !strings.Contains(page, "<script>") {
			t.Fatalf("%s: the page's style or script is not inlined", path)
		}
		if m := regexp.MustCompile(`(?i)(src|href)\s*=\s*["'](https?:)?//`).FindString(page); m != "" {
			t.Fatalf("%s: the page loads from elsewhere: %s", path, m)
		}
		c := resp.Header.Get("Content-Security-Policy")
		if !strings.Contains(c, "default-src 'none'") || !strings.Contains(c, "script-src 'sha256-") || strings.Contains(c, "unsafe-inline") {
			t.Fatalf("%s: CSP %q", path, c)
		}
	}
	for path, code := range map[string]int{"/shadow/x": 404, "/other": 404} {
		resp, err := http.Get(hs.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != code {
			t.Errorf("%s: %d, want %d", path, resp.StatusCode, code)
		}
	}
	resp, err := http.Post(hs.URL+"/shadow", "text/plain", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("POST: %d", resp.StatusCode)
	}
}

// sseEvent is one server-sent event.
type sseEvent struct{ name, data string }

// readEvents reads events from r into a channel until it ends.
func readEvents(r *bufio.Reader) <-chan sseEvent {
	out := make(chan sseEvent, 64)
	go func() {
		defer close(out)
		var ev sseEvent
		for {
			line, err := r.ReadString('\n')
			if err != nil {
				return
			}
			line = strings.TrimRight(line, "\n")
			switch {
			case line == "":
				if ev.data != "" || ev.name != "" {
					out <- ev
				}
				ev = sseEvent{}
			case strings.HasPrefix(line, "event: "):
				ev.name = line[len("event: "):]
			case strings.HasPrefix(line, "data: "):
				ev.data += line[len("data: "):]
			}
		}
	}()
	return out
}

func nextEvent(t *testing.T, ch <-chan sseEvent) sseEvent {
	t.Helper()
	select {
	case ev, ok := <-ch:
		if !ok {
			t.Fatal("the event stream ended")
		}
		return ev
	case <-time.After(waitLimit):
		t.Fatal("no event")
	}
	return sseEvent{}
}

// TestDashboardEvents: a stream opened before the bucket exists waits for
// it, then sends every stored summary (one JSON object per event, the
// lease and checkpoint entries left out), "ready", each change as it is
// put and a "remove" for a deleted summary.
func TestDashboardEvents(t *testing.T) {
	s := startServer(t)
	_, js := connectJS(t, s)
	hs := httptest.NewServer(NewDashboard(js, DashboardConfig{BucketWait: 20 * time.Millisecond}))
	defer hs.Close()
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "GET", hs.URL+"/shadow/events", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Fatalf("content type %q", ct)
	}
	events := readEvents(bufio.NewReader(resp.Body))

	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "rl_shadow"})
	if err != nil {
		t.Fatal(err)
	}
	put := func(s Summary) {
		b, _ := json.MarshalIndent(s, "", "  ") // stored on several lines: sent on one
		if _, err := kv.Put(ctx, s.Policy, b); err != nil {
			t.Fatal(err)
		}
	}
	put(Summary{Policy: "a", Revision: 3, Evaluated: 10, TopDenied: []TopKey{}})
	kv.Put(ctx, LeaderKey, []byte(`{"node":"n1"}`))
	kv.Put(ctx, CheckpointKey, []byte(`{"object":"x"}`))
	var got Summary
	ev := nextEvent(t, events)
	if ev.name != "" || json.Unmarshal([]byte(ev.data), &got) != nil || got.Policy != "a" || got.Evaluated != 10 {
		t.Fatalf("first event %+v", ev)
	}
	if ev := nextEvent(t, events); ev.name != "ready" {
		t.Fatalf("want ready, got %+v", ev)
	}
	put(Summary{Policy: "a", Revision: 3, Evaluated: 25, TopDenied: []TopKey{}})
	if ev := nextEvent(t, events); json.Unmarshal([]byte(ev.data), &got) != nil || got.Evaluated != 25 {
		t.Fatalf("update event %+v", ev)
	}
	if err := kv.Delete(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if ev := nextEvent(t, events); ev.name != "remove" || ev.data != `{"policy":"a"}` {
		t.Fatalf("remove event %+v", ev)
	}
}
