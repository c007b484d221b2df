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
	"github.com/nats-io/nats.go/jetstream"
)

// JetStreamStore is a [Store] on a JetStream KV bucket.
//
// Reads go to the stream leader (the STREAM.MSG.GET API, never a direct
// get), even when the bucket allows direct gets: on a replicated bucket a
// direct get may be answered by a follower that is a few revisions behind,
// which would make the compare-and-swap that follows fail needlessly, and a
// follower cut off from its cluster would keep serving stale values.
//
// Writes are kv.Create (expected revision 0) and kv.Update (expected
// revision rev); a lost race becomes [ErrConflict], so callers never see a
// NATS error type for the conditions they must handle. Other failures
// (timeouts, no responders) are returned wrapped with the key.
type JetStreamStore struct {
	nc     *nats.Conn
	kv     jetstream.KeyValue
	bucket string
	getSub string // $JS.API.STREAM.MSG.GET.KV_<bucket>
	dirSub string // $JS.API.DIRECT.GET.KV_<bucket>
	keyPre string // $KV.<bucket>.
	stream string // KV_<bucket>

	pipe opPipe // the asynchronous operations (AsyncStore)
}

// NewJetStreamStore binds to the existing KV bucket named bucket. It does
// not create the bucket.
func NewJetStreamStore(ctx context.Context, js jetstream.JetStream, bucket string) (*JetStreamStore, error) {
	kv, err := js.KeyValue(ctx, bucket)
	if err != nil {
		return nil, fmt.Errorf("kvstate: bind bucket %q: %w", bucket, err)
	}
	return &JetStreamStore{
		nc:     js.Conn(),
		kv:     kv,
		bucket: bucket,
		getSub: "$JS.API.STREAM.MSG.GET.KV_" + bucket,
		dirSub: "$JS.API.DIRECT.GET.KV_" + bucket,
		keyPre: "$KV." + bucket + ".",
		stream: "KV_" + bucket,
	}, nil
}

// jsErrMessageNotFound is JetStream's error code for "no message found".
const jsErrMessageNotFound = 10037

type msgGetRequest struct {
	LastFor string `json:"last_by_subj"`
}

type msgGetResponse struct {
	Message *struct {
		Seq  uint64 `json:"seq"`
		Hdrs []byte `json:"hdrs,omitempty"`
		Data []byte `json:"data,omitempty"`
	} `json:"message"`
	Error *struct {
		Code        int    `json:"code"`
		ErrCode     int    `json:"err_code"`
		Description string `json:"description"`
	} `json:"error"`
}

// Get implements [Store] with a leader read. A delete or purge marker (or a
// TTL marker) is reported as ErrNotFound with the marker's revision.
func (s *JetStreamStore) Get(ctx context.Context, key string) ([]byte, uint64, error) {
	req, err := json.Marshal(msgGetRequest{LastFor: s.keyPre + key})
	if err != nil {
		return nil, 0, err
	}
	msg, err := s.nc.RequestWithContext(ctx, s.getSub, req)
	if err != nil {
		return nil, 0, fmt.Errorf("kvstate: get %q: %w", key, err)
	}
	return s.parseGet(key, msg.Data)
}

// parseGet decodes a STREAM.MSG.GET response for key.
func (s *JetStreamStore) parseGet(key string, data []byte) ([]byte, uint64, error) {
	var resp msgGetResponse
	if err := json.Unmarshal(data, &resp); err != nil {
		return nil, 0, fmt.Errorf("kvstate: get %q: bad response: %w", key, err)
	}
	if resp.Error != nil {
		if resp.Error.ErrCode == jsErrMessageNotFound {
			return nil, 0, ErrNotFound
		}
		return nil, 0, fmt.Errorf("kvstate: get %q: jetstream error %d: %s", key, resp.Error.ErrCode, resp.Error.Description)
	}
	if resp.Message == nil {
		return nil, 0, fmt.Errorf("kvstate: get %q: empty response", key)
	}
	m := resp.Message
	if len(m.Hdrs) > 0 {
		h, err := nats.DecodeHeadersMsg(m.Hdrs)
		if err != nil {
			return nil, 0, fmt.Errorf("kvstate: get %q: bad headers: %w", key, err)
		}
		if op := h.Get("KV-Operation"); op == "DEL" || op == "PURGE" || h.Get("Nats-Marker-Reason") != "" {
			return nil, m.Seq, ErrNotFound
		}
	}
	return m.Data, m.Seq, nil
}

// Update implements [Store]. Expected revision 0 creates the key (also over
// a delete marker); a revision mismatch or an existing key is ErrConflict.
func (s *JetStreamStore) Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error) {
	var (
		n   uint64
		err error
	)
	if rev == 0 {
		n, err = s.kv.Create(ctx, key, value)
	} else {
		n, err = s.kv.Update(ctx, key, value, rev)
	}
	if err == nil {
		return n, nil
	}
	if errors.Is(err, jetstream.ErrKeyRevisionMismatch) || errors.Is(err, jetstream.ErrKeyExists) {
		return 0, fmt.Errorf("kvstate: update %q at revision %d: %w", key, rev, ErrConflict)
	}
	return 0, fmt.Errorf("kvstate: update %q: %w", key, err)
}

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

// KeyRecord is one key's latest record as [JetStreamStore.GetManyAsyncFloor]
// found it.
type KeyRecord struct {
	Value []byte
	Rev   uint64 // the record's revision; a marker's for a deleted key; 0: no message
	Live  bool   // a value, not a delete, purge or TTL marker (nor no message)
}

// MaxManyKeys is the most keys one GetManyAsyncFloor reads (a direct get
// answers at most 1024 messages).
const MaxManyKeys = 512

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
type multiLast struct {
	Subjects []string `json:"multi_last"`
}

// GetAsync implements [AsyncStore] with a leader read, like Get.
func (s *JetStreamStore) GetAsync(key string, timeout time.Duration, done func([]byte, uint64, error)) {
	req, err := json.Marshal(msgGetRequest{LastFor: s.keyPre + key})
	if err == nil {
		err = s.send(&pendingOp{key: key, onGet: done}, &nats.Msg{Subject: s.getSub, Data: req}, timeout)
	}
	if err != nil {
		go done(nil, 0, fmt.Errorf("kvstate: get %q: %w", key, err))
	}
}

// GetAsyncFloor reads key like GetAsync, from a replica of the bucket's
// stream known to hold every message up to sequence floor; otherwise done
// gets an error wrapping ErrStale. A leader read cannot promise that: a
// stream leader cut off from its cluster keeps answering, with what it had
// when it was cut off, until it learns it was replaced (right after a
// network partition heals both it and the new leader answer, and the first
// answer wins). floorKey must be a key written at sequence floor or later
// (the caller's own write, whose acknowledgement gave floor).
//
// It is one direct get of the last messages of key and floorKey (the
// bucket must allow direct gets): any replica may answer it, and its
// end-of-batch message reports the replica's last sequence, which is
// checked against floor. floorKey makes the batch never empty on a
// replica that is current (an empty batch reports no sequence).
func (s *JetStreamStore) GetAsyncFloor(key, floorKey string, floor uint64, timeout time.Duration, done func([]byte, uint64, error)) {
	op := &pendingOp{key: key, onGet: done, floor: &floorRead{subj: s.keyPre + key, floor: floor}}
	req, err := json.Marshal(multiLast{[]string{s.keyPre + key, s.keyPre + floorKey}})
	if err == nil {
		err = s.send(op, &nats.Msg{Subject: s.dirSub, Data: req}, timeout)
	}
	if err != nil {
		go done(nil, 0, fmt.Errorf("kvstate: get %q: %w", key, err))
	}
}

// GetManyAsyncFloor reads keys (at most MaxManyKeys, no duplicates) like
// GetAsyncFloor, in one direct get of the last messages of every key and
// floorKey: done gets each key's record, in the order of keys, from a
// replica holding the stream up to floor, or an error (ErrStale when the
// replica that answered is behind floor). An answer cut short (the
// end-of-batch counts messages not sent) is an error, never a key
// reported absent.
func (s *JetStreamStore) GetManyAsyncFloor(keys []string, floorKey string, floor uint64, timeout time.Duration, done func([]KeyRecord, error)) {
	f := &floorRead{floor: floor, want: make(map[string]int, len(keys)), recs: make([]KeyRecord, len(keys)), onMany: done}
	subjs := make([]string, 0, len(keys)+1)
	for i, k := range keys {
		f.want[s.keyPre+k] = i
		subjs = append(subjs, s.keyPre+k)
	}
	subjs = append(subjs, s.keyPre+floorKey)
	var err error
	switch {
	case len(keys) == 0 || len(keys) > MaxManyKeys:
		err = fmt.Errorf("%d keys, 1..%d", len(keys), MaxManyKeys)
	case len(f.want) != len(keys):
		err = errors.New("a key asked for twice")
	}
	var req []byte
	if err == nil {
		req, err = json.Marshal(multiLast{subjs})
	}
	if err == nil {
		err = s.send(&pendingOp{key: keys[0], floor: f}, &nats.Msg{Subject: s.dirSub, Data: req}, timeout)
	}
	if err != nil {
		go done(nil, fmt.Errorf("kvstate: get %d keys: %w", len(keys), err))
	}
}

// answerFloor handles message m answering operation id if that is a
// GetAsyncFloor or GetManyAsyncFloor read (then it reports true): it
// gathers the keys' messages and completes the read on the end-of-batch or
// an error status.
func (s *JetStreamStore) answerFloor(id uint64, m *nats.Msg) bool {
	p := &s.pipe
	p.mu.Lock()
	op := p.ops[id]
	p.mu.Unlock()
	if op == nil || op.floor == nil {
		return false
	}
	f := op.floor
	status := m.Header.Get("Status")
	if status == "" && f.want != nil {
		if i, ok := f.want[m.Header.Get(jetstream.SubjectHeader)]; ok {
			r := &f.recs[i]
			r.Rev, _ = strconv.ParseUint(m.Header.Get(jetstream.SequenceHeader), 10, 64)
			f.bad = f.bad || r.Rev == 0
			kvOp := m.Header.Get("KV-Operation")
			r.Live = !(kvOp == "DEL" || kvOp == "PURGE" || m.Header.Get("Nats-Marker-Reason") != "")
			if r.Live {
				r.Value = m.Data
			}
		}
		return true
	}
	if status == "" {
		if m.Header.Get(jetstream.SubjectHeader) == f.subj {
			f.rev, _ = strconv.ParseUint(m.Header.Get(jetstream.SequenceHeader), 10, 64)
			f.val, f.found = m.Data, true
			kvOp := m.Header.Get("KV-Operation")
			f.gone = kvOp == "DEL" || kvOp == "PURGE" || m.Header.Get("Nats-Marker-Reason") != ""
		}
		return true
	}
	if p.take(id) == nil {
		return true // timed out meanwhile
	}
	fail := func(err error) { op.onGet(nil, 0, fmt.Errorf("kvstate: get %q: %w", op.key, err)) }
	if f.want != nil {
		fail = func(err error) { f.onMany(nil, fmt.Errorf("kvstate: get %d keys: %w", len(f.recs), err)) }
	}
	switch status {
	case "204": // end of batch
		upto, err := strconv.ParseUint(m.Header.Get("Nats-UpTo-Sequence"), 10, 64)
		switch {
		case err != nil:
			fail(fmt.Errorf("end of batch without the replica's sequence"))
		case upto < f.floor:
			fail(fmt.Errorf("replica at sequence %d, floor %d: %w", upto, f.floor, ErrStale))
		case f.want != nil && m.Header.Get("Nats-Num-Pending") != "0":
			fail(fmt.Errorf("answer cut short (%s messages not sent)", m.Header.Get("Nats-Num-Pending")))
		case f.want != nil && f.bad:
			fail(fmt.Errorf("direct get answer without its sequence"))
		case f.want != nil:
			f.onMany(f.recs, nil)
		case !f.found:
			op.onGet(nil, 0, ErrNotFound)
		case f.rev == 0:
			fail(fmt.Errorf("direct get answer without its sequence"))
		case f.gone:
			op.onGet(nil, f.rev, ErrNotFound)
		default:
			op.onGet(f.val, f.rev, nil)
		}
	case "404": // no message of either key: the replica lacks the floor key
		fail(fmt.Errorf("replica without the floor key: %w", ErrStale))
	case "503":
		fail(nats.ErrNoResponders)
	default:
		fail(fmt.Errorf("direct get status %s %s", status, m.Header.Get("Description")))
	}
	return true
}

// UpdateAsync implements [AsyncStore], like Update (expected revision 0:
// the key must have no message, see above).
func (s *JetStreamStore) UpdateAsync(key string, value []byte, rev uint64, timeout time.Duration, done func(uint64, error)) {
	s.UpdateAsyncTTL(key, value, rev, 0, timeout, done)
}

// UpdateAsyncTTL is UpdateAsync with the written message's time to live
// (see [SetTTL]): the bucket removes the value ttl after the write
// (whole seconds, rounded up), whatever its own age limit would keep;
// [NoExpiry] keeps it until it is replaced, whatever the age limit; 0
// leaves it to the bucket's limits. A ttl other than 0 needs a bucket
// that allows per-message TTLs ([EnsureTTLStream]); otherwise the write
// fails with JetStream's error 10166.
func (s *JetStreamStore) UpdateAsyncTTL(key string, value []byte, rev uint64, ttl, timeout time.Duration, done func(uint64, error)) {
	m := &nats.Msg{
		Subject: s.keyPre + key,
		Data:    value,
		Header:  nats.Header{expectedSeqHeader: []string{strconv.FormatUint(rev, 10)}},
	}
	SetTTL(m, ttl)
	if err := s.send(&pendingOp{key: key, onUpdate: done}, m, timeout); err != nil {
		go done(0, fmt.Errorf("kvstate: update %q: %w", key, err))
	}
}

// PublishAsync publishes m (its Reply is replaced) to the JetStream stream
// named stream over the store's pipelined reply subscription, and calls
// done with the sequence the stream stored it at, or an error: a failed
// expectation header (such as Nats-Expected-Last-Subject-Sequence) wraps
// ErrConflict; no answer within timeout wraps context.DeadlineExceeded.
// It is the cheap form of jetstream's PublishMsg for a caller that
// publishes often (no per-call context, reply map or JSON decoding).
func (s *JetStreamStore) PublishAsync(m *nats.Msg, stream string, timeout time.Duration, done func(uint64, error)) {
	if err := s.send(&pendingOp{key: m.Subject, stream: stream, onUpdate: done}, m, timeout); err != nil {
		go done(0, fmt.Errorf("kvstate: publish to %q: %w", m.Subject, err))
	}
}

func (s *JetStreamStore) parseID(reply string) uint64 {
	id, _ := strconv.ParseUint(reply[len(s.pipe.inbox):], 10, 64)
	return id
}
