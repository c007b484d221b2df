package kvstate

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

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
	keyPre string // $KV.<bucket>.
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
		keyPre: "$KV." + bucket + ".",
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
	var resp msgGetResponse
	if err := json.Unmarshal(msg.Data, &resp); err != nil {
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
