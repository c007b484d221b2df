package sim

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/journal"
	"github.com/limitmesh/limitmesh/mesh/internal/keys"
	"github.com/limitmesh/limitmesh/mesh/internal/leasing"
	"github.com/limitmesh/limitmesh/mesh/internal/member"
	"github.com/limitmesh/limitmesh/mesh/internal/ownership"
	"github.com/limitmesh/limitmesh/mesh/internal/route"
	"github.com/limitmesh/limitmesh/mesh/internal/service"
)

// epoch is the Unix instant (ns) the simulation's global clock starts at.
const epoch = int64(1_780_000_000) * int64(time.Second)

// node is one simulated limitmesh node: a member (the production code) on
// a runtime of the simulation, whose clock drifts and is offset.
type node struct {
	sim  *Sim
	id   string
	life int  // incarnations: a crash ends one, a restart begins the next
	up   bool // running
	// drift is the rate error of its clock (ppm); offset the error of its
	// wall clock (ns).
	drift  int64
	offset int64
	// cut: the network between the node and the servers is down (its
	// requests and the watch's deliveries are lost).
	cut bool
	// stalled: the node's watch of the shards bucket delivers nothing
	// (its requests work), until the node watches anew.
	stalled bool
	// stale: the node's reads are answered by a leader cut off from its
	// cluster, with the streams as they were then (sequence per stream);
	// its writes are lost. nil: none.
	stale map[*stream]uint64
	// pausedUntil: the node's process is paused (a long garbage
	// collection, a stopped VM) until this global instant: its callbacks
	// wait, its clock runs on.
	pausedUntil int64

	m     *member.Member
	svc   *service.Service // the decide service (net.go)
	lease *leasing.Leasing // leased mode's holder and owner (leased.go)
	// subscribed: the shard subjects (by partition) the node subscribes
	// to: while its member holds the partition.
	subscribed []bool
	watch      []func() // watch deliveries held while cut
	unsent     []func() // requests published while cut, sent when it reconnects
	wnext      int64    // global instant of the last watch delivery scheduled
}

// local converts a global instant to the node's clock (ns since the start).
func (n *node) local(g int64) int64 { return g + g*n.drift/1_000_000 }

// wallAt is the node's wall clock (ns, Unix) at global instant g: what
// nodeRT.Now reads then.
func (n *node) wallAt(g int64) int64 { return epoch + n.offset + n.local(g) }

// global converts a duration on the node's clock to global ns.
func (n *node) global(d int64) int64 { return d * 1_000_000 / (1_000_000 + n.drift) }

// nodeRT is a node's rt.Runtime.
type nodeRT struct{ n *node }

func (r nodeRT) Now() time.Time {
	n := r.n
	return time.Unix(0, epoch+n.offset+n.local(n.sim.s.now))
}

func (r nodeRT) AfterFunc(d time.Duration, f func()) func() bool {
	stopped, fired := false, false
	r.n.sim.s.after(r.n.global(int64(max(d, 0))), r.n, func() {
		if stopped {
			return
		}
		fired = true
		f()
	})
	return func() bool {
		if fired || stopped {
			return false
		}
		stopped = true
		return true
	}
}

func (r nodeRT) Go(f func()) {
	// Another goroutine: it runs later, after whatever else is due now.
	r.n.sim.s.after(r.n.sim.s.between(0, 2_000), r.n, f)
}

// start begins a new incarnation of the node: a fresh member over the
// streams as they are (a restart reads where its journal ends and its
// mark), its watch (initial values, then updates) and its ticker.
func (n *node) start() {
	s := n.sim
	n.life++
	n.up = true
	n.cut = false
	n.stalled = false
	n.stale = nil
	n.pausedUntil = 0
	n.watch, n.unsent = nil, nil
	n.subscribed = make([]bool, s.cfg.Parts)
	rtm := nodeRT{n}
	rt := route.New("rl", s.cfg.Parts, rtm, rtm.Now())
	var m *member.Member
	subj := journal.Subjects("rl") + n.id
	var last, mark uint64
	if ms, ok := s.journal.lastOf(subj, s.journal.last()); ok {
		last = ms.seq
	}
	if v, _, ok := s.state.kvGet("_journal."+n.id, s.state.last()); ok {
		fmt.Sscan(string(v), &mark)
	}
	var log *slog.Logger
	if s.cfg.Debug {
		log = slog.New(slog.NewTextHandler(traceWriter{s, n.id}, &slog.HandlerOptions{Level: slog.LevelDebug,
			ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
				if a.Key == slog.TimeKey {
					return slog.Attr{}
				}
				return a
			}}))
	}
	j := journal.New(journal.Config{
		Self: n.id, Prefix: "rl", Parts: s.cfg.Parts,
		Stream: simStream{n}, Bucket: simBucket{n}, View: rt,
		OnFenced: func(p int, by string) { m.FencedBy(p, by) },
		Runtime:  rtm, Timeout: s.cfg.Timeout, CheckpointInterval: s.cfg.Checkpoint,
		ReadCache: 2 * s.cfg.Lease, Floors: true, Last: last, Mark: mark,
		Nonce: s.s.rng.Uint64() | 1, Log: log,
		Boot: "b" + strconv.Itoa(n.life), Usage: &simUsage{n: n, m: s.usage, last: map[string]usagePos{}},
		// As the node does (mesh/decide.go): adopted records with open
		// reservations are swept by their new owner.
		OnAdopted: func(key string, rec []byte) { n.svc.NoteRecord(key, rec) },
	})
	m = member.New(member.Config{
		Self: n.id, Lease: s.cfg.Lease, DecisionTimeout: s.cfg.Timeout, Runtime: rtm,
		Route: rt, Journal: j,
		Keys: keys.Config{Env: s.policies, MaxConflicts: 8, Log: log,
			OnReservations: func(policy, key string, open int, next int64) { n.svc.NoteReservations(policy, key, open, next) }},
		Shards:  simKV{n},
		OnServe: func(p int, held bool) { n.subscribed[p] = held },
		Log:     log,
	})
	n.m = m
	var err error
	n.lease, err = leasing.New(leasing.Config{
		Requests: simRequester{n}, Prefix: "rl", Self: n.id, Policies: s.policies, Keys: m.Keys, Route: rt,
		Runtime: rtm, Timeout: s.cfg.Timeout, Log: log,
	})
	if err != nil {
		panic(err) // metrics without a registerer: no error
	}
	n.svc = service.New(service.Config{
		Policies: s.policies, Keys: m.Keys, Route: rt, Runtime: rtm, DecisionTimeout: s.cfg.Timeout,
		Requests: simRequester{n}, Nonce: s.s.rng.Uint64, Usage: serviceUsage{s}, Leases: n.lease,
		Log: log, Metrics: s.svcMetrics,
	})
	m.Start()
	// The watch: every current entry, the end of the initial values, then
	// updates as they are written.
	n.wnext = s.s.now
	n.snapshot()
	s.watchers = append(s.watchers, n)
	// The ticker, every lease/15 of the node's clock; a watch that stopped
	// delivering is replaced (as ownership.Drive does).
	tick := time.Duration(int64(s.cfg.Lease) / 15)
	var loop func()
	loop = func() {
		m.Owner.Tick()
		if m.Owner.WatchStale() && !n.cut {
			s.logf("%s watches anew", n.id)
			n.stalled = false
			n.watch = nil
			n.snapshot()
		}
		rtm.AfterFunc(tick, loop)
	}
	rtm.AfterFunc(tick, loop)
	// Idle keys are swept (reloaded from the journal or the bucket).
	var sweep func()
	sweep = func() {
		m.Keys.Sweep(rtm.Now().UnixNano(), 2*s.cfg.Lease)
		rtm.AfterFunc(s.cfg.Lease, sweep)
	}
	rtm.AfterFunc(s.cfg.Lease, sweep)
	n.svc.StartSweeps(context.Background()) // they end with the incarnation
	if !s.cfg.NoLeased {
		n.lease.Holder.Start() // its ticks end with the incarnation
	}
}

// snapshot delivers what a new watch does: every entry's latest revision,
// then the end of the initial values.
func (n *node) snapshot() {
	for _, e := range n.sim.shardEntries() {
		n.deliverWatch(e)
	}
	n.deliverWatch(ownership.Entry{})
}

// crash ends the node's incarnation: its callbacks and timers are gone.
func (n *node) crash() {
	n.up = false
	n.m = nil
	s := n.sim
	s.watchers = slices.DeleteFunc(s.watchers, func(w *node) bool { return w == n })
}

// deliverWatch schedules the delivery of a watched entry (Key "": the end
// of the initial values), in order, after the watch's lag.
func (n *node) deliverWatch(e ownership.Entry) {
	s := n.sim
	deliver := func() {
		if n.m == nil {
			return
		}
		if e.Key == "" {
			n.m.Owner.Ready()
			return
		}
		n.m.Owner.Observe(e)
	}
	if n.cut || n.stalled {
		n.watch = append(n.watch, deliver)
		return
	}
	n.wnext = max(n.wnext, s.s.now+s.watchLag())
	s.s.at(n.wnext, n, deliver)
}

// heal reconnects the node: the held watch deliveries go out, in order.
func (n *node) heal() {
	n.cut, n.stalled = false, false
	unsent := n.unsent
	n.unsent = nil
	for _, send := range unsent {
		send()
	}
	held := n.watch
	n.watch = nil
	for _, d := range held {
		n.wnext = max(n.wnext, n.sim.s.now+n.sim.watchLag())
		n.sim.s.at(n.wnext, n, d)
	}
}

// errTimeout is what a request with no answer ends with (the stores wrap
// context.DeadlineExceeded).
var errTimeout = fmt.Errorf("sim: no answer in time: %w", context.DeadlineExceeded)

// request sends an operation to the servers: after a network delay it is
// applied to the world (atomically, unless the request is lost or the
// stream has no leader), and after another the answer comes back, unless
// it is lost; with no answer, fail is called at the timeout (node time).
// Exactly one of answer and fail runs, as a callback of the node.
func (n *node) request(st *stream, timeout time.Duration, write bool, apply func(view uint64) func(), fail func(error)) {
	s := n.sim
	life := n.life
	done := false
	finish := func(f func()) {
		if done || n.life != life {
			return
		}
		done = true
		f()
	}
	s.s.after(n.global(int64(max(timeout, time.Microsecond))), n, func() { finish(func() { fail(errTimeout) }) })
	if s.s.chance(s.cfg.Loss) {
		return
	}
	if n.cut {
		// The client is disconnected: nats.go keeps what it publishes
		// in its reconnect buffer and sends it once it reconnects, long
		// after its caller may have given up (half the time here; the
		// rest is lost: a buffer that overflowed, a reconnect that
		// failed).
		if s.s.chance(0.5) {
			n.unsent = append(n.unsent, func() { n.request2(st, life, write, apply, finish) })
		}
		return
	}
	n.request2(st, life, write, apply, finish)
}

// request2 is request's way to the servers and back: after a network
// delay the operation is applied to the world and its answer sent back,
// unless lost.
func (n *node) request2(st *stream, life int, write bool, apply func(view uint64) func(), finish func(func())) {
	s := n.sim
	s.s.after(s.netDelay(), nil, func() {
		if !n.up || n.life != life || n.cut || s.s.now < st.down {
			return
		}
		view := st.last()
		if v, ok := n.stale[st]; ok {
			if write {
				return // a cut-off leader commits nothing
			}
			view = min(view, v)
		}
		answer := apply(view)
		if s.s.chance(s.cfg.Loss) {
			return
		}
		s.s.after(s.netDelay(), n, func() { finish(answer) })
	})
}

var errConflict = errors.New("sim: wrong last sequence")

// simKV is the shards bucket (ownership.KV) of a node.
type simKV struct{ n *node }

func (k simKV) Update(key string, val []byte, rev uint64, timeout time.Duration, done func(uint64, error)) {
	st := k.n.sim.shards
	k.n.request(st, timeout, true, func(uint64) func() {
		if st.kvLastRev(key) != rev {
			return func() { done(0, fmt.Errorf("%w: %w", ownership.ErrConflict, errConflict)) }
		}
		r := k.n.sim.writeShard(key, val, false)
		return func() { done(r, nil) }
	}, func(err error) { done(0, err) })
}

func (k simKV) Delete(key string, rev uint64, timeout time.Duration, done func(error)) {
	st := k.n.sim.shards
	k.n.request(st, timeout, true, func(uint64) func() {
		if rev != 0 && st.kvLastRev(key) != rev {
			return func() { done(fmt.Errorf("%w: %w", ownership.ErrConflict, errConflict)) }
		}
		k.n.sim.writeShard(key, nil, true)
		return func() { done(nil) }
	}, done)
}

func (k simKV) Put(key string, val []byte, timeout time.Duration, done func(uint64, error)) {
	k.n.request(k.n.sim.shards, timeout, true, func(uint64) func() {
		r := k.n.sim.writeShard(key, val, false)
		return func() { done(r, nil) }
	}, func(err error) { done(0, err) })
}

func (k simKV) Get(key string, timeout time.Duration, done func(ownership.Entry, error)) {
	st := k.n.sim.shards
	k.n.request(st, timeout, false, func(view uint64) func() {
		v, rev, ok := st.kvGet(key, view)
		if !ok {
			return func() { done(ownership.Entry{}, ownership.ErrNotFound) }
		}
		return func() { done(ownership.Entry{Key: key, Value: v, Rev: rev}, nil) }
	}, func(err error) { done(ownership.Entry{}, err) })
}

// simBucket is the state bucket (journal.Bucket) of a node. It keeps
// every value until it is replaced (the simulation runs for less than any
// time to live: writes' TTLs are ignored).
type simBucket struct{ n *node }

func (b simBucket) GetAsync(key string, timeout time.Duration, done func([]byte, uint64, error)) {
	st := b.n.sim.state
	b.n.request(st, timeout, false, func(view uint64) func() {
		v, rev, ok := st.kvGet(key, view)
		if !ok {
			return func() { done(nil, rev, fmt.Errorf("%w: %s", kvstate.ErrNotFound, key)) }
		}
		return func() { done(v, rev, nil) }
	}, func(err error) { done(nil, 0, err) })
}

func (b simBucket) UpdateAsync(key string, val []byte, rev uint64, _, timeout time.Duration, done func(uint64, error)) {
	st := b.n.sim.state
	b.n.request(st, timeout, true, func(uint64) func() {
		if st.kvLastRev(key) != rev {
			return func() { done(0, fmt.Errorf("%w: %w", kvstate.ErrConflict, errConflict)) }
		}
		r := st.add(key, val, false)
		return func() { done(r, nil) }
	}, func(err error) { done(0, err) })
}

func (b simBucket) PutAsync(key string, val []byte, _, timeout time.Duration, done func(uint64, error)) {
	st := b.n.sim.state
	b.n.request(st, timeout, true, func(uint64) func() {
		r := st.add(key, val, false)
		return func() { done(r, nil) }
	}, func(err error) { done(0, err) })
}

// replica returns the sequence a direct get is answered at: a replica that
// may lag the leader (or the stale view of a node cut off with a leader).
func (b simBucket) replica(view uint64) uint64 {
	s := b.n.sim
	if s.s.chance(s.cfg.ReplicaLag) {
		return view - min(view, uint64(s.s.between(1, 5)))
	}
	return view
}

func (b simBucket) GetAsyncFloor(key, floorKey string, floor uint64, timeout time.Duration, done func([]byte, uint64, error)) {
	st := b.n.sim.state
	b.n.request(st, timeout, false, func(view uint64) func() {
		at := b.replica(view)
		if at < floor {
			return func() { done(nil, 0, fmt.Errorf("%w: replica at %d, floor %d", kvstate.ErrStale, at, floor)) }
		}
		v, rev, ok := st.kvGet(key, at)
		if !ok {
			return func() { done(nil, rev, fmt.Errorf("%w: %s", kvstate.ErrNotFound, key)) }
		}
		return func() { done(v, rev, nil) }
	}, func(err error) { done(nil, 0, err) })
}

func (b simBucket) GetManyAsyncFloor(ks []string, floorKey string, floor uint64, timeout time.Duration, done func([]kvstate.KeyRecord, error)) {
	st := b.n.sim.state
	b.n.request(st, timeout, false, func(view uint64) func() {
		at := b.replica(view)
		if at < floor {
			return func() { done(nil, fmt.Errorf("%w: replica at %d, floor %d", kvstate.ErrStale, at, floor)) }
		}
		recs := make([]kvstate.KeyRecord, len(ks))
		for i, k := range ks {
			v, rev, ok := st.kvGet(k, at)
			recs[i] = kvstate.KeyRecord{Value: v, Rev: rev, Live: ok}
		}
		return func() { done(recs, nil) }
	}, func(err error) { done(nil, err) })
}

// simStream is the journal stream (journal.Stream) of a node.
type simStream struct{ n *node }

func (j simStream) Append(subj string, data []byte, last uint64, _, timeout time.Duration, done func(uint64, error)) {
	st := j.n.sim.journal
	data = slices.Clone(data)
	j.n.request(st, timeout, true, func(uint64) func() {
		cur := uint64(0)
		if m, ok := st.lastOf(subj, st.last()); ok {
			cur = m.seq
		}
		if cur != last {
			return func() { done(0, errConflict) }
		}
		seq := j.n.sim.appendJournal(subj, data)
		return func() { done(seq, nil) }
	}, func(err error) { done(0, err) })
}

func (j simStream) Publish(subj string, data []byte, _, timeout time.Duration, done func(uint64, error)) {
	data = slices.Clone(data)
	j.n.request(j.n.sim.journal, timeout, true, func(uint64) func() {
		seq := j.n.sim.appendJournal(subj, data)
		return func() { done(seq, nil) }
	}, func(err error) { done(0, err) })
}

func (j simStream) Last(subj string, timeout time.Duration, done func(uint64, error)) {
	st := j.n.sim.journal
	j.n.request(st, timeout, false, func(view uint64) func() {
		m, ok := st.lastOf(subj, view)
		if !ok {
			return func() { done(0, nil) }
		}
		return func() { done(m.seq, nil) }
	}, func(err error) { done(0, err) })
}

func (j simStream) Read(subj string, from, upto uint64, timeout time.Duration, f func(uint64, []byte) error, done func(error)) {
	st := j.n.sim.journal
	if from > upto {
		j.n.sim.s.after(0, j.n, func() { done(nil) })
		return
	}
	// A range is read one leader read at a time, each bounded by the
	// decision timeout: a lost one fails the read after that long.
	j.n.request(st, min(timeout, j.n.sim.cfg.Timeout), false, func(view uint64) func() {
		msgs := st.from(subj, from, upto, view)
		complete := len(msgs) > 0 && msgs[len(msgs)-1].seq == upto
		return func() {
			for _, m := range msgs {
				if err := f(m.seq, m.data); err != nil {
					done(err)
					return
				}
			}
			if !complete {
				done(fmt.Errorf("%w: %s has no message up to %d", journal.ErrReadIncomplete, subj, upto))
				return
			}
			done(nil)
		}
	}, done)
}

func (j simStream) Purge(subj string, upto uint64, timeout time.Duration, done func(error)) {
	st := j.n.sim.journal
	j.n.request(st, timeout, true, func(uint64) func() {
		st.purged[subj] = max(st.purged[subj], upto)
		return func() { done(nil) }
	}, done)
}

// traceWriter puts a node's log lines into the trace.
type traceWriter struct {
	s  *Sim
	id string
}

func (w traceWriter) Write(p []byte) (int, error) {
	w.s.logf("%s: %s", w.id, strings.TrimSpace(string(p)))
	return len(p), nil
}
