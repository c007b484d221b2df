package shadow

import (
	"bytes"
	"context"
	"crypto/sha256"
	_ "embed"
	"encoding/base64"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/limitmesh/limitmesh/policies"
)

var (
	//go:embed web/index.html
	pageHTML string
	//go:embed web/style.css
	pageCSS string
	//go:embed web/app.js
	pageJS string
)

// page is the dashboard document with its style and script inlined, and
// csp the Content-Security-Policy that lets it load nothing but them and
// its event stream.
var page, csp = func() ([]byte, string) {
	html := strings.Replace(pageHTML, "{{STYLE}}", pageCSS, 1)
	html = strings.Replace(html, "{{SCRIPT}}", pageJS, 1)
	hash := func(s string) string {
		sum := sha256.Sum256([]byte(s))
		return "'sha256-" + base64.StdEncoding.EncodeToString(sum[:]) + "'"
	}
	return []byte(html), "default-src 'none'; script-src " + hash(pageJS) + "; style-src " + hash(pageCSS) +
		"; connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
}()

// DashboardConfig configures [NewDashboard].
type DashboardConfig struct {
	Prefix string       // installation prefix; default "rl"
	Logger *slog.Logger // nil: discard
	// Keepalive is how often an idle event stream gets a comment line, so
	// that proxies keep it open; default 15 s.
	Keepalive time.Duration
	// BucketWait is how often a stream retries opening <prefix>_shadow
	// while it does not exist yet; default 1 s.
	BucketWait time.Duration
}

// dashboard serves the shadow dashboard.
type dashboard struct {
	js     jetstream.JetStream
	bucket string
	log    *slog.Logger
	cfg    DashboardConfig
}

// NewDashboard returns the handler of the shadow dashboard (CONTRACT.md
// §7), for the node to mount at /shadow and /shadow/:
//
//	GET /shadow         the HTML page; its style and script are inlined
//	                    from the binary (go:embed) and its
//	                    Content-Security-Policy allows nothing else
//	GET /shadow/events  server-sent events from the KV bucket
//	                    <prefix>_shadow: at connect one event per stored
//	                    summary, then one per change; each event's data is
//	                    one summary's JSON as stored; a deleted summary is
//	                    an event named "remove" with data {"policy": NAME};
//	                    an event named "ready" (data {}) marks the end of
//	                    the stored summaries
//
// Other paths are 404 and other methods 405. The handler reads the bucket
// only; it waits for the bucket to exist.
func NewDashboard(js jetstream.JetStream, cfg DashboardConfig) http.Handler {
	if cfg.Prefix == "" {
		cfg.Prefix = "rl"
	}
	if cfg.Keepalive <= 0 {
		cfg.Keepalive = 15 * time.Second
	}
	if cfg.BucketWait <= 0 {
		cfg.BucketWait = time.Second
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	return &dashboard{js: js, bucket: Bucket(cfg.Prefix), log: log, cfg: cfg}
}

// Bucket is the KV bucket of the summaries of the installation with
// prefix: "rl_shadow" for "rl".
func Bucket(prefix string) string { return prefix + "_shadow" }

func (d *dashboard) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	path := strings.TrimSuffix(r.URL.Path, "/")
	if path != "/shadow" && path != "/shadow/events" {
		http.NotFound(w, r)
		return
	}
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
		return
	}
	if path == "/shadow" {
		h := w.Header()
		h.Set("Content-Type", "text/html; charset=utf-8")
		h.Set("Content-Security-Policy", csp)
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("Cache-Control", "no-cache")
		w.Write(page)
		return
	}
	d.events(w, r)
}

// events streams the bucket's summaries as server-sent events until the
// client goes away.
func (d *dashboard) events(w http.ResponseWriter, r *http.Request) {
	flusher, ok := w.(http.Flusher)
	if !ok {
		http.Error(w, "streaming unsupported", http.StatusInternalServerError)
		return
	}
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	io.WriteString(w, "retry: 2000\n\n")
	flusher.Flush()

	ctx := r.Context()
	keep := time.NewTicker(d.cfg.Keepalive)
	defer keep.Stop()
	kv := d.openBucket(ctx, w, flusher, keep.C)
	if kv == nil {
		return
	}
	watcher, err := kv.WatchAll(ctx)
	if err != nil {
		d.log.Warn("shadow dashboard: watch", "bucket", d.bucket, "err", err)
		return
	}
	defer watcher.Stop()
	var buf bytes.Buffer
	for {
		select {
		case <-ctx.Done():
			return
		case <-keep.C:
			io.WriteString(w, ": keepalive\n\n")
		case e, ok := <-watcher.Updates():
			if !ok {
				return
			}
			buf.Reset()
			appendEvent(&buf, e)
			if buf.Len() == 0 {
				continue
			}
			if _, err := w.Write(buf.Bytes()); err != nil {
				return
			}
		}
		flusher.Flush()
	}
}

// openBucket opens the summaries' bucket, waiting (with keepalives) until
// it exists; nil when the client went away.
func (d *dashboard) openBucket(ctx context.Context, w io.Writer, f http.Flusher, keep <-chan time.Time) jetstream.KeyValue {
	for {
		kv, err := d.js.KeyValue(ctx, d.bucket)
		if err == nil {
			return kv
		}
		if !errors.Is(err, jetstream.ErrBucketNotFound) {
			d.log.Debug("shadow dashboard: open bucket", "bucket", d.bucket, "err", err)
		}
		t := time.NewTimer(d.cfg.BucketWait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-keep:
			io.WriteString(w, ": waiting for the evaluator\n\n")
			f.Flush()
		case <-t.C:
		}
		t.Stop()
	}
}

// appendEvent writes the server-sent event of one watch update: nil (the
// end of the stored values) is "ready"; a summary put is its JSON on one
// data line; a delete or purge is "remove". Keys that are not candidate
// names (the elector's and the checkpoint's entries) write nothing.
func appendEvent(buf *bytes.Buffer, e jetstream.KeyValueEntry) {
	if e == nil {
		buf.WriteString("event: ready\ndata: {}\n\n")
		return
	}
	if policies.ValidateName(e.Key()) != nil {
		return
	}
	switch e.Operation() {
	case jetstream.KeyValuePut:
		buf.WriteString("data: ")
		if err := json.Compact(buf, e.Value()); err != nil {
			buf.Reset() // not JSON: not a summary
			return
		}
		buf.WriteString("\n\n")
	default:
		name, _ := json.Marshal(e.Key())
		buf.WriteString("event: remove\ndata: {\"policy\":")
		buf.Write(name)
		buf.WriteString("}\n\n")
	}
}
