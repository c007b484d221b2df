package shadow

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/limitmesh/limitmesh/kvstate"
)

// The evaluator's storage, in two buckets:
//
//	KV <prefix>_shadow         the summaries (key = candidate name), the
//	                           elector's lease (key leader.shadow) and the
//	                           checkpoint pointer (key _checkpoint)
//	objects <prefix>_shadow_state  the checkpoints (see checkpoint.go)
//
// A checkpoint is written as a new object, then made current by a
// compare-and-swap of the pointer, then the previous object is deleted.
// It holds every key of every candidate: about 60 bytes a key with one
// bucket limit, so at most about 6 MB per candidate at DefaultMaxKeys.
// Every write of the evaluator (pointer and summaries) is a
// compare-and-swap on the revision it last wrote or read, so an evaluator
// that lost its lease without knowing it fails its next write and stops
// instead of overwriting its successor's.

// A checkpoint object the pointer names but a read does not find is read
// again objectRetries times, objectRetryWait apart, before it counts as
// lost.
const (
	objectRetries   = 20
	objectRetryWait = 250 * time.Millisecond
)

// Keys of the summary bucket that are not summaries.
const (
	LeaderKey     = "leader.shadow" // the elector's lease entry
	CheckpointKey = "_checkpoint"   // the checkpoint pointer
)

// StateBucket is the object store of the evaluator's checkpoints:
// "rl_shadow_state" for "rl".
func StateBucket(prefix string) string { return prefix + "_shadow_state" }

// errFenced reports that another evaluator wrote an entry this one
// expected to own: it lost its lease.
var errFenced = errors.New("shadow: another evaluator took over")

// pointer is the JSON of the checkpoint pointer.
type pointer struct {
	Object string `json:"object"` // object name in the state bucket
	Seq    uint64 `json:"seq"`    // last stream sequence it covers
	Bytes  int    `json:"bytes"`
}

// store reads and writes the evaluator's buckets.
type store struct {
	kv  jetstream.KeyValue
	obs jetstream.ObjectStore
	// leader reads kv's entries from its stream leader. kv.Get is a
	// direct get, which a follower of an R3 bucket may answer a few
	// revisions behind: right after a failover the new evaluator could
	// read an old pointer, whose checkpoint is deleted, and start counting
	// again while its consumer resumes past what it counted.
	leader *kvstate.JetStreamStore
	// ptrRev is the revision of the pointer entry as last read or written
	// (0: none).
	ptrRev uint64
	ptr    pointer
	// revs are the revisions of the summary entries as last read or
	// written; a name absent is unknown (created on first write).
	revs map[string]uint64
}

// ensureBuckets opens (creating them when missing) the summary bucket and
// the state object store.
func ensureBuckets(ctx context.Context, js jetstream.JetStream, prefix string, replicas int) (jetstream.KeyValue, jetstream.ObjectStore, error) {
	kv, err := js.KeyValue(ctx, Bucket(prefix))
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		kv, err = js.CreateKeyValue(ctx, jetstream.KeyValueConfig{
			Bucket: Bucket(prefix), Description: "limitmesh shadow summaries (CONTRACT.md §7)",
			History: 1, Replicas: replicas, Storage: jetstream.FileStorage,
		})
		if errors.Is(err, jetstream.ErrBucketExists) {
			kv, err = js.KeyValue(ctx, Bucket(prefix))
		}
	}
	if err != nil {
		return nil, nil, fmt.Errorf("bucket %s: %w", Bucket(prefix), err)
	}
	obs, err := js.ObjectStore(ctx, StateBucket(prefix))
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		obs, err = js.CreateObjectStore(ctx, jetstream.ObjectStoreConfig{
			Bucket: StateBucket(prefix), Description: "limitmesh shadow evaluator checkpoints",
			Replicas: replicas, Storage: jetstream.FileStorage,
		})
		if errors.Is(err, jetstream.ErrBucketExists) {
			obs, err = js.ObjectStore(ctx, StateBucket(prefix))
		}
	}
	if err != nil {
		return nil, nil, fmt.Errorf("object store %s: %w", StateBucket(prefix), err)
	}
	return kv, obs, nil
}

// load reads the pointer, the checkpoint it names (nil when there is
// none) and the revisions of the summary entries.
func (s *store) load(ctx context.Context) ([]byte, error) {
	s.revs = map[string]uint64{}
	s.ptrRev, s.ptr = 0, pointer{}
	// Not kv.ListKeys: a listing while the lease entry is renewed can miss
	// a summary, which this term would then neither update (a create
	// over it fails as if fenced) nor delete when its candidate goes.
	names, err := s.leader.Keys(ctx, "")
	if err != nil {
		return nil, fmt.Errorf("list %s: %w", s.kv.Bucket(), err)
	}
	for _, k := range names {
		if !isSummaryKey(k) {
			continue
		}
		_, rev, err := s.leader.Get(ctx, k)
		if errors.Is(err, kvstate.ErrNotFound) {
			continue
		} else if err != nil {
			return nil, fmt.Errorf("get %s: %w", k, err)
		}
		s.revs[k] = rev
	}
	val, rev, err := s.leader.Get(ctx, CheckpointKey)
	if errors.Is(err, kvstate.ErrNotFound) {
		return nil, nil
	} else if err != nil {
		return nil, fmt.Errorf("get %s: %w", CheckpointKey, err)
	}
	s.ptrRev = rev
	if err := json.Unmarshal(val, &s.ptr); err != nil || s.ptr.Object == "" {
		return nil, fmt.Errorf("%w: pointer %q", ErrCorrupt, val)
	}
	// The object store reads an object's description with a direct get
	// too: a follower behind the pointer answers "not found" for the
	// newest checkpoint. It is written before the pointer names it, so it
	// is retried for a while before it counts as lost.
	b, err := s.obs.GetBytes(ctx, s.ptr.Object)
	for try := 0; errors.Is(err, jetstream.ErrObjectNotFound) && try < objectRetries && sleepCtx(ctx, objectRetryWait); try++ {
		b, err = s.obs.GetBytes(ctx, s.ptr.Object)
	}
	if err != nil {
		return nil, fmt.Errorf("checkpoint object %s: %w", s.ptr.Object, err)
	}
	return b, nil
}

// isSummaryKey reports whether key names a candidate (a policy name), not
// the lease or the pointer.
func isSummaryKey(key string) bool {
	if key == "" || len(key) > 64 || !(key[0] >= 'a' && key[0] <= 'z' || key[0] >= '0' && key[0] <= '9') {
		return false
	}
	for i := 0; i < len(key); i++ {
		c := key[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}

// checkpoint stores b (covering the stream up to seq) and makes it the
// current checkpoint. It returns errFenced when the pointer changed under
// it.
func (s *store) checkpoint(ctx context.Context, b []byte, seq uint64, node string) error {
	name := "ckpt." + node + "." + strconv.FormatUint(seq, 10) + "." + strconv.FormatUint(s.ptrRev, 10)
	if _, err := s.obs.PutBytes(ctx, name, b); err != nil {
		return fmt.Errorf("put checkpoint: %w", err)
	}
	ptr := pointer{Object: name, Seq: seq, Bytes: len(b)}
	v, _ := json.Marshal(ptr)
	var (
		rev uint64
		err error
	)
	if s.ptrRev == 0 {
		rev, err = s.kv.Create(ctx, CheckpointKey, v)
	} else {
		rev, err = s.kv.Update(ctx, CheckpointKey, v, s.ptrRev)
	}
	if err != nil {
		s.obs.Delete(ctx, name)
		if conflict(err) {
			return errFenced
		}
		return fmt.Errorf("checkpoint pointer: %w", err)
	}
	old := s.ptr.Object
	s.ptrRev, s.ptr = rev, ptr
	if old != "" && old != name {
		if err := s.obs.Delete(ctx, old); err != nil && !errors.Is(err, jetstream.ErrObjectNotFound) {
			return fmt.Errorf("delete old checkpoint %s: %w", old, err)
		}
	}
	return nil
}

// putSummary writes one summary with compare-and-swap on the revision
// last seen; errFenced when another writer got there first.
func (s *store) putSummary(ctx context.Context, name string, v []byte) error {
	var (
		rev uint64
		err error
	)
	if last, ok := s.revs[name]; ok && last != 0 {
		rev, err = s.kv.Update(ctx, name, v, last)
	} else {
		rev, err = s.kv.Create(ctx, name, v)
	}
	if err != nil {
		if conflict(err) {
			return errFenced
		}
		return fmt.Errorf("summary %s: %w", name, err)
	}
	s.revs[name] = rev
	return nil
}

// deleteSummary deletes the summary of a name that is no longer a
// candidate.
func (s *store) deleteSummary(ctx context.Context, name string) error {
	last, ok := s.revs[name]
	if !ok {
		return nil
	}
	err := s.kv.Delete(ctx, name, jetstream.LastRevision(last))
	if err != nil && !errors.Is(err, jetstream.ErrKeyNotFound) {
		if conflict(err) {
			return errFenced
		}
		return fmt.Errorf("delete summary %s: %w", name, err)
	}
	delete(s.revs, name)
	return nil
}

func conflict(err error) bool {
	return errors.Is(err, jetstream.ErrKeyRevisionMismatch) || errors.Is(err, jetstream.ErrKeyExists)
}
