package kvstate

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
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
	js     jetstream.JetStream
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
		js:     js,
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
