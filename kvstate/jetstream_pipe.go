package kvstate

import (
	"bytes"
	"container/heap"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
)

// The asynchronous operations ([AsyncStore]). A write is one publish of
// the value to $KV.<bucket>.<key> with the header
// Nats-Expected-Last-Subject-Sequence (the expected revision; 0: the key
// must have no message), a read one publish of the STREAM.MSG.GET request;
// both carry a reply subject <inbox>.<n> under one wildcard subscription
// of the store, whose handler matches the answer to the waiting operation
// by n. So an operation costs one publish and one delivery: no goroutine,
// channel, context or timer per operation. Timeouts are swept by one timer
// armed for the earliest deadline, with a granularity of sweepGranularity.
//
// A create (expected revision 0) over a delete marker loses like a
// conflict here (kv.Create reads the marker and retries; an AsyncStore
// caller reloads, which gives it the marker's revision).

// jsErrWrongLastSequence is JetStream's error code for a failed
// expected-last-subject-sequence check.
const jsErrWrongLastSequence = 10071

// sweepGranularity is the least interval between two timeout sweeps: an
// operation fails at most this much after its timeout.
const sweepGranularity = 2 * time.Millisecond

// expectedSeqHeader is the compare-and-swap header of a KV write.
const expectedSeqHeader = "Nats-Expected-Last-Subject-Sequence"

// opPipe is the state of the asynchronous operations.
type opPipe struct {
	mu      sync.Mutex
	sub     *nats.Subscription // nil until the first operation
	inbox   string             // <inbox>. (reply subjects are inbox + n)
	next    uint64
	ops     map[uint64]*pendingOp
	byTime  deadlineHeap
	timer   *time.Timer
	armedAt int64 // mono ns the timer fires at; 0: not armed
	base    time.Time
}

// pendingOp is one operation waiting for its answer.
type pendingOp struct {
	key      string
	stream   string                      // a publish's stream (PublishAsync); "": the bucket's
	onGet    func([]byte, uint64, error) // a read
	onUpdate func(uint64, error)         // a write
	floor    *floorRead                  // a read with a freshness floor (GetAsyncFloor)
}

// floorRead is the state of a GetAsyncFloor or GetManyAsyncFloor read:
// its answer is several messages (the last message of each subject asked
// for, then an end-of-batch), gathered by the inbox handler.
type floorRead struct {
	subj  string // the key's subject (GetAsyncFloor)
	floor uint64
	val   []byte
	rev   uint64
	found bool // the key's message came (rev: its sequence)
	gone  bool // ... and it is a delete, purge or TTL marker

	// GetManyAsyncFloor: the index of each key's subject in recs, and the
	// callback (op.onGet is nil).
	want   map[string]int
	recs   []KeyRecord
	bad    bool // a key's message came without a valid sequence
	onMany func([]KeyRecord, error)
}

type deadlineEntry struct {
	at int64 // mono ns
	id uint64
}

// deadlineHeap orders pending deadlines; entries of answered operations
// stay until their deadline passes (they are skipped then).
type deadlineHeap []deadlineEntry

func (h deadlineHeap) Len() int           { return len(h) }
func (h deadlineHeap) Less(i, j int) bool { return h[i].at < h[j].at }
func (h deadlineHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *deadlineHeap) Push(x any)        { *h = append(*h, x.(deadlineEntry)) }
func (h *deadlineHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	*h = old[:len(old)-1]
	return e
}

func (p *opPipe) mono() int64 { return int64(time.Since(p.base)) + 1 }

// start subscribes the reply inbox; p.mu is held.
func (s *JetStreamStore) startPipe() error {
	p := &s.pipe
	p.base = time.Now()
	p.inbox = s.nc.NewRespInbox() + "."
	p.ops = make(map[uint64]*pendingOp)
	sub, err := s.nc.Subscribe(p.inbox+"*", s.answer)
	if err != nil {
		return err
	}
	// Never drop an answer: a dropped ack would fail a write that landed.
	if err := sub.SetPendingLimits(-1, -1); err != nil {
		_ = sub.Unsubscribe()
		return err
	}
	p.sub = sub
	p.timer = time.AfterFunc(time.Hour, s.sweep)
	p.timer.Stop()
	return nil
}

// register adds op with its timeout and returns its reply subject.
func (s *JetStreamStore) register(op *pendingOp, timeout time.Duration) (string, error) {
	p := &s.pipe
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.sub == nil {
		if err := s.startPipe(); err != nil {
			return "", err
		}
	}
	p.next++
	id := p.next
	p.ops[id] = op
	at := p.mono() + int64(timeout)
	heap.Push(&p.byTime, deadlineEntry{at: at, id: id})
	if p.armedAt == 0 || at < p.armedAt {
		fire := max(at, p.mono()+int64(sweepGranularity))
		if p.armedAt == 0 || fire < p.armedAt {
			p.armedAt = fire
			p.timer.Reset(time.Duration(fire - p.mono()))
		}
	}
	return p.inbox + strconv.FormatUint(id, 10), nil
}

// take removes and returns the pending operation id, or nil.
func (p *opPipe) take(id uint64) *pendingOp {
	p.mu.Lock()
	op := p.ops[id]
	delete(p.ops, id)
	p.mu.Unlock()
	return op
}

// sweep fails the operations whose deadline passed and re-arms the timer.
func (s *JetStreamStore) sweep() {
	p := &s.pipe
	var expired []*pendingOp
	p.mu.Lock()
	now := p.mono()
	for len(p.byTime) > 0 {
		e := p.byTime[0]
		if _, live := p.ops[e.id]; live && e.at > now {
			break
		}
		heap.Pop(&p.byTime)
		if op, live := p.ops[e.id]; live {
			delete(p.ops, e.id)
			expired = append(expired, op)
		}
	}
	p.armedAt = 0
	if len(p.byTime) > 0 {
		p.armedAt = max(p.byTime[0].at, now+int64(sweepGranularity))
		p.timer.Reset(time.Duration(p.armedAt - now))
	}
	p.mu.Unlock()
	for _, op := range expired {
		s.complete(op, nil, fmt.Errorf("no answer in time: %w", context.DeadlineExceeded))
	}
}

// answer is the inbox subscription's handler.
func (s *JetStreamStore) answer(m *nats.Msg) {
	i := len(s.pipe.inbox)
	if len(m.Subject) <= i {
		return
	}
	id, err := strconv.ParseUint(m.Subject[i:], 10, 64)
	if err != nil {
		return
	}
	if s.answerFloor(id, m) {
		return
	}
	op := s.pipe.take(id)
	if op == nil {
		return // answered after its timeout
	}
	if len(m.Data) == 0 && m.Header.Get("Status") == "503" {
		s.complete(op, nil, nats.ErrNoResponders)
		return
	}
	s.complete(op, m.Data, nil)
}

// complete calls op's callback with the answer data or the transport
// error err.
func (s *JetStreamStore) complete(op *pendingOp, data []byte, err error) {
	if f := op.floor; f != nil && f.onMany != nil {
		// Only failures come here (answerFloor completes the rest).
		if err == nil {
			err = errors.New("unexpected answer")
		}
		f.onMany(nil, fmt.Errorf("kvstate: get %d keys: %w", len(f.recs), err))
		return
	}
	if op.onGet != nil {
		if err != nil {
			op.onGet(nil, 0, fmt.Errorf("kvstate: get %q: %w", op.key, err))
			return
		}
		op.onGet(s.parseGet(op.key, data))
		return
	}
	if err != nil {
		op.onUpdate(0, fmt.Errorf("kvstate: update %q: %w", op.key, err))
		return
	}
	stream := op.stream
	if stream == "" {
		stream = s.stream
	}
	op.onUpdate(parseAck(op.key, stream, data))
}

// pubAck is a JetStream publish acknowledgement.
type pubAck struct {
	Stream string `json:"stream"`
	Seq    uint64 `json:"seq"`
	Error  *struct {
		Code        int    `json:"code"`
		ErrCode     int    `json:"err_code"`
		Description string `json:"description"`
	} `json:"error"`
}

// parseAck decodes the acknowledgement of a publish of key (a KV key or a
// subject) to stream: the stored sequence (a KV write's new revision),
// ErrConflict for a failed expected-sequence check, or an error. The usual
// shape {"stream":"<stream>","seq":N} is read without encoding/json.
func parseAck(key, stream string, data []byte) (uint64, error) {
	if seq, ok := fastAck(data, stream); ok {
		return seq, nil
	}
	var a pubAck
	if err := json.Unmarshal(data, &a); err != nil {
		return 0, fmt.Errorf("kvstate: update %q: bad acknowledgement: %w", key, err)
	}
	switch {
	case a.Error != nil && a.Error.ErrCode == jsErrWrongLastSequence:
		return 0, fmt.Errorf("kvstate: update %q: %s: %w", key, a.Error.Description, ErrConflict)
	case a.Error != nil:
		return 0, fmt.Errorf("kvstate: update %q: jetstream error %d: %s", key, a.Error.ErrCode, a.Error.Description)
	case a.Stream != stream || a.Seq == 0:
		return 0, fmt.Errorf("kvstate: update %q: unexpected acknowledgement %q", key, data)
	}
	return a.Seq, nil
}

// fastAck reads {"stream":"<stream>","seq":N} exactly (N > 0, no other
// field, no white space).
func fastAck(data []byte, stream string) (uint64, bool) {
	const pre, mid = `{"stream":"`, `","seq":`
	if len(data) < len(pre)+len(stream)+len(mid)+2 || string(data[:len(pre)]) != pre {
		return 0, false
	}
	data = data[len(pre):]
	if string(data[:len(stream)]) != stream {
		return 0, false
	}
	data = data[len(stream):]
	if !bytes.HasPrefix(data, []byte(mid)) {
		return 0, false
	}
	data = data[len(mid):]
	if len(data) < 2 || data[len(data)-1] != '}' || data[0] == '0' || len(data) > 20 { // at most 19 digits: no overflow
		return 0, false
	}
	var seq uint64
	for _, c := range data[:len(data)-1] {
		if c < '0' || c > '9' {
			return 0, false
		}
		seq = seq*10 + uint64(c-'0')
	}
	return seq, true
}

// send registers op with its timeout and publishes m with op's reply
// subject. An error means op will never be answered: the caller reports
// it. A publish that fails after op was answered or timed out meanwhile is
// not an error (op's callback ran).
func (s *JetStreamStore) send(op *pendingOp, m *nats.Msg, timeout time.Duration) error {
	reply, err := s.register(op, timeout)
	if err != nil {
		return err
	}
	m.Reply = reply
	if err := s.nc.PublishMsg(m); err != nil && s.pipe.take(s.parseID(reply)) != nil {
		return err
	}
	return nil
}

// multiLast is the direct get request of the last messages of subjects.
func (s *JetStreamStore) parseID(reply string) uint64 {
	id, _ := strconv.ParseUint(reply[len(s.pipe.inbox):], 10, 64)
	return id
}
