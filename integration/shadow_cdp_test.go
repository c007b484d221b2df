package integration

// A headless Chromium driven over the DevTools protocol, for the dashboard
// tests: a minimal websocket client (RFC 6455, client side: masked text
// frames out; text, continuation, ping and close frames in) and a CDP
// client over it with flat sessions. No dependency beyond the standard
// library.

import (
	"bufio"
	"context"
	"crypto/rand"
	"crypto/sha1"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// wsConn is a client websocket connection.
type wsConn struct {
	c  net.Conn
	br *bufio.Reader
	mu sync.Mutex // serializes writes
}

// dialWS opens a websocket to a ws:// URL.
func dialWS(ctx context.Context, raw string) (*wsConn, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return nil, err
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", u.Host)
	if err != nil {
		return nil, err
	}
	var nonce [16]byte
	rand.Read(nonce[:])
	key := base64.StdEncoding.EncodeToString(nonce[:])
	req := "GET " + u.RequestURI() + " HTTP/1.1\r\nHost: " + u.Host +
		"\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: " + key +
		"\r\nSec-WebSocket-Version: 13\r\n\r\n"
	if _, err := io.WriteString(c, req); err != nil {
		c.Close()
		return nil, err
	}
	br := bufio.NewReaderSize(c, 1<<16)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		c.Close()
		return nil, err
	}
	sum := sha1.Sum([]byte(key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"))
	if resp.StatusCode != http.StatusSwitchingProtocols ||
		resp.Header.Get("Sec-WebSocket-Accept") != base64.StdEncoding.EncodeToString(sum[:]) {
		c.Close()
		return nil, fmt.Errorf("websocket handshake: %s", resp.Status)
	}
	return &wsConn{c: c, br: br}, nil
}

// writeFrame writes one masked frame.
func (w *wsConn) writeFrame(op byte, payload []byte) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	hdr := []byte{0x80 | op}
	switch n := len(payload); {
	case n < 126:
		hdr = append(hdr, 0x80|byte(n))
	case n <= 0xffff:
		hdr = append(hdr, 0x80|126)
		hdr = binary.BigEndian.AppendUint16(hdr, uint16(n))
	default:
		hdr = append(hdr, 0x80|127)
		hdr = binary.BigEndian.AppendUint64(hdr, uint64(n))
	}
	var mask [4]byte
	rand.Read(mask[:])
	hdr = append(hdr, mask[:]...)
	buf := make([]byte, len(hdr)+len(payload))
	copy(buf, hdr)
	for i, b := range payload {
		buf[len(hdr)+i] = b ^ mask[i%4]
	}
	_, err := w.c.Write(buf)
	return err
}

// read returns the next whole text or binary message.
func (w *wsConn) read() ([]byte, error) {
	var msg []byte
	for {
		var h [2]byte
		if _, err := io.ReadFull(w.br, h[:]); err != nil {
			return nil, err
		}
		fin, op := h[0]&0x80 != 0, h[0]&0x0f
		n := uint64(h[1] & 0x7f)
		switch n {
		case 126:
			var b [2]byte
			if _, err := io.ReadFull(w.br, b[:]); err != nil {
				return nil, err
			}
			n = uint64(binary.BigEndian.Uint16(b[:]))
		case 127:
			var b [8]byte
			if _, err := io.ReadFull(w.br, b[:]); err != nil {
				return nil, err
			}
			n = binary.BigEndian.Uint64(b[:])
		}
		var mask []byte
		if h[1]&0x80 != 0 {
			mask = make([]byte, 4)
			if _, err := io.ReadFull(w.br, mask); err != nil {
				return nil, err
			}
		}
		if n > 256<<20 {
			return nil, fmt.Errorf("websocket frame of %d bytes", n)
		}
		p := make([]byte, n)
		if _, err := io.ReadFull(w.br, p); err != nil {
			return nil, err
		}
		if mask != nil {
			for i := range p {
				p[i] ^= mask[i%4]
			}
		}
		switch op {
		case 0x8: // close
			w.writeFrame(0x8, nil)
			return nil, io.EOF
		case 0x9: // ping
			if err := w.writeFrame(0xA, p); err != nil {
				return nil, err
			}
			continue
		case 0xA: // pong
			continue
		}
		msg = append(msg, p...)
		if fin {
			return msg, nil
		}
	}
}

func (w *wsConn) close() { w.c.Close() }

// cdpClient speaks the DevTools protocol over a browser websocket.
type cdpClient struct {
	ws      *wsConn
	mu      sync.Mutex
	next    int64
	pending map[int64]chan cdpMessage
	events  []cdpMessage // Runtime.exceptionThrown, Log.entryAdded, console errors
	done    chan struct{}
}

type cdpMessage struct {
	ID        int64           `json:"id,omitempty"`
	Method    string          `json:"method,omitempty"`
	Params    json.RawMessage `json:"params,omitempty"`
	Result    json.RawMessage `json:"result,omitempty"`
	Error     *cdpError       `json:"error,omitempty"`
	SessionID string          `json:"sessionId,omitempty"`
}

type cdpError struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

func newCDP(ws *wsConn) *cdpClient {
	c := &cdpClient{ws: ws, pending: map[int64]chan cdpMessage{}, done: make(chan struct{})}
	go c.readLoop()
	return c
}

func (c *cdpClient) readLoop() {
	defer close(c.done)
	for {
		b, err := c.ws.read()
		if err != nil {
			return
		}
		var m cdpMessage
		if json.Unmarshal(b, &m) != nil {
			continue
		}
		c.mu.Lock()
		if m.ID != 0 {
			if ch := c.pending[m.ID]; ch != nil {
				ch <- m
				delete(c.pending, m.ID)
			}
		} else if m.Method == "Runtime.exceptionThrown" || m.Method == "Log.entryAdded" ||
			m.Method == "Runtime.consoleAPICalled" && strings.Contains(string(m.Params), `"type":"error"`) {
			c.events = append(c.events, m)
		}
		c.mu.Unlock()
	}
}

// call sends one command (to the browser, or to a page's session) and
// returns its result.
func (c *cdpClient) call(ctx context.Context, session, method string, params any) (json.RawMessage, error) {
	if params == nil {
		params = struct{}{}
	}
	p, err := json.Marshal(params)
	if err != nil {
		return nil, err
	}
	ch := make(chan cdpMessage, 1)
	c.mu.Lock()
	c.next++
	id := c.next
	c.pending[id] = ch
	c.mu.Unlock()
	b, _ := json.Marshal(cdpMessage{ID: id, Method: method, Params: p, SessionID: session})
	if err := c.ws.writeFrame(0x1, b); err != nil {
		return nil, err
	}
	select {
	case m := <-ch:
		if m.Error != nil {
			return nil, fmt.Errorf("%s: %d %s", method, m.Error.Code, m.Error.Message)
		}
		return m.Result, nil
	case <-c.done:
		return nil, errors.New(method + ": browser connection closed")
	case <-ctx.Done():
		return nil, fmt.Errorf("%s: %w", method, ctx.Err())
	}
}

// problems returns the page errors seen so far: exceptions, console
// errors and browser log entries of level error (CSP violations among
// them).
func (c *cdpClient) problems() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []string
	for _, e := range c.events {
		if e.Method == "Log.entryAdded" && !strings.Contains(string(e.Params), `"level":"error"`) {
			continue
		}
		out = append(out, e.Method+" "+string(e.Params))
	}
	return out
}

// browserPage is one tab of a headless Chromium started for a test.
type browserPage struct {
	t       testing.TB
	cdp     *cdpClient
	session string
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
	bin := chromiumPath(t)
	dir := t.TempDir()
	cmd := exec.Command(bin, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
		"--disable-background-networking", "--disable-component-update", "--disable-sync",
		"--disable-extensions", "--hide-scrollbars", "--mute-audio",
		"--user-data-dir="+dir, "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
		fmt.Sprintf("--window-size=%d,%d", width, height), "about:blank")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("start chromium: %v", err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-exited
	})

	var port, path string
	waitWithin(t, 60*time.Second, "chromium's DevToolsActivePort", func() bool {
		select {
		case <-exited:
			t.Fatalf("chromium exited: %s", stderr.String())
		default:
		}
		b, err := os.ReadFile(filepath.Join(dir, "DevToolsActivePort"))
		lines := strings.Split(strings.TrimSpace(string(b)), "\n")
		if err != nil || len(lines) < 2 {
			return false
		}
		port, path = strings.TrimSpace(lines[0]), strings.TrimSpace(lines[1])
		return true
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ws, err := dialWS(ctx, "ws://127.0.0.1:"+port+path)
	if err != nil {
		t.Fatalf("devtools websocket: %v", err)
	}
	c := newCDP(ws)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		c.call(ctx, "", "Browser.close", nil)
		ws.close()
	})
	res, err := c.call(ctx, "", "Target.createTarget", map[string]any{"url": "about:blank"})
	if err != nil {
		t.Fatal(err)
	}
	var target struct {
		TargetID string `json:"targetId"`
	}
	json.Unmarshal(res, &target)
	res, err = c.call(ctx, "", "Target.attachToTarget", map[string]any{"targetId": target.TargetID, "flatten": true})
	if err != nil {
		t.Fatal(err)
	}
	var att struct {
		SessionID string `json:"sessionId"`
	}
	json.Unmarshal(res, &att)
	p := &browserPage{t: t, cdp: c, session: att.SessionID}
	for _, m := range []string{"Page.enable", "Runtime.enable", "Log.enable"} {
		p.call(m, nil)
	}
	p.call("Emulation.setDeviceMetricsOverride", map[string]any{"width": width, "height": height, "deviceScaleFactor": 1, "mobile": false})
	return p
}

// call sends a command to the page and returns its result; an error fails
// the test.
func (p *browserPage) call(method string, params any) json.RawMessage {
	p.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res, err := p.cdp.call(ctx, p.session, method, params)
	if err != nil {
		p.t.Fatalf("devtools %v", err)
	}
	return res
}

// navigate loads url in the page.
func (p *browserPage) navigate(url string) {
	p.t.Helper()
	p.call("Page.navigate", map[string]any{"url": url})
}

// eval evaluates a JavaScript expression in the page and decodes its
// (JSON-serializable) value into out.
func (p *browserPage) eval(expr string, out any) {
	p.t.Helper()
	res := p.call("Runtime.evaluate", map[string]any{"expression": expr, "returnByValue": true, "awaitPromise": true})
	var r struct {
		Result struct {
			Value json.RawMessage `json:"value"`
		} `json:"result"`
		ExceptionDetails json.RawMessage `json:"exceptionDetails"`
	}
	if err := json.Unmarshal(res, &r); err != nil {
		p.t.Fatalf("evaluate %s: %v", expr, err)
	}
	if r.ExceptionDetails != nil {
		p.t.Fatalf("evaluate %s: %s", expr, r.ExceptionDetails)
	}
	if out != nil && r.Result.Value != nil {
		if err := json.Unmarshal(r.Result.Value, out); err != nil {
			p.t.Fatalf("evaluate %s: value %s: %v", expr, r.Result.Value, err)
		}
	}
}

// screenshot returns a PNG of the whole page.
func (p *browserPage) screenshot() []byte {
	p.t.Helper()
	res := p.call("Page.captureScreenshot", map[string]any{"format": "png", "captureBeyondViewport": true})
	var r struct {
		Data string `json:"data"`
	}
	json.Unmarshal(res, &r)
	b, err := base64.StdEncoding.DecodeString(r.Data)
	if err != nil {
		p.t.Fatalf("screenshot: %v", err)
	}
	return b
}
