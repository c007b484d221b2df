package mesh

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/limitmesh/limitmesh/kvstate"
)

// The state journal: group commit across keys.
//
// A key's record used to be written to the state bucket on every change,
// one JetStream message per key per batch. Under a spread load (many keys,
// each changing rarely) that is one stream write per decision, and the
// stream's per-message work is most of the cost of a decision. The journal
// writes the records of every key that changed, across all of this node's
// partitions, in one message:
//
//   - each node appends to a subject of its own in the journal stream
//     (<PREFIX>_JOURNAL, subject <prefix>.v1.journal.<node>), one batch
//     message at a time, with the expected last sequence of that subject:
//     the records changed meanwhile go into the next batch, so the batch
//     size grows with the load (one write in flight, like the owner core's
//     per-key group commit). A write is acknowledged (and a strict call
//     answered) when its batch is;
//   - the latest record of every key whose record is only in the journal is
//     kept in memory (entries), and reads hit it first; the state bucket
//     holds checkpoints: every checkpoint interval the node writes the
//     records changed since (per-key compare-and-swap, as before) and then
//     records its mark (key _journal.<node> of the state bucket: every batch
//     up to it is checkpointed) and purges its subject up to the mark;
//   - fencing: a node taking a partition over from another (which may have
//     crashed, or may not know yet) first appends a fence message to the
//     other's subject. The other's next append then fails its expected
//     sequence; it reads the fence, stops serving that partition and fails
//     that partition's writes (the calls go to the new owner). So after the
//     fence no batch of the old owner commits, and the new owner reads the
//     old owner's subject from its mark to the fence: the latest journalled
//     record of every key of the partition. It appends those records to its
//     own journal (so whoever takes over from it finds them there) before
//     it serves the partition. The compare-and-swap of each key write that
//     fenced owners before still guards the checkpoints;
//   - a graceful release checkpoints the partition's keys before it deletes
//     the partition entry, so the next owner needs no journal; a partition
//     lost by time (no renewal) keeps its journalled records ("orphans")
//     until another node is seen to own it, and the mark never passes them
//     before.
//
// Revisions. Across nodes the fence does the work the per-key
// compare-and-swap did. Within the node, an owner core may hold a key's
// record from before its partition was lost or handed over and taken back:
// every revision this store returns carries the partition's generation on
// this node (bumped whenever the partition is adopted, lost or released),
// and a write expecting a revision of an older generation is a conflict,
// so the core reloads. Revisions of journalled records also carry
// journalRevBit (the rest is the batch's sequence, below 2^40), so a
// revision given back tells where it came from. Expected revision 0 still
// means "must not exist" and is checked (blind creates).

// DefaultCheckpointInterval is the default interval between checkpoints of
// journalled records to the state bucket.
const DefaultCheckpointInterval = 5 * time.Second

const (
	journalRevBit        = 1 << 62
	revSeqBits           = 40 // sequence bits of a tagged revision
	revSeqMask           = 1<<revSeqBits - 1
	revGenMask           = 1<<(62-revSeqBits) - 1
	journalMaxBatchBytes = 256 << 10
	journalMarkPrefix    = "_journal."
	journalFloorPrefix   = "_floor."
	// floorWindow is how long after claiming a partition this node reads
	// its keys' records from the state bucket with a freshness floor
	// (GetAsync). A stream leader cut off from its cluster steps down
	// within the raft's lost-quorum interval (10 s) of the cut; one cut
	// off before the claim is gone by then.
	floorWindow = 30 * time.Second
	// floorRetry is the pause before a floor read answered by a replica
	// behind its floor is sent again.
	floorRetry           = 5 * time.Millisecond
	checkpointParallel   = 256
	expectedSubjSeqHdr   = "Nats-Expected-Last-Subject-Sequence"
	journalCommitRetries = 3
)

// journalEntry is the latest journalled record of a key.
type journalEntry struct {
	val        []byte
	jseq       uint64 // the batch holding val
	firstDirty uint64 // the first batch not checkpointed (0: checkpointed)
	kvRev      uint64 // the key's revision in the state bucket, if kvKnown
	kvKnown    bool
	part       int
	orphan     bool // of a partition this node lost; kept for the mark
	// pin keeps the record above the mark (in view of a reader of this
	// journal) while its partition's claim is not renewed (see renewed).
	pin     bool
	touched int64 // unix ns of the last write or read
}

// journalWrite is a key write waiting for its batch, or (fence != nil) a
// tenure marker: a fence naming this node, appended on its own, or
// (barrier) an empty batch appended on its own, whose sequence bounds
// everything this node appended before it (adopt).
type journalWrite struct {
	fence    *journalFence
	barrier  bool
	key      string
	val      []byte
	part     int
	gen      uint64 // the partition's generation when the write came
	kvRev    uint64
	kvKnown  bool
	deadline time.Time
	done     func(uint64, error)
}

type journalStore struct {
	n        *Node
	under    *kvstate.JetStreamStore
	kv       jetstream.KeyValue // the state bucket (marks)
	js       jetstream.JetStream
	stream   jetstream.Stream
	subjPre  string // <prefix>.v1.journal.
	subj     string // this node's subject
	self     string
	timeout  time.Duration
	interval time.Duration

	wake chan struct{}
	// acks carries the acknowledgement of the writer's append (one at a
	// time) from the store's reply subscription.
	acks       chan journalAck
	streamName string

	mu      sync.Mutex
	entries map[string]*journalEntry
	gen     []uint64 // per partition (see Revisions above)
	// unrenewed[p]: this node claimed p and has not renewed the claim yet
	// (see renewed).
	unrenewed []bool
	// owned[p]: this node adopted p and has not lost or released it since.
	// Loads and writes of p's keys fail otherwise: a key's runner still
	// busy when p was lost would reload the key (the bucket's record, with
	// a revision of the new generation) and journal decisions of a
	// partition another node owns (seen in TestFaultPartition: such a
	// record, older than the bucket's, was the last of the hot key in the
	// journal, and the next owner adopted it).
	owned []bool
	// floors are, per partition, the state bucket's sequence when this
	// node claimed it (the acknowledgement of its write of floorKey) and
	// when (unix ns); nil when the bucket allows no direct gets.
	floors   []partFloor
	floorKey string
	// kvHigh is the highest sequence of this node's writes to the state
	// bucket that it knows of: a floor read must see them too.
	kvHigh uint64
	// checks are writes of keys new to this node (expected revision 0)
	// waiting for their check against the state bucket; checking is set
	// while one check of a batch of them is out (checkAbsent).
	checks   []*journalWrite
	checking bool
	pending  []*journalWrite
	last     uint64 // the last sequence of subj this node knows of
	mark     uint64 // batches up to it are checkpointed

	// readLock (capacity 1) serializes journal reads of adoptions; a
	// waiter gives up when its context ends (a read stalls while the
	// stream elects a leader, and adoptions of one dead node's partitions
	// all wait for it).
	readLock chan struct{}
	reads    map[string]*journalRead
	// consumerRead streams a long range for readRange; nil:
	// readRangeConsumer (a test substitutes one on a lagging replica).
	consumerRead func(ctx context.Context, subj string, seq, upto uint64, f func(seq uint64, data []byte) error) (next uint64, done bool, err error)

	ckMu sync.Mutex // one checkpoint at a time (a key is written by one)

	appends, records, checkpoints atomic.Int64
	checkReads, checkOne          atomic.Int64 // new-key check reads: batched (checkAbsent), per key
}

// journalRead is what was read of another node's journal (cached for
// adoptions of several partitions from the same node).
type journalRead struct {
	next   uint64 // the next sequence to read
	at     time.Time
	states map[string]journalState
}

type journalState struct {
	val []byte
	seq uint64
}

// partFloor is a partition's read floor (journalStore.floors).
type partFloor struct {
	seq uint64
	at  int64
}

// JournalStream returns the name of the journal stream.
func (n *Node) JournalStream() string { return strings.ToUpper(n.cfg.Prefix) + "_JOURNAL" }

// journalSubjects returns the prefix of the journal subjects of an
// installation: a node's subject is the prefix and its id.
func journalSubjects(prefix string) string { return prefix + ".v1.journal." }

// startJournal creates the journal stream if needed and returns the
// journal store over under; its goroutines run until ctx ends.
func (n *Node) startJournal(ctx, bgctx context.Context, js jetstream.JetStream, under *kvstate.JetStreamStore) (*journalStore, error) {
	var stream jetstream.Stream
	err := n.retryJS(ctx, "stream "+n.JournalStream(), func(ctx context.Context) (err error) {
		stream, err = js.Stream(ctx, n.JournalStream())
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			stream, err = js.CreateStream(ctx, jetstream.StreamConfig{
				Name:        n.JournalStream(),
				Description: "limitmesh state journal",
				Subjects:    []string{journalSubjects(n.cfg.Prefix) + "*"},
				Storage:     jetstream.FileStorage,
				Replicas:    n.cfg.Replicas,
				MaxAge:      n.cfg.StateTTL,
				Discard:     jetstream.DiscardOld,
			})
			if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
				stream, err = js.Stream(ctx, n.JournalStream())
			}
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("mesh: journal stream: %w", err)
	}
	kv, err := js.KeyValue(ctx, n.StateBucket())
	if err != nil {
		return nil, fmt.Errorf("mesh: state bucket: %w", err)
	}
	j := &journalStore{
		n:       n,
		under:   under,
		kv:      kv,
		js:      js,
		stream:  stream,
		subjPre: journalSubjects(n.cfg.Prefix),
		subj:    journalSubjects(n.cfg.Prefix) + n.cfg.NodeID,
		self:    n.cfg.NodeID,
		timeout: n.cfg.DecisionTimeout,
		// Records reach the bucket well within its idle expiry (the
		// journal stream keeps messages as long).
		interval:   min(n.cfg.CheckpointInterval, n.cfg.StateTTL/4),
		wake:       make(chan struct{}, 1),
		acks:       make(chan journalAck, 1),
		streamName: n.JournalStream(),
		entries:    make(map[string]*journalEntry),
		gen:        make([]uint64, n.cfg.Partitions),
		unrenewed:  make([]bool, n.cfg.Partitions),
		owned:      make([]bool, n.cfg.Partitions),
		reads:      make(map[string]*journalRead),
		readLock:   make(chan struct{}, 1),
		floorKey:   journalFloorPrefix + n.cfg.NodeID,
	}
	// Floor reads are direct gets (GetAsync): only on a bucket that
	// allows them (a bucket made elsewhere may not; its reads stay leader
	// reads).
	if err := n.retryJS(ctx, "state bucket status", func(ctx context.Context) error {
		st, err := kv.Status(ctx)
		if err != nil {
			return err
		}
		if bs, ok := st.(*jetstream.KeyValueBucketStatus); ok && bs.StreamInfo().Config.AllowDirect {
			j.floors = make([]partFloor, n.cfg.Partitions)
		}
		return nil
	}); err != nil {
		return nil, fmt.Errorf("mesh: state bucket: %w", err)
	}
	// Where this node's subject ends (a node restarted with the same id
	// continues it; what it holds is adopted with the partitions).
	if err := n.retryJS(ctx, "journal end", func(ctx context.Context) error {
		last, err := j.lastSeq(ctx)
		j.last = last
		return err
	}); err != nil {
		return nil, fmt.Errorf("mesh: journal: %w", err)
	}
	if mark, err := readMark(ctx, j.kv, j.self); err == nil {
		j.mark = mark
	}
	for _, c := range []prometheus.Collector{
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "limitmesh_journal_appends_total",
			Help: "Messages this node appended to its state journal (each carries the records of every key changed meanwhile).",
		}, func() float64 { return float64(j.appends.Load()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "limitmesh_journal_records_total",
			Help: "Key records this node committed through its state journal.",
		}, func() float64 { return float64(j.records.Load()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name:        "limitmesh_journal_key_checks_total",
			Help:        keyChecksHelp,
			ConstLabels: prometheus.Labels{"read": "batch"},
		}, func() float64 { return float64(j.checkReads.Load()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name:        "limitmesh_journal_key_checks_total",
			Help:        keyChecksHelp,
			ConstLabels: prometheus.Labels{"read": "key"},
		}, func() float64 { return float64(j.checkOne.Load()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "limitmesh_checkpoint_writes_total",
			Help: "Journalled key records this node checkpointed to the state bucket.",
		}, func() float64 { return float64(j.checkpoints.Load()) }),
	} {
		if err := n.reg.Register(c); err != nil {
			return nil, err
		}
	}
	n.bg.Add(2)
	go func() { defer n.bg.Done(); j.run(bgctx) }()
	go func() { defer n.bg.Done(); j.checkpointLoop(bgctx) }()
	return j, nil
}

// lastSeq returns the sequence of the last message of this node's subject
// (0 when it has none).
func (j *journalStore) lastSeq(ctx context.Context) (uint64, error) {
	m, err := j.stream.GetLastMsgForSubject(ctx, j.subj)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	return m.Sequence, nil
}

// Get implements kvstate.Store.
func (j *journalStore) Get(ctx context.Context, key string) ([]byte, uint64, error) {
	type res struct {
		val []byte
		rev uint64
		err error
	}
	ch := make(chan res, 1)
	j.GetAsync(key, timeoutOf(ctx, j.timeout), func(v []byte, r uint64, err error) { ch <- res{v, r, err} })
	select {
	case r := <-ch:
		return r.val, r.rev, r.err
	case <-ctx.Done():
		return nil, 0, ctx.Err()
	}
}

// Update implements kvstate.Store.
func (j *journalStore) Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error) {
	type res struct {
		rev uint64
		err error
	}
	ch := make(chan res, 1)
	j.UpdateAsync(key, value, rev, timeoutOf(ctx, j.timeout), func(r uint64, err error) { ch <- res{r, err} })
	select {
	case r := <-ch:
		return r.rev, r.err
	case <-ctx.Done():
		return 0, ctx.Err()
	}
}

func timeoutOf(ctx context.Context, def time.Duration) time.Duration {
	if d, ok := ctx.Deadline(); ok {
		return time.Until(d)
	}
	return def
}

// GetAsync implements kvstate.AsyncStore: the journalled record when it
// is not checkpointed yet, else the state bucket's (which may have expired
// since: the bucket's idle expiry applies as without the journal).
func (j *journalStore) GetAsync(key string, timeout time.Duration, done func([]byte, uint64, error)) {
	part := partitionOf(key, j.n.cfg.Partitions)
	j.mu.Lock()
	if !j.owned[part] {
		j.mu.Unlock()
		go done(nil, 0, fmt.Errorf("%w: partition %d", errFenced, part))
		return
	}
	gen := j.gen[part]
	if e := j.entries[key]; e != nil && !e.orphan && e.firstDirty != 0 {
		val, rev := e.val, tagRev(e.jseq|journalRevBit, gen)
		e.touched = time.Now().UnixNano()
		j.mu.Unlock()
		go done(val, rev, nil)
		return
	}
	var floor uint64
	var unset bool
	if j.floors != nil {
		if f := j.floors[part]; time.Now().UnixNano()-f.at < int64(floorWindow) {
			floor, unset = max(f.seq, j.kvHigh), f.seq == 0
		}
	}
	j.mu.Unlock()
	tagged := func(val []byte, rev uint64, err error) {
		if rev != 0 {
			rev = tagRev(rev, gen)
		}
		done(val, rev, err)
	}
	deadline := time.Now().Add(timeout)
	switch {
	case unset:
		// The claim could not write its floor: write it now.
		go func() {
			ctx, cancel := context.WithDeadline(context.Background(), deadline)
			err := j.writeFloor(ctx, part)
			cancel()
			if err != nil {
				tagged(nil, 0, fmt.Errorf("%w: %w", ErrUnavailable, err))
				return
			}
			j.mu.Lock()
			floor := max(j.floors[part].seq, j.kvHigh)
			j.mu.Unlock()
			j.getFloor(key, floor, deadline, tagged)
		}()
	case floor != 0:
		j.getFloor(key, floor, deadline, tagged)
	default:
		j.under.GetAsync(key, timeout, tagged)
	}
}

// getFloor reads key from the state bucket with a freshness floor (see
// adopt), again after floorRetry while the replica answering is behind it,
// until deadline. A read that fails after earlier ones were answered
// behind the floor (the last one ran out of time: seen on a loaded
// machine) reports that staleness, the cause.
func (j *journalStore) getFloor(key string, floor uint64, deadline time.Time, done func([]byte, uint64, error)) {
	j.getFloorAfter(key, floor, deadline, nil, done)
}

func (j *journalStore) getFloorAfter(key string, floor uint64, deadline time.Time, stale error, done func([]byte, uint64, error)) {
	j.under.GetAsyncFloor(key, j.floorKey, floor, time.Until(deadline), func(val []byte, rev uint64, err error) {
		if errors.Is(err, kvstate.ErrStale) {
			if time.Until(deadline) > floorRetry {
				time.AfterFunc(floorRetry, func() { j.getFloorAfter(key, floor, deadline, err, done) })
				return
			}
			stale = err
		}
		if stale != nil && (errors.Is(err, kvstate.ErrStale) || errors.Is(err, context.DeadlineExceeded)) {
			val, rev, err = nil, 0, fmt.Errorf("%w: %w", ErrUnavailable, stale)
		}
		done(val, rev, err)
	})
}

// claimFloor records the state bucket's sequence after claiming partition
// p: for floorWindow the owner reads p's keys from replicas at least that
// current. A key's latest record in the bucket was written before the
// claim (by a previous owner) or by this node (kvHigh), and a stream
// leader cut off from its cluster before the claim, which keeps answering
// leader reads for a while (right after a partition heals too), would
// answer with an older record: a regression of the key's state.
func (j *journalStore) claimFloor(ctx context.Context, p int) error {
	if j.floors == nil {
		return nil
	}
	j.mu.Lock()
	j.floors[p] = partFloor{at: time.Now().UnixNano()} // unset until the write lands
	j.mu.Unlock()
	return j.writeFloor(ctx, p)
}

// writeFloor writes the floor key and raises partition p's floor to the
// write's revision (unless p was claimed again meanwhile: that claim's
// floor must come from a write after it).
func (j *journalStore) writeFloor(ctx context.Context, p int) error {
	j.mu.Lock()
	claimed := j.floors[p].at
	j.mu.Unlock()
	seq, err := j.kv.Put(ctx, j.floorKey, nil)
	if err != nil {
		return fmt.Errorf("writing the read floor: %w", err)
	}
	j.mu.Lock()
	if j.floors[p].at == claimed {
		j.floors[p].seq = max(j.floors[p].seq, seq)
	}
	j.kvHigh = max(j.kvHigh, seq)
	j.mu.Unlock()
	return nil
}

// tagRev returns rev (a sequence, with journalRevBit for the journal's)
// tagged with generation gen.
func tagRev(rev, gen uint64) uint64 {
	return rev&(journalRevBit|revSeqMask) | (gen&revGenMask)<<revSeqBits
}

// UpdateAsync implements kvstate.AsyncStore: the record goes into the next
// batch. A revision of an older generation of the key's partition is a
// conflict; expected revision 0 (the key must not exist) is checked
// against the journalled records and the state bucket.
func (j *journalStore) UpdateAsync(key string, value []byte, rev uint64, timeout time.Duration, done func(uint64, error)) {
	w := &journalWrite{key: key, val: value, part: partitionOf(key, j.n.cfg.Partitions),
		deadline: time.Now().Add(timeout), done: done}
	j.mu.Lock()
	if !j.owned[w.part] {
		j.mu.Unlock()
		go done(0, fmt.Errorf("%w: partition %d", errFenced, w.part))
		return
	}
	w.gen = j.gen[w.part]
	e := j.entries[key]
	known := e != nil && !e.orphan
	switch {
	case rev != 0 && rev>>revSeqBits&revGenMask != w.gen&revGenMask:
		j.mu.Unlock()
		go done(0, kvstate.ErrConflict)
		return
	case rev == 0 && known:
		j.mu.Unlock()
		go done(0, kvstate.ErrConflict)
		return
	case rev == 0 && j.floors != nil && j.floors[w.part].seq != 0:
		// Checked with other new keys in one floor read (checkAbsent).
		j.checks = append(j.checks, w)
		start := !j.checking
		j.checking = true
		j.mu.Unlock()
		if start {
			j.checkAbsent()
		}
		return
	case rev == 0:
		j.mu.Unlock()
		j.checkAbsentOne(w)
		return
	case rev&journalRevBit == 0:
		w.kvRev, w.kvKnown = rev&revSeqMask, true
	}
	// The common case: into the next batch under the same lock.
	j.pending = append(j.pending, w)
	j.mu.Unlock()
	j.signal()
}

// checkAbsent checks the keys of the waiting new-key writes (j.checks)
// against the state bucket, in batches of up to kvstate.MaxManyKeys keys,
// one batch at a time (those that come meanwhile wait for the next), each
// one floor read (GetManyAsyncFloor) from a replica holding every write
// of the keys: the partitions' claim floors and this node's own writes.
// A write whose key has a record there loses (ErrConflict); the others go
// into the journal, expecting the key's marker revision (or none). A batch
// whose read fails (a timeout, a replica behind the floor checkTries
// times) is checked write by write with leader reads, as without batches.
// Where keys are new to the node (every key at first), this is one read
// per batch rather than one per key.
func (j *journalStore) checkAbsent() {
	j.mu.Lock()
	n := min(len(j.checks), kvstate.MaxManyKeys)
	if n == 0 {
		j.checking = false
		j.mu.Unlock()
		return
	}
	batch := slices.Clone(j.checks[:n])
	rest := copy(j.checks, j.checks[n:])
	clear(j.checks[rest:])
	j.checks = j.checks[:rest]
	floor := j.kvHigh
	latest := batch[0].deadline
	keys := make([]string, len(batch))
	for i, w := range batch {
		floor = max(floor, j.floors[w.part].seq)
		latest = later(latest, w.deadline)
		keys[i] = w.key
	}
	j.mu.Unlock()
	j.checkBatch(batch, keys, floor, latest, 1)
}

// checkTries is how many times a batch of new-key checks is read from a
// replica behind its floor (a follower a few writes behind: the direct get
// goes to any replica) before it is checked key by key.
const checkTries = 3

// checkBatch sends the floor read of one batch of new-key checks (try is
// its number); then the next batch.
func (j *journalStore) checkBatch(batch []*journalWrite, keys []string, floor uint64, latest time.Time, try int) {
	j.checkReads.Add(1)
	j.under.GetManyAsyncFloor(keys, j.floorKey, floor, time.Until(latest), func(recs []kvstate.KeyRecord, err error) {
		if errors.Is(err, kvstate.ErrStale) && try < checkTries && time.Until(latest) > 2*floorRetry {
			time.AfterFunc(floorRetry, func() { j.checkBatch(batch, keys, floor, latest, try+1) })
			return
		}
		if err != nil {
			j.n.log.Debug("journal: batched key check failed, checking one by one", "keys", len(batch), "error", err.Error())
			for _, w := range batch {
				j.checkAbsentOne(w)
			}
		} else {
			absent := make([]*journalWrite, 0, len(batch))
			for i, w := range batch {
				if recs[i].Live {
					w.done(0, kvstate.ErrConflict)
					continue
				}
				w.kvRev, w.kvKnown = recs[i].Rev, true
				absent = append(absent, w)
			}
			if len(absent) > 0 {
				j.enqueue(absent...)
			}
		}
		j.checkAbsent()
	})
}

// keyChecksHelp describes limitmesh_journal_key_checks_total.
const keyChecksHelp = "Reads of the state bucket checking that keys new to this node have no record there: " +
	`read="batch" (one floor read of up to 512 keys), read="key" (one leader read of one key).`

// checkAbsentOne checks the key of new-key write w against the state
// bucket with a leader read, then journals it or fails it.
func (j *journalStore) checkAbsentOne(w *journalWrite) {
	timeout := time.Until(w.deadline)
	if timeout <= 0 {
		w.done(0, fmt.Errorf("%w: journal write: %w", ErrUnavailable, context.DeadlineExceeded))
		return
	}
	j.checkOne.Add(1)
	j.under.GetAsync(w.key, timeout, func(_ []byte, r uint64, err error) {
		switch {
		case err == nil:
			w.done(0, kvstate.ErrConflict)
		case errors.Is(err, kvstate.ErrNotFound):
			w.kvRev, w.kvKnown = r, true
			j.enqueue(w)
		default:
			w.done(0, err)
		}
	})
}

func (j *journalStore) enqueue(ws ...*journalWrite) {
	j.mu.Lock()
	j.pending = append(j.pending, ws...)
	j.mu.Unlock()
	j.signal()
}

// signal wakes the writer if it waits.
func (j *journalStore) signal() {
	select {
	case j.wake <- struct{}{}:
	default:
	}
}

// run is the writer: it commits the pending writes, one batch at a time.
func (j *journalStore) run(ctx context.Context) {
	var buf []byte
	for {
		select {
		case <-ctx.Done():
			j.mu.Lock()
			p := j.pending
			j.pending = nil
			j.mu.Unlock()
			for _, w := range p {
				w.done(0, fmt.Errorf("%w: node stopping", ErrUnavailable))
			}
			return
		case <-j.wake:
		}
		for ctx.Err() == nil {
			batch := j.take()
			if len(batch) == 0 {
				break
			}
			buf = j.commit(ctx, batch, buf)
		}
	}
}

// take removes the next batch from the pending writes (at most
// journalMaxBatchBytes, at least one write); writes whose deadline passed
// fail without being sent.
func (j *journalStore) take() []*journalWrite {
	now := time.Now()
	j.mu.Lock()
	var batch, expired []*journalWrite
	size, i := 0, 0
	var stale []*journalWrite
	for ; i < len(j.pending); i++ {
		w := j.pending[i]
		if now.After(w.deadline) {
			expired = append(expired, w)
			continue
		}
		if w.gen != j.gen[w.part] {
			stale = append(stale, w) // the partition changed hands meanwhile
			continue
		}
		if w.fence != nil || w.barrier {
			// A marker or barrier is a message of its own, between the
			// batches queued before and after it.
			if len(batch) == 0 {
				batch = append(batch, w)
				i++
			}
			break
		}
		if len(batch) > 0 && size+len(w.key)+len(w.val)+8 > journalMaxBatchBytes {
			break
		}
		size += len(w.key) + len(w.val) + 8
		batch = append(batch, w)
	}
	rest := copy(j.pending, j.pending[i:])
	clear(j.pending[rest:])
	j.pending = j.pending[:rest]
	j.mu.Unlock()
	for _, w := range expired {
		w.done(0, fmt.Errorf("%w: journal write: %w", ErrUnavailable, context.DeadlineExceeded))
	}
	for _, w := range stale {
		w.done(0, kvstate.ErrConflict)
	}
	return batch
}

// commit appends batch to this node's subject and reports every write's
// result; it returns buf for reuse. A write is answered by its deadline:
// one whose batch is not known to be committed by then fails (its outcome
// may be unknown: a strict call then gets a 503, never an admission that
// was not recorded).
func (j *journalStore) commit(ctx context.Context, batch []*journalWrite, buf []byte) []byte {
	items := make([]journalItem, 0, len(batch))
	var lastErr error
	for attempt := 0; ; attempt++ {
		now := time.Now()
		keep := batch[:0]
		for _, w := range batch {
			if attempt > 0 && (attempt == journalCommitRetries || ctx.Err() != nil || !now.Before(w.deadline)) {
				w.done(0, fmt.Errorf("%w: journal write: %v", ErrUnavailable, lastErr))
				continue
			}
			keep = append(keep, w)
		}
		batch = keep
		if len(batch) == 0 {
			return buf
		}
		deadline := now.Add(j.timeout)
		latest := batch[0].deadline
		items = items[:0]
		for _, w := range batch {
			if w.fence == nil && !w.barrier {
				items = append(items, journalItem{key: w.key, val: w.val})
			}
			latest = later(latest, w.deadline)
		}
		if latest.Before(deadline) {
			deadline = latest
		}
		nonce := rand.Uint64()
		if f := batch[0].fence; f != nil {
			// No nonce: after an unknown outcome the marker is appended
			// again, which is harmless.
			nonce = 0
			buf = appendJournalFence(buf[:0], *f)
		} else {
			buf = appendJournalBatch(buf[:0], nonce, items)
		}
		j.mu.Lock()
		last := j.last
		j.mu.Unlock()
		msg := &nats.Msg{Subject: j.subj, Data: buf,
			Header: nats.Header{expectedSubjSeqHdr: []string{strconv.FormatUint(last, 10)}}}
		seq, err := j.publish(msg, time.Until(deadline))
		if err == nil {
			j.committed(batch, seq)
			return buf
		}
		lastErr = err
		// Refused (another message came first: a fence, or a batch of
		// ours whose acknowledgement was lost) or unknown: read what the
		// subject holds since last.
		rctx, cancel := context.WithDeadline(ctx, later(deadline, time.Now().Add(50*time.Millisecond)))
		landed, lost, rerr := j.resync(rctx, last, nonce)
		cancel()
		if rerr != nil {
			lastErr = errors.Join(err, rerr)
			continue
		}
		if landed != 0 {
			j.committed(batch, landed)
			return buf
		}
		keep = batch[:0]
		for _, w := range batch {
			if lost[w.part] {
				w.done(0, fmt.Errorf("%w (journal fenced)", errFenced))
				continue
			}
			keep = append(keep, w)
		}
		batch = keep
	}
}

// publish appends m and waits for the acknowledgement (at most timeout):
// the sequence it was stored at. Only the writer calls it.
func (j *journalStore) publish(m *nats.Msg, timeout time.Duration) (uint64, error) {
	j.under.PublishAsync(m, j.streamName, timeout, func(seq uint64, err error) {
		j.acks <- journalAck{seq, err}
	})
	a := <-j.acks
	return a.seq, a.err
}

type journalAck struct {
	seq uint64
	err error
}

func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// committed records a batch committed at seq and reports it.
func (j *journalStore) committed(batch []*journalWrite, seq uint64) {
	now := time.Now().UnixNano()
	j.mu.Lock()
	j.last = max(j.last, seq)
	records := int64(0)
	for _, w := range batch {
		if w.fence != nil || w.barrier {
			continue
		}
		records++
		e := j.entries[w.key]
		if e == nil || e.orphan {
			e = &journalEntry{part: w.part, kvRev: w.kvRev, kvKnown: w.kvKnown}
			j.entries[w.key] = e
		}
		e.val, e.jseq, e.touched = w.val, seq, now
		if e.firstDirty == 0 {
			e.firstDirty = seq
		}
		if j.unrenewed[w.part] {
			e.pin = true
		}
		// A write that was in flight while its partition changed hands:
		// committed, but the partition's next owner has it (or will, from
		// the journal); keep it for the mark only.
		e.orphan = w.gen != j.gen[w.part]
	}
	j.mu.Unlock()
	j.appends.Add(1)
	j.records.Add(records)
	// The callbacks run here, on the writer, before it takes the next
	// batch: the writes they start (the calls that queued on these keys)
	// join that batch. (Running them on a goroutine of their own while the
	// next append went out made smaller batches: strict decisions were
	// about 8% slower.)
	for _, w := range batch {
		w.done(tagRev(seq|journalRevBit, w.gen), nil)
	}
}

// resync reads this node's subject after last (the writer's: only the
// writer calls it): it reports the sequence
// of the batch with nonce if it landed, and the partitions fenced away
// from this node (which it stops serving at once).
func (j *journalStore) resync(ctx context.Context, last, nonce uint64) (landed uint64, lost map[int]bool, err error) {
	rctx, cancel := context.WithTimeout(ctx, j.timeout)
	defer cancel()
	end, err := j.lastSeq(rctx)
	if err != nil {
		return 0, nil, err
	}
	lost = make(map[int]bool)
	for seq := last + 1; seq <= end; {
		m, err := j.stream.GetMsg(rctx, seq, jetstream.WithGetMsgSubject(j.subj))
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			break
		}
		if err != nil {
			return 0, nil, err
		}
		jm, derr := decodeJournal(m.Data)
		switch {
		case derr != nil:
			j.n.log.Warn("corrupt journal message", "subject", j.subj, "seq", m.Sequence, "error", derr.Error())
		case jm.fence != nil:
			if f := jm.fence; f.node != j.self && f.part < len(j.n.router.slots) {
				slot := &j.n.router.slots[f.part]
				if f.epoch > slot.epoch.Load() || !j.n.router.serving(f.part) {
					lost[f.part] = true
					slot.until.Store(0)
					j.n.log.Warn("partition fenced by its new owner", "partition", f.part, "owner", f.node)
					if s := j.n.shards; s != nil {
						go func() {
							vctx, cancel := context.WithTimeout(context.Background(), j.timeout)
							s.verify(vctx, f.part)
							cancel()
						}()
					}
				}
			}
		case nonce != 0 && jm.nonce == nonce:
			landed = m.Sequence
		}
		seq = m.Sequence + 1
	}
	// end < last when the subject's messages expired (the stream's age
	// limit, after a long idle time): expect what is there now.
	j.mu.Lock()
	j.last = end
	j.mu.Unlock()
	return landed, lost, nil
}

// checkpointLoop checkpoints every interval until ctx ends.
func (j *journalStore) checkpointLoop(ctx context.Context) {
	t := time.NewTicker(j.interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if err := j.checkpoint(ctx, -1); err != nil {
			j.n.log.Warn("checkpoint incomplete", "error", err.Error())
		}
		j.expireReads()
	}
}

// checkpoint writes the journalled records not yet in the state bucket:
// of partition part, or (part < 0) of every partition this node serves;
// then it advances the mark.
func (j *journalStore) checkpoint(ctx context.Context, part int) error {
	type todo struct {
		key   string
		e     *journalEntry
		val   []byte
		jseq  uint64
		rev   uint64
		known bool
	}
	j.ckMu.Lock()
	defer j.ckMu.Unlock()
	j.mu.Lock()
	var list []todo
	for k, e := range j.entries {
		if e.firstDirty == 0 || e.orphan || (part >= 0 && e.part != part) ||
			(part < 0 && !j.n.router.serving(e.part)) {
			continue
		}
		list = append(list, todo{k, e, e.val, e.jseq, e.kvRev, e.kvKnown})
	}
	j.mu.Unlock()
	sem := make(chan struct{}, checkpointParallel)
	var wg sync.WaitGroup
	var failed atomic.Int64
	var firstErr atomic.Value
	for _, t := range list {
		if ctx.Err() != nil {
			break
		}
		sem <- struct{}{}
		wg.Add(1)
		j.writeRecord(t.key, t.val, t.rev, t.known, part >= 0, func(rev uint64, err error) {
			defer func() { <-sem; wg.Done() }()
			j.mu.Lock()
			if err == nil {
				t.e.kvRev, t.e.kvKnown = rev, true
				j.kvHigh = max(j.kvHigh, rev)
				if t.e.jseq == t.jseq {
					t.e.firstDirty = 0
				} else {
					t.e.firstDirty = t.jseq + 1
				}
			} else {
				t.e.kvKnown = false
			}
			j.mu.Unlock()
			if err != nil {
				failed.Add(1)
				firstErr.CompareAndSwap(nil, err)
			} else {
				j.checkpoints.Add(1)
			}
		})
	}
	wg.Wait()
	j.advanceMark(ctx)
	if f := failed.Load(); f > 0 {
		return fmt.Errorf("%d of %d records not checkpointed: %v", f, len(list), firstErr.Load())
	}
	return ctx.Err()
}

// writeRecord writes val as key's record in the state bucket with a
// compare-and-swap on rev (read first when not known). A lost
// compare-and-swap is retried once after a read while this node still
// serves the key's partition (or releases it: releasing).
func (j *journalStore) writeRecord(key string, val []byte, rev uint64, known, releasing bool, done func(uint64, error)) {
	part := partitionOf(key, j.n.cfg.Partitions)
	var write func(rev uint64, retry bool)
	reread := func() {
		j.under.GetAsync(key, j.timeout, func(_ []byte, r uint64, err error) {
			if err != nil && !errors.Is(err, kvstate.ErrNotFound) {
				done(0, err)
				return
			}
			write(r, false)
		})
	}
	write = func(rev uint64, retry bool) {
		j.under.UpdateAsync(key, val, rev, j.timeout, func(nrev uint64, err error) {
			if errors.Is(err, kvstate.ErrConflict) && retry && (releasing || j.n.router.serving(part)) {
				reread()
				return
			}
			done(nrev, err)
		})
	}
	if !known {
		reread()
		return
	}
	write(rev, true)
}

// advanceMark records how far this node's journal is checkpointed and
// purges it up to there; it also forgets checkpointed entries idle for an
// interval.
func (j *journalStore) advanceMark(ctx context.Context) {
	idle := time.Now().Add(-j.interval).UnixNano()
	j.mu.Lock()
	m := j.last
	for k, e := range j.entries {
		switch {
		case e.firstDirty != 0:
			m = min(m, e.firstDirty-1)
		case e.pin:
			m = min(m, e.jseq-1)
		case e.touched < idle:
			delete(j.entries, k)
		}
	}
	old := j.mark
	j.mu.Unlock()
	if m <= old {
		return
	}
	mctx, cancel := context.WithTimeout(ctx, j.timeout)
	defer cancel()
	if _, err := j.kv.Put(mctx, journalMarkPrefix+j.self, strconv.AppendUint(nil, m, 10)); err != nil {
		if ctx.Err() != nil {
			return
		}
		j.n.log.Warn("recording the journal mark", "error", err.Error())
		return
	}
	j.n.log.Debug("journal mark advanced", "from", old, "to", m)
	j.mu.Lock()
	j.mark = max(j.mark, m)
	j.mu.Unlock()
	// The message at the mark stays: the subject's last sequence, which
	// the next append expects, never goes away under the writer.
	if err := j.stream.Purge(mctx, jetstream.WithPurgeSubject(j.subj), jetstream.WithPurgeSequence(m)); err != nil {
		j.n.log.Debug("purging the journal", "error", err.Error())
	}
}

// markOf returns node id's mark: this node's own, or the one id recorded.
func (j *journalStore) markOf(ctx context.Context, id string) (uint64, error) {
	if id == j.self {
		j.mu.Lock()
		defer j.mu.Unlock()
		return j.mark, nil
	}
	return readMark(ctx, j.kv, id)
}

// readMark returns node id's mark, from the state bucket kv (0 when it
// has none).
func readMark(ctx context.Context, kv jetstream.KeyValue, id string) (uint64, error) {
	e, err := kv.Get(ctx, journalMarkPrefix+id)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	m, err := strconv.ParseUint(string(e.Value()), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%w: journal mark of %s: %q", ErrCorruptRecord, id, e.Value())
	}
	return m, nil
}

// release checkpoints partition p's journalled records before this node
// hands p over (its slot no longer serves), then forgets them; on failure
// they stay as orphans.
//
// A partition with orphans (records of a tenure this node lost, not yet
// seen adopted by another node) is not released: the checkpoint skips
// orphans, so the next owner would read the state bucket's older records.
// Its entry is left to expire, and the next claimer adopts the orphans
// from this node's journal.
func (j *journalStore) release(ctx context.Context, p int) error {
	j.mu.Lock()
	j.owned[p] = false // drained and flushed: no more writes of p
	orphans := 0
	for _, e := range j.entries {
		if e.part == p && e.orphan {
			orphans++
		}
	}
	j.mu.Unlock()
	if orphans > 0 {
		return fmt.Errorf("%d records of the partition from before this node lost it are only in its journal", orphans)
	}
	err := j.checkpoint(ctx, p)
	j.mu.Lock()
	j.gen[p]++
	j.unrenewed[p] = false
	for k, e := range j.entries {
		if e.part == p {
			// A pinned record (the claim is not renewed) stays in view,
			// as an orphan, until the entry is seen deleted: if the delete
			// fails, the entry still names the claim's sources, and the
			// next claimer reads them (seen in TestFaultPartition: the
			// checkpoint hid the hot key's records, the delete failed, and
			// the previous owner's older record won).
			if err == nil && e.firstDirty == 0 && !e.pin {
				delete(j.entries, k)
			} else {
				e.orphan = true
			}
		}
	}
	j.mu.Unlock()
	return err
}

// lose keeps partition p's journalled records as orphans: the next owner
// reads them from the journal, and the mark does not pass them until then.
func (j *journalStore) lose(p int) {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.gen[p]++
	j.owned[p] = false
	kept, dropped := 0, 0
	for k, e := range j.entries {
		if e.part != p {
			continue
		}
		if e.firstDirty == 0 && !e.pin {
			delete(j.entries, k)
			dropped++
		} else {
			e.orphan = true
			kept++
		}
	}
	j.n.log.Debug("lost partition's records", "partition", p, "kept", kept, "dropped", dropped, "mark", j.mark)
}

// renewed reports that this node renewed its claim of partition p: its
// adoption is done and its entry no longer names the claim's sources, so
// the partition's next claimer reads this node's journal alone, and the
// mark may pass p's records once they are checkpointed. Until then they
// stay in view (pinned) even when checkpointed: the next claimer reads the
// sources too, oldest first, and a source's older record of a key would
// win over this node's newer one hidden below its mark (seen in
// TestFaultPartition: a node adopted the hot key, decided, checkpointed,
// could not renew while the shards stream had no leader, and the next
// claimer took the previous owner's record: 636 units forgotten).
func (j *journalStore) renewed(p int) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if !j.unrenewed[p] {
		return
	}
	j.unrenewed[p] = false
	for _, e := range j.entries {
		if e.part == p && !e.orphan {
			e.pin = false
		}
	}
}

// ownedElsewhere forgets the orphans of partition p once p has another
// owner that finished adopting them (or none after a release).
func (j *journalStore) ownedElsewhere(p int) { j.dropOrphans(p) }

func (j *journalStore) dropOrphans(p int) {
	j.mu.Lock()
	defer j.mu.Unlock()
	n := 0
	for k, e := range j.entries {
		if e.part == p && e.orphan {
			delete(j.entries, k)
			n++
		}
	}
	if n > 0 {
		j.n.log.Debug("orphans dropped", "partition", p, "records", n)
	}
}

// adopt prepares partition p, just claimed in epoch over an entry whose
// adoption sources were sources (partValue.From, oldest first; none when
// the entry was absent or released): it fences each source's journal (its
// own: appends a barrier) and reads it from its mark to the fence, and
// appends to this node's journal the latest record of each of p's keys
// (later sources win), so whoever takes p over from this node finds them
// there.
func (j *journalStore) adopt(ctx context.Context, sources []string, epoch uint64, p int) (err error) {
	// This node's own records of p become orphans: they hold the mark
	// (so its journal is not purged under the reads below) until the
	// adopted records replace them.
	j.mu.Lock()
	j.gen[p]++
	gen := j.gen[p]
	j.unrenewed[p] = true
	j.owned[p] = false
	for _, e := range j.entries {
		if e.part == p {
			e.orphan = true
		}
	}
	j.mu.Unlock()
	defer func() {
		if err == nil {
			j.dropOrphans(p)
		}
	}()
	latest := make(map[string][]byte)
	for _, src := range sources {
		var upto uint64
		if src == j.self {
			// Not the subject's last sequence as a read reports it: a
			// stream leader cut off from the others answers reads until
			// it learns it was replaced, with the messages it had (seen
			// right after a partition healed: a node taking back a
			// partition it had just lost read its journal only up to
			// before the cut and forgot a hot key's latest record). The
			// barrier's sequence comes from the current leader, and every
			// batch of p this node committed, one in flight when p changed
			// hands included, is below it.
			var err error
			if upto, err = j.barrier(ctx, p, gen); err != nil {
				return fmt.Errorf("appending a barrier to this node's journal: %w", err)
			}
		} else {
			msg := &nats.Msg{Subject: j.subjPre + src,
				Data: appendJournalFence(nil, journalFence{part: p, epoch: epoch, node: j.self})}
			ack, err := j.js.PublishMsg(ctx, msg)
			if err != nil {
				return fmt.Errorf("fencing the journal of %s: %w", src, err)
			}
			upto = ack.Sequence
		}
		states, err := j.readJournal(ctx, src, upto)
		if err != nil {
			return err
		}
		for k, st := range states {
			if partitionOf(k, j.n.cfg.Partitions) == p {
				latest[k] = st.val
				j.n.log.Debug("adopting a record", "partition", p, "key", k, "source", src, "seq", st.seq, "upto", upto)
			}
		}
	}
	var wg sync.WaitGroup
	var failed atomic.Value
	deadline := time.Now().Add(j.timeout)
	done := func(_ uint64, err error) {
		if err != nil {
			failed.CompareAndSwap(nil, err)
		}
		wg.Done()
	}
	writes := make([]*journalWrite, 0, len(latest))
	for k, val := range latest {
		writes = append(writes, &journalWrite{key: k, val: val, part: p, gen: gen, deadline: deadline, done: done})
	}
	wg.Add(len(writes))
	j.enqueue(writes...)
	wg.Wait()
	if err, _ := failed.Load().(error); err != nil {
		return fmt.Errorf("journalling the adopted records: %w", err)
	}
	// The floor needs the state bucket, which the adopted records do
	// not: without it (no stream leader yet) the partition is served, and
	// its first load writes the floor before it reads.
	j.mu.Lock()
	j.owned[p] = gen == j.gen[p]
	j.mu.Unlock()
	if err := j.claimFloor(ctx, p); err != nil {
		j.n.log.Debug("read floor not written yet", "partition", p, "error", err.Error())
	}
	j.n.log.Info("partition adopted", "partition", p, "from", sources, "records", len(latest))
	return nil
}

// marker appends to this node's journal a tenure marker of partition p (a
// fence naming this node) before it claims p with sources that do not
// include itself; a failure fails the claim.
//
// The marker ends what this node's journal says about p before it: a
// reader of the journal (readJournal) drops p's records from before the
// node's latest marker of p. Those are from an earlier tenure, which ended
// in a release (checkpointed, and the state bucket or a later owner's
// journal has newer records) or a loss (adopted by the next owner, which
// renewed: otherwise that owner would be a source of this claim, and so
// would this node). Without it, a node that lost p and claims it again
// would, if it fails before its adoption is done (or loses p again before
// its mark passes its first tenure's records), hand the next claimer a
// key's record from the first tenure, older than the one in the state
// bucket: a regression of the key's state, an overshoot. It is appended
// before the claim, not after: once the claim lands the node is a source
// of the next claimer, and a marker that failed after it left those old
// records in view (seen in TestFaultPartition).
//
// A claim whose sources include this node (it takes back a partition it
// lost before anyone finished adopting it) appends none: its records of p
// since its last marker are what it adopts.
func (j *journalStore) marker(ctx context.Context, p int, epoch uint64) error {
	ch := make(chan error, 1)
	j.mu.Lock()
	gen := j.gen[p]
	j.mu.Unlock()
	j.enqueue(&journalWrite{fence: &journalFence{part: p, epoch: epoch, node: j.self}, part: p, gen: gen,
		deadline: time.Now().Add(timeoutOf(ctx, j.timeout)), done: func(_ uint64, err error) { ch <- err }})
	select {
	case err := <-ch:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// barrier appends an empty batch to this node's journal through the
// writer (after every write queued before it) and returns its sequence;
// it fails if partition p's generation is no longer gen.
func (j *journalStore) barrier(ctx context.Context, p int, gen uint64) (uint64, error) {
	type res struct {
		seq uint64
		err error
	}
	ch := make(chan res, 1)
	j.enqueue(&journalWrite{barrier: true, part: p, gen: gen, deadline: time.Now().Add(timeoutOf(ctx, j.timeout)),
		done: func(rev uint64, err error) { ch <- res{rev & revSeqMask, err} }})
	select {
	case r := <-ch:
		return r.seq, r.err
	case <-ctx.Done():
		return 0, ctx.Err()
	}
}

// readJournal returns the latest record of every key in node id's journal
// from its mark up to sequence upto, reading on from an earlier read of the
// same journal when there is one. upto is a message of id's journal (a
// fence or barrier just appended): a read that does not get it was
// answered by a replica that lags, and fails, unless id's mark passed upto
// meanwhile (the messages up to it were checkpointed and purged).
func (j *journalStore) readJournal(ctx context.Context, id string, upto uint64) (map[string]journalState, error) {
	select {
	case j.readLock <- struct{}{}:
	case <-ctx.Done():
		return nil, fmt.Errorf("waiting to read the journal of %s: %w", id, ctx.Err())
	}
	defer func() { <-j.readLock }()
	r := j.reads[id]
	if r == nil {
		mark, err := j.markOf(ctx, id)
		if err != nil {
			return nil, err
		}
		r = &journalRead{next: mark + 1, states: make(map[string]journalState)}
	}
	from := r.next
	subj := j.subjPre + id
	err := j.readRange(ctx, subj, r.next, upto, func(seq uint64, data []byte) error {
		jm, err := decodeJournal(data)
		if err != nil {
			return fmt.Errorf("journal of %s, sequence %d: %w", id, seq, err)
		}
		for _, it := range jm.items {
			r.states[it.key] = journalState{val: it.val, seq: seq}
		}
		if f := jm.fence; f != nil && f.node == id {
			// id's tenure marker of f.part (see adopt): its records of
			// that partition before it are superseded.
			for k := range r.states {
				if partitionOf(k, j.n.cfg.Partitions) == f.part {
					delete(r.states, k)
				}
			}
		}
		return nil
	})
	if errors.Is(err, errReadIncomplete) {
		if mark, merr := j.markOf(ctx, id); merr == nil && mark >= upto {
			err = nil
		}
	}
	if err != nil {
		return nil, fmt.Errorf("reading the journal of %s: %w", id, err)
	}
	j.n.log.Debug("journal read", "node", id, "from", from, "upto", upto, "keys", len(r.states))
	r.next = max(r.next, upto+1)
	r.at = time.Now()
	if id != j.self {
		j.reads[id] = r
	}
	return r.states, nil
}

// readRangeDirect is how many messages readRange fetches one request at a
// time before it opens a consumer for the rest.
const readRangeDirect = 64

// readRange calls f for each message of subject subj with a sequence in
// [from, upto], in order; upto is a message of subj (a fence, or the
// subject's last message), so a complete read ends on it. A few messages
// are fetched one request each (leader reads); a longer range (a dead
// node's journal since its mark, under load up to tens of thousands of
// messages) through a consumer, which streams them, and leader reads
// again for whatever the consumer did not deliver:
//
//   - the server places the consumer on any replica of the stream, and a
//     lagging follower's consumer reports nothing pending before upto
//     (seen after a network partition healed: reading on from it would
//     miss a hot key's latest records, an overshoot);
//   - a consumer that cannot be made or fetched from (no stream leader, a
//     replica cut off) ends its part of the read early rather than retry;
//     the read as a whole is bounded by ctx. (nats.go's ordered consumer
//     retries its creation without end and without ctx: one adoption's
//     read held the read lock for minutes and no other could start.)
func (j *journalStore) readRange(ctx context.Context, subj string, from, upto uint64, f func(seq uint64, data []byte) error) error {
	seq, done, err := j.readRangeLeader(ctx, subj, from, upto, readRangeDirect, f)
	if done || err != nil {
		return err
	}
	consume := j.consumerRead
	if consume == nil {
		consume = j.readRangeConsumer
	}
	seq, done, err = consume(ctx, subj, seq, upto, f)
	switch {
	case done:
		return nil
	case ctx.Err() != nil:
		return ctx.Err()
	case err != nil && !errors.Is(err, errConsumerRead):
		return err // f failed
	case err != nil:
		j.n.log.Debug("journal read: consumer failed, reading on from the leader", "subject", subj, "error", err.Error())
	}
	_, _, err = j.readRangeLeader(ctx, subj, seq, upto, -1, f)
	return err
}

// errConsumerRead wraps the failures of readRangeConsumer's consumer
// (rather than of its f).
var errConsumerRead = errors.New("mesh: journal consumer")

// errReadIncomplete is the error of a read that ended before upto: the
// replica that answered does not have it (or it was purged).
var errReadIncomplete = errors.New("mesh: journal read ended before its last message")

// readRangeLeader reads subj's messages in [from, upto] one leader read
// each, at most limit of them (limit < 0: no limit). It returns the next
// sequence to read, and done once it read upto; a read that finds no
// message of subj from there to upto fails with errReadIncomplete (a
// stream leader cut off from the others answers until it learns it was
// replaced, with what it had then).
func (j *journalStore) readRangeLeader(ctx context.Context, subj string, from, upto uint64, limit int, f func(seq uint64, data []byte) error) (next uint64, done bool, err error) {
	seq := from
	for n := 0; limit < 0 || n < limit; n++ {
		if seq > upto {
			return seq, true, nil
		}
		// Each read is bounded on its own: one stalled by a stream
		// leader election fails fast, and the adoption is retried.
		rctx, cancel := context.WithTimeout(ctx, j.timeout)
		m, err := j.stream.GetMsg(rctx, seq, jetstream.WithGetMsgSubject(subj))
		cancel()
		if errors.Is(err, jetstream.ErrMsgNotFound) || err == nil && m.Sequence > upto {
			return seq, false, fmt.Errorf("%w: %s has no message from %d to %d", errReadIncomplete, subj, seq, upto)
		}
		if err != nil {
			return seq, false, err
		}
		if err := f(m.Sequence, m.Data); err != nil {
			return seq, false, err
		}
		seq = m.Sequence + 1
	}
	return seq, seq > upto, nil
}

// readRangeConsumer streams subj's messages from seq through an ephemeral
// consumer (in memory, one replica, no acknowledgements, deleted when
// done). done is true once it delivered upto; otherwise next is the first
// sequence it did not deliver: its replica had nothing more yet, or the
// consumer failed (err wraps errConsumerRead). Every call is bounded by
// ctx.
func (j *journalStore) readRangeConsumer(ctx context.Context, subj string, seq, upto uint64, f func(seq uint64, data []byte) error) (next uint64, done bool, err error) {
	cctx, cancel := context.WithTimeout(ctx, j.timeout)
	cons, err := j.stream.CreateConsumer(cctx, jetstream.ConsumerConfig{
		FilterSubject:     subj,
		DeliverPolicy:     jetstream.DeliverByStartSequencePolicy,
		OptStartSeq:       seq,
		AckPolicy:         jetstream.AckNonePolicy,
		MemoryStorage:     true,
		Replicas:          1,
		InactiveThreshold: 30 * time.Second,
	})
	cancel()
	if err != nil {
		return seq, false, fmt.Errorf("%w: %w", errConsumerRead, err)
	}
	defer func() {
		name := cons.CachedInfo().Name
		go func() {
			dctx, cancel := context.WithTimeout(context.Background(), j.timeout)
			_ = j.stream.DeleteConsumer(dctx, name)
			cancel()
		}()
	}()
	for {
		got, done, err := j.fetchRange(ctx, cons, &seq, upto, f)
		if done || err != nil {
			return seq, done, err
		}
		if got == 0 {
			return seq, false, nil // this replica has no more (yet)
		}
		if err := ctx.Err(); err != nil {
			return seq, false, err
		}
	}
}

// fetchRange is one fetch of readRangeConsumer (at most a second): it
// calls f for the messages it gets, up to upto, advancing *seq past each,
// and reports how many it got and whether upto was reached.
func (j *journalStore) fetchRange(ctx context.Context, cons jetstream.Consumer, seq *uint64, upto uint64, f func(seq uint64, data []byte) error) (got int, done bool, err error) {
	fctx, cancel := context.WithTimeout(ctx, min(time.Second, j.timeout))
	defer cancel()
	batch, err := cons.Fetch(1024, jetstream.FetchContext(fctx))
	if err != nil {
		return 0, false, fmt.Errorf("%w: %w", errConsumerRead, err)
	}
	for m := range batch.Messages() {
		got++
		meta, err := m.Metadata()
		if err != nil {
			return got, false, fmt.Errorf("%w: %w", errConsumerRead, err)
		}
		s := meta.Sequence.Stream
		if s > upto {
			return got, false, fmt.Errorf("%w: the consumer passed %d at %d", errReadIncomplete, upto, s)
		}
		if err := f(s, m.Data()); err != nil {
			return got, false, err
		}
		*seq = s + 1
		if s == upto {
			return got, true, nil
		}
	}
	if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) && !errors.Is(err, context.DeadlineExceeded) {
		return got, false, fmt.Errorf("%w: %w", errConsumerRead, err)
	}
	return got, false, nil
}

// expireReads forgets cached journal reads older than two leases.
func (j *journalStore) expireReads() {
	j.readLock <- struct{}{}
	defer func() { <-j.readLock }()
	for id, r := range j.reads {
		if time.Since(r.at) > 2*j.n.cfg.LeaseTime {
			delete(j.reads, id)
		}
	}
}

// ReadStateRecord returns the latest durable record of a limit key in the
// installation with subject prefix prefix: the newest one journalled after
// its node's mark and not superseded by that node's later tenure marker of
// the key's partition, else the state bucket's; an error wrapping
// kvstate.ErrNotFound when there is none. It scans the whole journal
// stream, for diagnostics and tests, not for deciding; a journal left by a
// node that stopped without handing its partitions over still counts.
func ReadStateRecord(ctx context.Context, js jetstream.JetStream, prefix, key string) ([]byte, error) {
	stream, err := js.Stream(ctx, strings.ToUpper(prefix)+"_JOURNAL")
	if err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, err
	}
	kv, err := js.KeyValue(ctx, prefix+"_state")
	if err != nil {
		return nil, err
	}
	var best []byte
	if stream != nil {
		// The key's partition, for the tenure markers (-1: the partition
		// count is unknown, markers are not applied).
		part := -1
		if skv, err := js.KeyValue(ctx, prefix+"_shards"); err == nil {
			if e, err := skv.Get(ctx, shardConfigKey); err == nil {
				var v shardConfigValue
				if json.Unmarshal(e.Value(), &v) == nil && v.Partitions > 0 {
					part = partitionOf(key, v.Partitions)
				}
			}
		}
		type rec struct {
			val []byte
			seq uint64
		}
		latest := make(map[string]rec) // per node
		marks := make(map[string]uint64)
		filter := journalSubjects(prefix) + "*"
		for seq := uint64(1); ; {
			m, err := stream.GetMsg(ctx, seq, jetstream.WithGetMsgSubject(filter))
			if errors.Is(err, jetstream.ErrMsgNotFound) {
				break
			}
			if err != nil {
				return nil, err
			}
			seq = m.Sequence + 1
			node := strings.TrimPrefix(m.Subject, journalSubjects(prefix))
			mark, ok := marks[node]
			if !ok {
				mark, _ = readMark(ctx, kv, node) // unreadable: 0, read it all
				marks[node] = mark
			}
			if m.Sequence <= mark {
				continue
			}
			jm, err := decodeJournal(m.Data)
			if err != nil {
				continue
			}
			if f := jm.fence; f != nil && f.node == node && f.part == part {
				delete(latest, node)
			}
			for _, it := range jm.items {
				if it.key == key {
					latest[node] = rec{it.val, m.Sequence}
				}
			}
		}
		var at uint64
		for _, r := range latest {
			if r.seq > at {
				best, at = r.val, r.seq
			}
		}
	}
	if best != nil {
		return best, nil
	}
	e, err := kv.Get(ctx, key)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return nil, fmt.Errorf("%w: %s", kvstate.ErrNotFound, key)
	}
	if err != nil {
		return nil, err
	}
	return e.Value(), nil
}
