package usage

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/limitmesh/limitmesh/policies"
)

// PublisherConfig configures a [Publisher].
type PublisherConfig struct {
	Prefix string // subject prefix; default "rl"
	Node   string // the node's id, [A-Za-z0-9_-]{1,64}; required
	// Boot is unique per start of the process, [A-Za-z0-9_-]{1,64} and not
	// j<digits>; default NewBoot(). Ordinary ids are <Node>.<Boot>.<n>.
	Boot string
	// Interval is the most time a record waits in memory before its batch
	// is published (--usage-interval); default 250 ms.
	Interval time.Duration
	// MaxBuffered is the most records held (waiting or being published)
	// while JetStream is slow or unreachable; Add drops and counts what
	// exceeds it. Default 1,000,000.
	MaxBuffered int
	// MaxBatch is the most records in one message; default 20,000. A
	// policy whose buffer reaches it is published before the interval
	// ends. A message is also at most 768 KiB (less when the server's
	// payload limit is lower): records grouped by key (CONTRACT.md §6a)
	// take 10 to 40 bytes each, their key's fields once per message.
	MaxBatch int
	// Timeout bounds one publish attempt; default 5 s. A failed attempt is
	// retried (same Nats-Msg-Id) until it succeeds or Close gives up.
	Timeout    time.Duration
	Registerer prometheus.Registerer // nil: metrics are not registered
	Logger     *slog.Logger          // nil: no logs
}

// Defaults of PublisherConfig.
const (
	DefaultInterval    = 250 * time.Millisecond
	DefaultMaxBuffered = 1_000_000
	DefaultMaxBatch    = 20_000
	DefaultTimeout     = 5 * time.Second
)

// Publisher publishes a node's usage records in batches (CONTRACT.md §6):
// one message per policy subject, <prefix>.usage.<policy>, every Interval
// (sooner when a policy has MaxBatch records waiting), each with a header
// Nats-Msg-Id unique per batch and the same when the batch is retried, so
// the stream stores it once.
//
// Order: the messages of one subject are published one at a time, in the
// order their records were added; a batch that fails is retried (with
// backoff) before any later batch of its subject. Records of one policy
// therefore reach the stream in the order of Add.
//
// Add is the hot path (one call per decision): it never blocks on I/O and
// allocates nothing in the steady state. The background work is one
// goroutine that cuts the buffers and one sender goroutine per policy
// subject. Memory is bounded by MaxBuffered records.
//
// All methods are safe for concurrent use.
type Publisher struct {
	js       jetstream.JetStream
	cfg      PublisherConfig
	stream   string
	idPrefix string // <node>.<boot>.

	subjects atomic.Pointer[map[string]*subjectBuf]
	mu       sync.Mutex // guards adding subjects, closed
	closed   bool
	isClosed atomic.Bool

	held     atomic.Int64 // records accepted and not yet acknowledged or given up
	maxBytes int          // the most bytes of a message

	jmu      sync.Mutex
	journals map[originKey]JournalPos // per origin, the last journalled record accepted (AddJournal)

	kick     chan struct{} // cut now (a full buffer, Sync, Close)
	progMu   sync.Mutex
	progress chan struct{} // closed (and replaced) on every acknowledgement

	ctx    context.Context // cancelled when Close gives up: publishes abort
	cancel context.CancelFunc
	stop   chan struct{} // closed by Close after its final cut
	wg     sync.WaitGroup

	m *publisherMetrics
	l *slog.Logger
}

// originKey names an origin, <node>.<boot>, without building the string.
type originKey struct{ node, boot string }

// entry is a buffered record. A journalled record has its origin
// (node, boot) and position; an ordinary one has node "" and gets its id
// from its message (<batch>.<i>) unless r.ID names one.
type entry struct {
	r          Record
	node, boot string
	pos        JournalPos
}

// subjectBuf is the buffer and send queue of one policy subject.
type subjectBuf struct {
	policy  string
	subject string

	mu     sync.Mutex
	cur    []entry   // records being added
	free   [][]entry // emptied slices to reuse
	chunks [][]entry // cut, waiting for the sender
	added  uint64    // records appended, ever
	closed bool      // no more appends

	acked atomic.Uint64 // records acknowledged (or given up), ever, in order
	wake  chan struct{}
	seq   uint64 // batches made (the sender's)

	allowed, denied prometheus.Counter
}

// NewPublisher returns a running publisher on js. Close it to publish what
// is buffered and stop. It errors (wrapping ErrConfig) for an invalid
// Node or Boot, and when its metrics cannot be registered.
func NewPublisher(js jetstream.JetStream, cfg PublisherConfig) (*Publisher, error) {
	if cfg.Prefix == "" {
		cfg.Prefix = "rl"
	}
	if cfg.Boot == "" {
		cfg.Boot = NewBoot()
	}
	if cfg.Interval <= 0 {
		cfg.Interval = DefaultInterval
	}
	if cfg.MaxBuffered <= 0 {
		cfg.MaxBuffered = DefaultMaxBuffered
	}
	if cfg.MaxBatch <= 0 {
		cfg.MaxBatch = DefaultMaxBatch
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = DefaultTimeout
	}
	if !validToken(cfg.Node) {
		return nil, fmt.Errorf("%w: node id %q is not [A-Za-z0-9_-]{1,64}", ErrConfig, cfg.Node)
	}
	if !validToken(cfg.Boot) || isJournalToken(cfg.Boot) {
		return nil, fmt.Errorf("%w: boot %q is not [A-Za-z0-9_-]{1,64} (and not j<digits>)", ErrConfig, cfg.Boot)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	p := &Publisher{
		js: js, cfg: cfg,
		stream:   StreamName(cfg.Prefix),
		idPrefix: cfg.Node + "." + cfg.Boot + ".",
		kick:     make(chan struct{}, 1),
		progress: make(chan struct{}),
		journals: make(map[originKey]JournalPos),
		stop:     make(chan struct{}),
		l:        log.With("component", "usage-publisher"),
	}
	p.maxBytes = maxGroupedBytes
	if nc := js.Conn(); nc != nil {
		if mp := int(nc.MaxPayload()); mp > 0 && mp-4096 < p.maxBytes {
			p.maxBytes = max(mp-4096, 1024)
		}
	}
	m, err := newPublisherMetrics(cfg.Registerer, func() float64 { return float64(p.held.Load()) })
	if err != nil {
		return nil, err
	}
	p.m = m
	p.subjects.Store(&map[string]*subjectBuf{})
	p.ctx, p.cancel = context.WithCancel(context.Background())
	p.wg.Add(1)
	go p.cutLoop()
	return p, nil
}

// Boot is the publisher's boot token.
func (p *Publisher) Boot() string { return p.cfg.Boot }

// Origin is "<node>.<boot>", the prefix of the ids this publisher makes.
func (p *Publisher) Origin() string { return p.cfg.Node + "." + p.cfg.Boot }

// JournalID returns the id of the record journalled by this process at
// index idx of journal message jseq: <node>.<boot>.j<jseq>.<idx>.
func (p *Publisher) JournalID(jseq uint64, idx uint32) string {
	return JournalID(p.cfg.Node, p.cfg.Boot, jseq, idx)
}

// Add queues r for publication on policy's subject ("" for a decision no
// policy matched) and reports whether it was accepted. A record with an
// empty ID gets an ordinary id. It never blocks on I/O and, once the
// policy's buffers exist, does not allocate. It returns false, counting
// the record in limitmesh_usage_dropped_total, when MaxBuffered records are
// held already (reason "overflow"), after Close ("closed"), or for an
// invalid policy name ("invalid").
//
// Add keeps r, including its Descriptor's backing array, until the record
// is published: the caller must not modify them afterwards. Records of one
// policy are published in the order of the Add calls that return; a caller
// that needs an order (journalled records, by (jseq, idx)) makes those
// calls one after the other.
func (p *Publisher) Add(policy string, r Record) bool {
	e := entry{r: r}
	if r.ID != "" {
		if origin, pos, ok := ParseJournalID(r.ID); ok {
			if i := strings.LastIndexByte(origin, '.'); i > 0 {
				e.node, e.boot, e.pos, e.r.ID = origin[:i], origin[i+1:], pos, ""
			}
		}
	}
	return p.add(policy, e)
}

// add queues e on policy's subject (see Add).
func (p *Publisher) add(policy string, e entry) bool {
	if p.isClosed.Load() {
		p.m.droppedClosed.Inc()
		return false
	}
	sb := (*p.subjects.Load())[policy]
	if sb == nil {
		if sb = p.newSubject(policy); sb == nil {
			return false
		}
	}
	if p.held.Add(1) > int64(p.cfg.MaxBuffered) {
		p.held.Add(-1)
		p.m.droppedOverflow.Inc()
		return false
	}
	sb.mu.Lock()
	if sb.closed {
		sb.mu.Unlock()
		p.held.Add(-1)
		p.m.droppedClosed.Inc()
		return false
	}
	sb.cur = append(sb.cur, e)
	sb.added++
	full := len(sb.cur) == p.cfg.MaxBatch
	sb.mu.Unlock()
	if full {
		p.kickCut()
	}
	return true
}

// AddJournal queues the record of the decision journalled at pos (state
// journal message pos.JSeq, index pos.Idx) by origin node.boot, with id
// [JournalID](node, boot, pos.JSeq, pos.Idx), on policy's subject, like
// [Publisher.Add]. A record at or below the last one AddJournal accepted
// for that origin is not queued again: it was queued before, and is or
// will be published before anything queued after it (a journal read
// again from its mark offers records again, which the ledger would skip
// anyway), or it was refused (overflow) while a later one was accepted,
// and published now it would come after that one, below the ledger's
// watermark. So the journalled records this publisher publishes of each
// origin are in increasing position, each once. It reports false when Add
// refuses r (the position is then not taken), true otherwise. Callers add
// an origin's records in increasing position, except that a journal read
// again starts over from its mark.
func (p *Publisher) AddJournal(policy, node, boot string, pos JournalPos, r Record) bool {
	k := originKey{node, boot}
	p.jmu.Lock()
	defer p.jmu.Unlock()
	if last, ok := p.journals[k]; ok && !last.Less(pos) {
		return true
	}
	r.ID = ""
	if !p.add(policy, entry{r: r, node: node, boot: boot, pos: pos}) {
		return false
	}
	p.journals[k] = pos
	return true
}

func (p *Publisher) kickCut() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// newSubject returns policy's buffer, creating it and its sender; nil for
// an invalid policy name or a closed publisher.
func (p *Publisher) newSubject(policy string) *subjectBuf {
	p.mu.Lock()
	defer p.mu.Unlock()
	old := *p.subjects.Load()
	if sb := old[policy]; sb != nil {
		return sb
	}
	if p.closed {
		p.m.droppedClosed.Inc()
		return nil
	}
	if policy != "" && policies.ValidateName(policy) != nil {
		p.m.droppedInvalid.Inc()
		return nil
	}
	sb := &subjectBuf{
		policy:  policy,
		subject: Subject(p.cfg.Prefix, policy),
		wake:    make(chan struct{}, 1),
		allowed: p.m.records.WithLabelValues(policy, "allowed"),
		denied:  p.m.records.WithLabelValues(policy, "denied"),
	}
	next := make(map[string]*subjectBuf, len(old)+1)
	for k, v := range old {
		next[k] = v
	}
	next[policy] = sb
	p.subjects.Store(&next)
	p.wg.Add(1)
	go p.send(sb)
	return sb
}

// cutLoop moves every subject's buffer to its sender each Interval, and
// at once when kicked.
func (p *Publisher) cutLoop() {
	defer p.wg.Done()
	t := time.NewTicker(p.cfg.Interval)
	defer t.Stop()
	for {
		select {
		case <-t.C:
		case <-p.kick:
		case <-p.stop:
			p.cutAll()
			return
		}
		p.cutAll()
	}
}

func (p *Publisher) cutAll() {
	for _, sb := range *p.subjects.Load() {
		sb.mu.Lock()
		moved := len(sb.cur) > 0
		if moved {
			sb.chunks = append(sb.chunks, sb.cur)
			sb.cur = nil
			if n := len(sb.free); n > 0 {
				sb.cur, sb.free = sb.free[n-1], sb.free[:n-1]
			}
		}
		sb.mu.Unlock()
		if moved {
			select {
			case sb.wake <- struct{}{}:
			default:
			}
		}
	}
}

// maxFree is how many emptied buffers a subject keeps for reuse.
const maxFree = 4

// send is the sender of one subject: it publishes the cut chunks in order,
// MaxBatch records per message, each until it is acknowledged.
func (p *Publisher) send(sb *subjectBuf) {
	defer p.wg.Done()
	var (
		buf []byte
		enc groupEncoder
	)
	msg := &nats.Msg{Subject: sb.subject, Header: nats.Header{}}
	for {
		select {
		case <-sb.wake:
		case <-p.ctx.Done():
			return
		}
		sb.mu.Lock()
		chunks := sb.chunks
		sb.chunks = nil
		sb.mu.Unlock()
		for ci, chunk := range chunks {
			for len(chunk) > 0 {
				sb.seq++
				batch := p.idPrefix + sb.policyToken() + "." + strconv.FormatUint(sb.seq, 10)
				var n int
				buf, n = enc.encode(buf[:0], p.cfg.Node, sb.policy, batch, chunk, p.cfg.MaxBatch, p.maxBytes)
				part := chunk[:n]
				chunk = chunk[n:]
				msg.Data = buf
				msg.Header.Set(jetstream.MsgIDHeader, batch)
				err := p.publish(msg)
				var allowed int
				for i := range part {
					if part[i].r.Allowed {
						allowed++
					}
				}
				if err == nil {
					sb.allowed.Add(float64(allowed))
					sb.denied.Add(float64(n - allowed))
				} else {
					p.m.droppedFailed.Add(float64(n))
					p.l.Error("usage batch given up", "subject", sb.subject, "records", n, "err", err)
				}
				sb.acked.Add(uint64(n))
				p.held.Add(-int64(n))
				p.notify()
			}
			full := chunks[ci]
			clear(full)
			sb.mu.Lock()
			if len(sb.free) < maxFree {
				sb.free = append(sb.free, full[:0])
			}
			sb.mu.Unlock()
		}
	}
}

func (sb *subjectBuf) policyToken() string {
	if sb.policy == "" {
		return UnmatchedToken
	}
	return sb.policy
}

// publish publishes msg until the stream acknowledges it; it gives up
// only when the publisher's context ends (Close's deadline).
func (p *Publisher) publish(msg *nats.Msg) error {
	backoff := 20 * time.Millisecond
	for attempt := 0; ; attempt++ {
		ctx, cancel := context.WithTimeout(p.ctx, p.cfg.Timeout)
		_, err := p.js.PublishMsg(ctx, msg, jetstream.WithExpectStream(p.stream))
		cancel()
		if err == nil {
			if attempt > 0 {
				p.l.Info("usage batch published after retries", "subject", msg.Subject, "attempts", attempt+1)
			}
			return nil
		}
		if p.ctx.Err() != nil {
			return err
		}
		p.m.retries.Inc()
		if attempt == 0 {
			p.l.Warn("usage publish failed; retrying", "subject", msg.Subject, "err", err)
		}
		t := time.NewTimer(backoff)
		select {
		case <-t.C:
		case <-p.ctx.Done():
			t.Stop()
			return err
		}
		backoff = min(2*backoff, time.Second)
	}
}

func (p *Publisher) notify() {
	p.progMu.Lock()
	close(p.progress)
	p.progress = make(chan struct{})
	p.progMu.Unlock()
}

// Sync publishes what is buffered now and returns once every record Add
// accepted before the call is acknowledged by the stream (or given up by
// Close), or with ctx's error. After Close it returns ErrClosed.
func (p *Publisher) Sync(ctx context.Context) error {
	if p.isClosed.Load() {
		return ErrClosed
	}
	return p.flush(ctx)
}

func (p *Publisher) flush(ctx context.Context) error {
	subs := *p.subjects.Load()
	targets := make(map[*subjectBuf]uint64, len(subs))
	for _, sb := range subs {
		sb.mu.Lock()
		targets[sb] = sb.added
		sb.mu.Unlock()
	}
	p.kickCut()
	for {
		p.progMu.Lock()
		ch := p.progress
		p.progMu.Unlock()
		done := true
		for sb, t := range targets {
			if sb.acked.Load() < t {
				done = false
				break
			}
		}
		if done {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// Close stops accepting records (Add returns false), publishes everything
// buffered and stops. If ctx ends first it abandons what is left (counted
// in limitmesh_usage_dropped_total{reason="failed"}) and returns ctx's
// error. A second Close returns ErrClosed.
func (p *Publisher) Close(ctx context.Context) error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return ErrClosed
	}
	p.closed = true
	p.isClosed.Store(true)
	for _, sb := range *p.subjects.Load() {
		sb.mu.Lock()
		sb.closed = true
		sb.mu.Unlock()
	}
	p.mu.Unlock()
	err := p.flush(ctx)
	if err != nil {
		p.l.Warn("usage publisher closed before everything was published", "records", p.held.Load(), "err", err)
	}
	close(p.stop)
	p.cancel()
	p.wg.Wait()
	if n := p.held.Load(); n > 0 {
		p.m.droppedFailed.Add(float64(n))
		p.held.Store(0)
	}
	if err != nil {
		return fmt.Errorf("usage: close: %w", err)
	}
	return nil
}

// Held returns the number of records accepted and not yet acknowledged.
func (p *Publisher) Held() int64 { return p.held.Load() }

var errRegister = errors.New("usage: register metrics")

type publisherMetrics struct {
	records                                                       *prometheus.CounterVec
	dropped                                                       *prometheus.CounterVec
	droppedOverflow, droppedClosed, droppedInvalid, droppedFailed prometheus.Counter
	retries                                                       prometheus.Counter
}

func newPublisherMetrics(reg prometheus.Registerer, held func() float64) (*publisherMetrics, error) {
	m := &publisherMetrics{
		records: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limitmesh_usage_records_total",
			Help: "Usage records acknowledged by the usage stream, by policy and result.",
		}, []string{"policy", "result"}),
		dropped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "limitmesh_usage_dropped_total",
			Help: "Usage records never published: overflow (MaxBuffered held while the stream was slow or unreachable), closed (added after Close), invalid (bad policy name), failed (abandoned when Close gave up).",
		}, []string{"reason"}),
		retries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "limitmesh_usage_publish_retries_total",
			Help: "Usage batch publishes that failed and were retried.",
		}),
	}
	m.droppedOverflow = m.dropped.WithLabelValues("overflow")
	m.droppedClosed = m.dropped.WithLabelValues("closed")
	m.droppedInvalid = m.dropped.WithLabelValues("invalid")
	m.droppedFailed = m.dropped.WithLabelValues("failed")
	pending := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "limitmesh_usage_pending_records",
		Help: "Usage records accepted and not yet acknowledged by the stream.",
	}, held)
	if reg != nil {
		for _, c := range []prometheus.Collector{m.records, m.dropped, m.retries, pending} {
			if err := reg.Register(c); err != nil {
				return nil, fmt.Errorf("%w: %w", errRegister, err)
			}
		}
	}
	return m, nil
}
