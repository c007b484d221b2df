// Package journal is the state journal: group commit across keys. A node
// appends the new records of every key that changed, across all its
// partitions, as one message of its own subject of the journal stream; it
// keeps the latest journalled record of each key in memory, checkpoints
// records to the state bucket, and hands partitions over through fences,
// tenure markers and adoption (docs/protocol.md, "The state journal", and
// the invariants it keeps).
//
// A Journal is a kvstate.AsyncStore (the key owners load and write
// through it) and an ownership.Lifecycle (the ownership runner asks it to
// mark, adopt, release and lose partitions). It reaches the journal stream
// and the state bucket only through the Stream and Bucket interfaces, and
// time only through an rt.Runtime: it never blocks, so the deterministic
// simulation drives the same code. nats.go holds the JetStream
// implementations.
//
// Its parts, each with its own state and lock:
//
//	records.go     the latest journalled record of each key, per-partition generations
//	writer.go      the appender: one batch message in flight, resync after a failure
//	floors.go      freshness floors of state-bucket reads after a claim
//	checks.go      batched checks that keys new to this node have no stored record
//	checkpoint.go  checkpoints to the state bucket, the mark, purges
//	openindex.go   each partition's index of its keys with open reservations
//	reader.go      reading a node's journal from its mark (adoption, diagnostics)
//	adopt.go       tenure markers, barriers and adoption
//
// journal imports kvstate, ownership (partitions), fail and rt.
package journal

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/fail"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/ownership"
	"github.com/limitmesh/limitmesh/mesh/internal/rt"
)

// DefaultCheckpointInterval is the default interval between checkpoints of
// journalled records to the state bucket.
const DefaultCheckpointInterval = 5 * time.Second

const (
	// Revisions this store returns: a journalled record's carries
	// journalRevBit and the batch's sequence; a bucket record's its
	// revision. Both carry the partition's generation above revSeqBits
	// (records.go).
	journalRevBit = 1 << 62
	revSeqBits    = 40 // sequence bits of a tagged revision
	revSeqMask    = 1<<revSeqBits - 1
	revGenMask    = 1<<(62-revSeqBits) - 1

	maxBatchBytes = 256 << 10
	markPrefix    = "_journal."
	floorPrefix   = "_floor."
	// floorWindow is how long after claiming a partition this node reads
	// its keys' records from the state bucket with a freshness floor. A
	// stream leader cut off from its cluster steps down within the raft's
	// lost-quorum interval (10 s) of the cut; one cut off before the
	// claim is gone by then.
	floorWindow = 30 * time.Second
	// floorRetry is the pause before a floor read answered by a replica
	// behind its floor is sent again.
	floorRetry         = 5 * time.Millisecond
	checkpointParallel = 256
	commitRetries      = 3
)

// Stream is the journal stream as the journal uses it. Every call returns
// at once and calls done exactly once, on a goroutine of its own, within
// about timeout; data is not retained after the call returns.
//
// ttl is a published message's time to live (kvstate.SetTTL: 0 none,
// kvstate.NoExpiry never); a store that keeps messages its own way may
// ignore it.
type Stream interface {
	// Append publishes data to subj if subj's last sequence is still last
	// (0: subj has no message). Any error leaves the outcome unknown.
	Append(subj string, data []byte, last uint64, ttl, timeout time.Duration, done func(seq uint64, err error))
	// Publish publishes data to subj unconditionally.
	Publish(subj string, data []byte, ttl, timeout time.Duration, done func(seq uint64, err error))
	// Last returns the sequence of subj's last message (0: none), from the
	// stream's leader.
	Last(subj string, timeout time.Duration, done func(seq uint64, err error))
	// Read calls f for each message of subj with a sequence in [from,
	// upto], in order, then done. upto is a message of subj (a fence, a
	// barrier, or its last message), so a complete read ends on it; a read
	// that cannot reach it (a replica or a cut-off leader that lacks it,
	// or messages purged) ends with an error wrapping ErrReadIncomplete.
	// An error of f ends the read with it.
	Read(subj string, from, upto uint64, timeout time.Duration, f func(seq uint64, data []byte) error, done func(error))
	// Purge removes subj's messages below sequence upto.
	Purge(subj string, upto uint64, timeout time.Duration, done func(error))
}

// ErrReadIncomplete is the error of a read that ended before its last
// message: the replica that answered does not have it (or it was purged).
var ErrReadIncomplete = errors.New("mesh: journal read ended before its last message")

// Bucket is the state bucket as the journal uses it: leader reads,
// compare-and-swap writes, floor reads and unconditional puts. Every call
// returns at once and calls done exactly once, on a goroutine of its own.
// A write's ttl is as a Stream's.
type Bucket interface {
	// GetAsync reads key from the stream's leader; kvstate.ErrNotFound
	// (with the revision a create must expect) when it has no record.
	GetAsync(key string, timeout time.Duration, done func(val []byte, rev uint64, err error))
	// UpdateAsync writes val if key's revision is still rev (0: absent);
	// kvstate.ErrConflict otherwise.
	UpdateAsync(key string, val []byte, rev uint64, ttl, timeout time.Duration, done func(rev uint64, err error))
	// GetAsyncFloor reads key from a replica at or past sequence floor
	// (reading floorKey with it so a current replica's answer is never
	// empty); kvstate.ErrStale when the answering replica is behind.
	GetAsyncFloor(key, floorKey string, floor uint64, timeout time.Duration, done func([]byte, uint64, error))
	// GetManyAsyncFloor is GetAsyncFloor for up to kvstate.MaxManyKeys keys.
	GetManyAsyncFloor(keys []string, floorKey string, floor uint64, timeout time.Duration, done func([]kvstate.KeyRecord, error))
	// PutAsync writes val unconditionally and returns its revision.
	PutAsync(key string, val []byte, ttl, timeout time.Duration, done func(rev uint64, err error))
}

// UsageSink takes the usage records of the admissions journalled records
// spend (CONTRACT §6): each with its origin (the node and boot that wrote
// the journal message), the message's sequence and its index among the
// message's usage, so the same admission always has the same id. It is
// told of every usage a node's own batches commit and, when the journal
// adopts another journal's records, of every usage it reads there
// (published again: the ledger counts an id once), each origin's in order.
type UsageSink interface {
	Add(node, boot string, seq uint64, idx uint32, key string, record []byte, u *keyrec.Usage)
	// Sync calls done once every usage added before is durable (in the
	// usage stream); the journal's mark waits for it, so a journalled
	// admission is never forgotten before its usage is published.
	Sync(done func(error))
}

// View is what the journal knows of the node's routing: whether it serves a
// partition now, and in which epoch.
type View interface {
	Serving(p int) bool
	Epoch(p int) uint64
}

// Config configures a Journal. Every field but Log, OnFenced and Nonce is
// required.
type Config struct {
	Self   string // the node id: its subject is Prefix.v1.journal.<Self>
	Prefix string
	Parts  int
	Stream Stream
	Bucket Bucket
	View   View
	// OnFenced is told (outside the journal's locks) that partition p was
	// fenced away from this node by node by: it must stop serving p at once.
	OnFenced func(p int, by string)
	Runtime  rt.Runtime
	// Timeout bounds one append, read or write (the decision timeout).
	Timeout            time.Duration
	CheckpointInterval time.Duration
	// ReadCache is how long a read of another node's journal is kept for
	// adoptions of its other partitions (two leases).
	ReadCache time.Duration
	// Floors is true when the state bucket allows direct gets (floor
	// reads); otherwise every read is a leader read.
	Floors bool
	// Last and Mark are this node's subject's last sequence and its mark
	// when the journal starts (a node restarted with the same id goes on
	// from them).
	Last, Mark uint64
	// Nonce seeds the nonces of batches (default: random).
	Nonce uint64
	// Boot names this incarnation of the node in its batches (usage ids).
	Boot string
	// Usage takes the usage of journalled admissions; nil: none.
	Usage UsageSink
	// OnAdopted is told each record a partition's adoption took over
	// (once the partition is served), so the node can learn what they
	// hold (open reservations to sweep); nil: not told.
	OnAdopted func(key string, record []byte)
	// OnReservations is told, once a partition is adopted, of each key
	// its open-reservation index names whose record the adoption did not
	// read (checkpointed by an earlier owner): open of them, the first
	// expiring at next, as the index says (J17); nil: not told. Its
	// meaning is keys.Config.OnReservations's.
	OnReservations func(policy, key string, open int, next int64)
	// Retention says how long the journal's messages and the records
	// it checkpoints are kept (per-message TTLs; the zero value: none,
	// the stream's and the bucket's own limits apply).
	Retention keyrec.Retention
	Log       *slog.Logger
}

// Journal is one node's state journal. Its methods are safe for concurrent
// use and never block.
type Journal struct {
	cfg  Config
	log  *slog.Logger
	rt   rt.Runtime
	subj string

	recs   *records
	w      *writer
	floors *floors
	checks *checker
	ck     *checkpointer
	rd     *reader
	open   *openIndex

	stopped atomic.Bool

	// Counters for metrics (Collectors).
	appends, committedRecords, checkpoints atomic.Int64
	checkReads, checkOne                   atomic.Int64
}

// Subjects returns the prefix of the journal subjects of an installation:
// a node's subject is the prefix and its id.
func Subjects(prefix string) string { return prefix + ".v1.journal." }

// New returns a journal; Start starts its checkpoints.
func New(cfg Config) *Journal {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.CheckpointInterval <= 0 {
		cfg.CheckpointInterval = DefaultCheckpointInterval
	}
	j := &Journal{cfg: cfg, log: cfg.Log, rt: cfg.Runtime, subj: Subjects(cfg.Prefix) + cfg.Self}
	j.recs = newRecords(cfg.Parts)
	if cfg.Last > cfg.Mark {
		j.recs.inherit(cfg.Mark)
	}
	j.w = &writer{j: j, last: cfg.Last, nonce: cfg.Nonce}
	if cfg.Last > 0 && cfg.Retention.On() {
		// The subject holds messages of an earlier incarnation, whose
		// times to live this one does not know: its marks are kept as
		// long as any message may be.
		j.w.keep = keyrec.Forever
		if h := cfg.Retention.Horizon; h > 0 {
			j.w.keep = j.now().Add(h).UnixNano()
		}
	}
	j.floors = newFloors(j)
	j.checks = &checker{j: j}
	j.ck = &checkpointer{j: j, mark: cfg.Mark}
	j.rd = &reader{j: j, cache: make(map[string]*sourceRead)}
	j.open = newOpenIndex(j)
	return j
}

// Start starts the checkpoint loop.
func (j *Journal) Start() { j.ck.schedule() }

// Stop fails every pending write and stops the checkpoints.
func (j *Journal) Stop() {
	j.stopped.Store(true)
	j.w.stop()
}

func (j *Journal) partOf(key string) int { return ownership.PartitionOf(key, j.cfg.Parts) }

func (j *Journal) subjOf(id string) string { return Subjects(j.cfg.Prefix) + id }

func (j *Journal) now() time.Time { return j.rt.Now() }

// until is the time left before deadline on the journal's clock.
func (j *Journal) until(deadline time.Time) time.Duration { return deadline.Sub(j.now()) }

// opTimeout bounds one operation of a longer procedure (an adoption, a
// read) by the per-operation timeout and the time left before deadline: a
// lost message costs one operation's timeout, not the procedure's
// (invariant J12).
func (j *Journal) opTimeout(deadline time.Time) time.Duration {
	return min(j.until(deadline), j.cfg.Timeout)
}

// fencedErr is the error of a load or write of partition p that this node
// does not hold.
func fencedErr(p int) error { return fmt.Errorf("%w: partition %d", fail.ErrFenced, p) }

// tagRev returns rev (a sequence, with journalRevBit for the journal's)
// tagged with generation gen.
func tagRev(rev, gen uint64) uint64 {
	return rev&(journalRevBit|revSeqMask) | (gen&revGenMask)<<revSeqBits
}

func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// floorTTL is the time to live of a message that holds no record (a
// fence of another node's journal, a floor key): the retention's floor.
func (j *Journal) floorTTL() time.Duration {
	now := j.now().UnixNano()
	return j.cfg.Retention.TTLAt(j.cfg.Retention.KeepUntil(0, now), now)
}

// isTimeout reports an operation that got no answer in time (the stores
// wrap context.DeadlineExceeded).
func isTimeout(err error) bool { return errors.Is(err, context.DeadlineExceeded) }

// SetUsage sets the sink of journalled usage; call it before Start.
func (j *Journal) SetUsage(u UsageSink) { j.cfg.Usage = u }

// SetReservations sets Config.OnReservations when it is nil; call it
// before Start.
func (j *Journal) SetReservations(f func(policy, key string, open int, next int64)) {
	if j.cfg.OnReservations == nil {
		j.cfg.OnReservations = f
	}
}
