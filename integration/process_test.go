package integration

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// procReadyTimeout bounds the wait for a `limitmesh serve` process to
// report ready (a cluster member waits for its peers and the meta leader).
const procReadyTimeout = 2 * time.Minute

// limitmeshBin is the limitmesh binary, built once per test run.
var limitmeshBin struct {
	once sync.Once
	path string
	err  error
}

// TestMain removes the binary built by buildBinary() after the run.
func TestMain(m *testing.M) {
	code := m.Run()
	if limitmeshBin.path != "" {
		os.RemoveAll(filepath.Dir(limitmeshBin.path))
	}
	os.Exit(code)
}

// buildBinary builds ./cmd/limitmesh once and returns its path.
func buildBinary(t *testing.T) string {
	t.Helper()
	limitmeshBin.once.Do(func() {
		dir, err := os.MkdirTemp("", "limitmesh-bin-")
		if err != nil {
			limitmeshBin.err = err
			return
		}
		limitmeshBin.path = filepath.Join(dir, "limitmesh")
		out, err := exec.Command("go", "build", "-o", limitmeshBin.path, "../cmd/limitmesh").CombinedOutput()
		if err != nil {
			limitmeshBin.err = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if limitmeshBin.err != nil {
		t.Fatal(limitmeshBin.err)
	}
	return limitmeshBin.path
}

// syncBuffer is a bytes.Buffer safe for a process writing while a test
// reads.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// proc is one `limitmesh serve` process. Its methods are for the test
// goroutine only.
type proc struct {
	t         *testing.T
	name      string   // server name
	args      []string // serve flags, reused by restart
	clientURL string   // nats://… of its embedded server ("" with --nats-url)
	httpURL   string   // http://… of /readyz and /metrics
	stderr    *syncBuffer

	cmd  *exec.Cmd
	done chan struct{} // closed when cmd has exited
}

// procSpec describes processes to start; zero fields are picked.
type procSpec struct {
	n        int        // number of processes
	natsURL  string     // join this NATS deployment instead of embedded servers
	extra    []string   // more serve flags for every process
	each     [][]string // more serve flags of process i (after extra), for i < len(each)
	replicas int        // --replicas; default 3
}

// startProcs starts spec.n serve processes (a JetStream cluster of their
// embedded servers unless spec.natsURL is set), waits until all are ready
// and stops them at cleanup.
func startProcs(t *testing.T, spec procSpec) []*proc {
	t.Helper()
	bin := buildBinary(t)
	if spec.replicas == 0 {
		spec.replicas = 3
	}
	ports := freePorts(t, 3*spec.n)
	var routes []string
	for i := 0; i < spec.n; i++ {
		routes = append(routes, fmt.Sprintf("nats://127.0.0.1:%d", ports[3*i+2]))
	}
	procs := make([]*proc, spec.n)
	for i := range procs {
		p := &proc{
			t:       t,
			name:    fmt.Sprintf("n%d", i+1),
			httpURL: fmt.Sprintf("http://127.0.0.1:%d", ports[3*i+1]),
			stderr:  &syncBuffer{},
		}
		p.args = []string{"serve",
			"--http", fmt.Sprintf("127.0.0.1:%d", ports[3*i+1]),
			"--replicas", fmt.Sprint(spec.replicas),
			"--drain-timeout", "5s",
		}
		if spec.natsURL != "" {
			p.args = append(p.args, "--nats-url", spec.natsURL)
		} else {
			p.clientURL = fmt.Sprintf("nats://127.0.0.1:%d", ports[3*i])
			p.args = append(p.args,
				"--data", t.TempDir(),
				"--server-name", p.name,
				"--nats-listen", fmt.Sprintf("127.0.0.1:%d", ports[3*i]),
				"--cluster-listen", fmt.Sprintf("127.0.0.1:%d", ports[3*i+2]),
				"--routes", strings.Join(routes, ","),
			)
		}
		p.args = append(p.args, spec.extra...)
		if i < len(spec.each) {
			p.args = append(p.args, spec.each[i]...)
		}
		p.start(bin)
		procs[i] = p
		t.Cleanup(func() {
			p.kill()
			if t.Failed() {
				t.Logf("stderr of %s (without route connection lines, last 6 kB):\n%s", p.name, tail(withoutRouteLines(p.stderr.String()), 6<<10))
			}
		})
	}
	for _, p := range procs {
		p.waitReady()
	}
	return procs
}

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "…" + s[len(s)-n:]
}

// start runs the process (again, for a restart) with its args.
func (p *proc) start(bin string) {
	p.t.Helper()
	p.cmd = exec.Command(bin, p.args...)
	p.cmd.Stderr = p.stderr
	p.cmd.Stdout = p.stderr
	if err := p.cmd.Start(); err != nil {
		p.t.Fatalf("start %s: %v", p.name, err)
	}
	done := make(chan struct{})
	p.done = done
	cmd := p.cmd
	go func() { _ = cmd.Wait(); close(done) }()
}

// restart starts the stopped process with the same flags (same --data and
// ports) and waits until it is ready.
func (p *proc) restart() {
	p.t.Helper()
	fmt.Fprintf(p.stderr, "---- restart ----\n")
	p.start(buildBinary(p.t))
	p.waitReady()
}

// running reports whether the process has not exited.
func (p *proc) running() bool {
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// ready reports whether GET /readyz answers 200.
func (p *proc) ready() bool {
	c := http.Client{Timeout: time.Second}
	resp, err := c.Get(p.httpURL + "/readyz")
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// waitReady polls /readyz until 200; it fails at once if the process
// exits.
func (p *proc) waitReady() {
	p.t.Helper()
	deadline := time.Now().Add(procReadyTimeout)
	for !p.ready() {
		if !p.running() {
			p.t.Fatalf("%s exited before it was ready: %v", p.name, p.cmd.ProcessState)
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("%s not ready after %s", p.name, procReadyTimeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// stop sends SIGTERM and waits for a clean exit (bounded); it kills the
// process and fails the test if it does not exit in time or exits non-zero.
func (p *proc) stop() {
	p.t.Helper()
	if !p.running() {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		if !p.cmd.ProcessState.Success() {
			p.t.Errorf("%s exited after SIGTERM: %v", p.name, p.cmd.ProcessState)
		}
	case <-time.After(waitTimeout):
		p.kill()
		p.t.Errorf("%s did not exit within %s of SIGTERM", p.name, waitTimeout)
	}
}

// kill sends SIGKILL and waits until the process is gone.
func (p *proc) kill() {
	if p.cmd == nil || !p.running() {
		return
	}
	_ = p.cmd.Process.Kill()
	<-p.done
}

// clientURLs returns the processes' client URLs, in order.
func clientURLs(procs []*proc) []string {
	urls := make([]string, len(procs))
	for i, p := range procs {
		urls[i] = p.clientURL
	}
	return urls
}

// procOfNode returns the index of the running process that logged node
// id, or -1.
func procOfNode(t *testing.T, procs []*proc, id string) int {
	for i, p := range procs {
		if p.running() && p.nodeID(t) == id {
			return i
		}
	}
	return -1
}

// connectURLs opens a client connection to urls[0] that may fail over to
// any of urls and reconnects forever (closed at cleanup).
func connectURLs(t *testing.T, urls ...string) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(strings.Join(urls, ","), nats.DontRandomize(),
		nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond), nats.Timeout(2*time.Second))
	if err != nil {
		t.Fatalf("connect %v: %v", urls, err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// streamInfo fetches the info of a bucket's stream.
func streamInfo(t *testing.T, nc *nats.Conn, stream string) *jetstream.StreamInfo {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	js, _ := jetstream.New(nc)
	s, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatalf("stream %s: %v", stream, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatalf("stream info %s: %v", stream, err)
	}
	return info
}

// checkR3 fails unless the stream has three replicas placed on the three
// servers named in want, with a leader.
func checkR3(t *testing.T, nc *nats.Conn, stream string, want []string) {
	t.Helper()
	info := streamInfo(t, nc, stream)
	if info.Config.Replicas != 3 {
		t.Fatalf("%s: replicas %d, want 3", stream, info.Config.Replicas)
	}
	if info.Cluster == nil || info.Cluster.Leader == "" {
		t.Fatalf("%s: no cluster leader: %+v", stream, info.Cluster)
	}
	peers := []string{info.Cluster.Leader}
	for _, r := range info.Cluster.Replicas {
		peers = append(peers, r.Name)
	}
	slices.Sort(peers)
	if !slices.Equal(peers, want) {
		t.Fatalf("%s: peers %v, want %v", stream, peers, want)
	}
}

// TestProcessCluster: three `limitmesh serve` processes whose embedded
// servers form one JetStream cluster (--cluster-listen, --routes,
// --server-name) create R3 buckets; a decision through each node works and
// the three together admit exactly the burst.
func TestProcessCluster(t *testing.T) {
	procs := startProcs(t, procSpec{n: 3})
	client := connectURLs(t, procs[0].clientURL)
	for _, b := range []string{"KV_rl_policies", "KV_rl_state"} {
		checkR3(t, client, b, []string{"n1", "n2", "n3"})
	}
	rev := putPolicy(t, client, "rl_policies", "slow", slowPolicy)
	waitProcsApplied(t, "slow", rev, procs...)
	d := map[string]string{"tenant": "procs"}
	if admitted := admitInTurn(t, procs, d, rev, 50); admitted != 40 {
		t.Fatalf("three processes admitted %d of 50 sequential requests, want the burst 40", admitted)
	}
}

// admitInTurn sends n decisions of descriptor d through procs' servers in
// turn, once each has applied policy revision rev, and returns how many
// were admitted.
func admitInTurn(t *testing.T, procs []*proc, d map[string]string, rev uint64, n int) int {
	t.Helper()
	conns := make([]*nats.Conn, len(procs))
	for i, p := range procs {
		conns[i] = connectURLs(t, p.clientURL)
		waitRevision(t, conns[i], d, rev)
	}
	admitted := 0
	for i := range n {
		r := decide(t, conns[i%len(conns)], "rl.v1.decide", req(d, ""))
		if r.Code != "" {
			t.Fatalf("decision %d through %s: %+v", i, procs[i%len(procs)].name, r)
		}
		if r.Allowed {
			admitted++
		}
	}
	return admitted
}

// TestProcessNATSURL: `limitmesh serve --nats-url` against an external
// 3-server JetStream cluster: two nodes, R3 buckets, decisions through
// both servers they use.
func TestProcessNATSURL(t *testing.T) {
	servers := embeddedCluster(t, 3)
	var urls []string
	for _, s := range servers {
		urls = append(urls, s.ClientURL())
	}
	procs := startProcs(t, procSpec{n: 2, natsURL: strings.Join(urls, ",")})
	client := connectURLs(t, urls[2])
	var names []string
	for _, s := range servers {
		names = append(names, s.Server().Name())
	}
	slices.Sort(names)
	checkR3(t, client, "KV_rl_state", names)
	rev := putPolicy(t, client, "rl_policies", "slow", slowPolicy)
	waitProcsApplied(t, "slow", rev, procs...)
	d := map[string]string{"tenant": "natsurl"}
	admitted := 0
	for i, u := range urls {
		nc := connectURLs(t, u)
		waitRevision(t, nc, d, rev)
		for j := 0; j < 20; j++ {
			r := decide(t, nc, "rl.v1.decide", req(d, ""))
			if r.Code != "" {
				t.Fatalf("decision through server %d: %+v", i, r)
			}
			if r.Allowed {
				admitted++
			}
		}
	}
	if admitted != 40 {
		t.Fatalf("admitted %d of 60, want 40", admitted)
	}
	for _, p := range procs {
		p.stop()
	}
}

// waitProcsApplied waits until every process reports policy name in force
// at revision rev or later (the limitmesh_policy_revision gauge).
func waitProcsApplied(t *testing.T, name string, rev uint64, procs ...*proc) {
	t.Helper()
	series := fmt.Sprintf(`limitmesh_policy_revision{policy=%q}`, name)
	for _, p := range procs {
		waitFor(t, p.name+" applies "+name, func() bool {
			v, ok, _ := procMetricValue(p, series)
			return ok && uint64(v) >= rev
		})
	}
}

// procMetricValue reads one series of the process's /metrics: its value,
// whether the series is there, and the error if the page could not be
// read.
func procMetricValue(p *proc, series string) (float64, bool, error) {
	c := http.Client{Timeout: testTimeout}
	resp, err := c.Get(p.httpURL + "/metrics")
	if err != nil {
		return 0, false, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, false, err
	}
	for _, l := range strings.Split(string(body), "\n") {
		if v, ok := strings.CutPrefix(l, series+" "); ok {
			got, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			return got, err == nil, err
		}
	}
	return 0, false, nil
}

// procMetric is procMetricValue for a series that may be absent (0); an
// unreadable page fails the test.
func procMetric(t *testing.T, p *proc, series string) float64 {
	t.Helper()
	v, _, err := procMetricValue(p, series)
	if err != nil {
		t.Fatalf("%s /metrics: %v", p.name, err)
	}
	return v
}

// withoutRouteLines drops the embedded servers' route connection lines
// (a killed peer fills the log with them) from a process's stderr.
func withoutRouteLines(s string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if !strings.Contains(l, "route") && !strings.Contains(l, "Route") {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
