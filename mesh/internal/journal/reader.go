package journal

import (
	"errors"
	"fmt"

	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"sync"
	"time"
)

// The reader: what a node's journal says of the keys it journalled since
// its mark. A read goes from the node's mark (or where an earlier read of
// the same journal ended) up to a message of that journal just appended
// (a fence or a barrier), so a read that does not reach it was answered by
// a replica that lags, and fails, unless the node's mark passed it
// meanwhile (the messages up to it were checkpointed and purged). A
// node's tenure marker of a partition drops that partition's earlier
// records of the node (invariant J2). A read may go on from where an
// earlier read of the same journal ended, while the source's mark has not
// reached that point (invariant J8). Reads go one at a time; a read
// waiting longer than its timeout fails.

// state is a key's latest record in a journal and the message holding it.
type state struct {
	val []byte
	seq uint64
}

// sourceRead is what was read of a node's journal (kept for adoptions of
// several partitions from the same node).
type sourceRead struct {
	next   uint64 // the next sequence to read
	at     time.Time
	states map[string]state
}

type readRequest struct {
	id       string
	upto     uint64
	deadline time.Time
	done     func(map[string]state, uint64, error)
	taken    bool // started or failed (r.mu)
	markRev  uint64
}

type reader struct {
	j *Journal

	mu    sync.Mutex
	busy  bool
	queue []*readRequest
	cache map[string]*sourceRead
}

// read returns the latest record of every key in node id's journal from
// its mark up to sequence upto, and the highest revision the read found
// the mark at (every write of the node to the state bucket before that
// mark is at or below it: J17). The map is the reader's: done must take
// what it needs before it returns.
func (r *reader) read(id string, upto uint64, timeout time.Duration, done func(states map[string]state, markRev uint64, err error)) {
	req := &readRequest{id: id, upto: upto, deadline: r.j.now().Add(timeout), done: done}
	r.mu.Lock()
	r.queue = append(r.queue, req)
	r.mu.Unlock()
	r.j.rt.AfterFunc(timeout, func() {
		r.mu.Lock()
		if req.taken {
			r.mu.Unlock()
			return
		}
		req.taken = true
		r.mu.Unlock()
		done(nil, 0, fmt.Errorf("waiting to read the journal of %s: %w", id, errWaitTimeout))
	})
	r.pump()
}

var errWaitTimeout = errors.New("timed out behind other journal reads")

// pump starts the next queued read unless one is running.
func (r *reader) pump() {
	r.mu.Lock()
	if r.busy {
		r.mu.Unlock()
		return
	}
	var req *readRequest
	for len(r.queue) > 0 && req == nil {
		if !r.queue[0].taken {
			req = r.queue[0]
			req.taken = true
		}
		r.queue = r.queue[1:]
	}
	if req == nil {
		r.mu.Unlock()
		return
	}
	r.busy = true
	cached := r.cache[req.id]
	r.mu.Unlock()
	finish := func(states map[string]state, err error) {
		req.done(states, req.markRev, err)
		r.mu.Lock()
		r.busy = false
		r.mu.Unlock()
		r.pump()
	}
	r.j.ck.markOf(req.id, r.j.opTimeout(req.deadline), func(mark, rev uint64, err error) {
		req.markRev = max(req.markRev, rev)
		if err != nil {
			finish(nil, fmt.Errorf("reading the journal mark of %s: %w", req.id, err))
			return
		}
		// An earlier read goes on where it ended, unless the source's mark
		// reached that point since: the messages after it may be purged,
		// and with them a tenure marker or a newer record (now in the
		// state bucket) that supersede what the earlier read holds.
		if cached == nil || mark >= cached.next {
			cached = &sourceRead{next: mark + 1, states: make(map[string]state)}
		}
		r.run(req, cached, finish)
	})
}

// run reads req's journal into sr from sr.next up to req.upto.
func (r *reader) run(req *readRequest, sr *sourceRead, finish func(map[string]state, error)) {
	j := r.j
	from := sr.next
	apply := func(seq uint64, data []byte) error {
		m, err := decode(data)
		if err != nil {
			return fmt.Errorf("journal of %s, sequence %d: %w", req.id, seq, err)
		}
		var idx uint32
		for _, it := range m.items {
			sr.states[it.key] = state{val: it.val, seq: seq}
			if sink := j.cfg.Usage; sink != nil && len(it.usageB) > 0 {
				// The usage journalled with the record: published again
				// (its id is the message's: the ledger counts it once),
				// in case its writer could not publish it.
				us, err := keyrec.DecodeUsage(it.usageB)
				if err != nil {
					j.log.Warn("corrupt usage in a journal message", "node", req.id, "seq", seq, "error", err.Error())
				}
				for i := range us {
					sink.Add(req.id, m.boot, seq, idx, it.key, it.val, &us[i])
					idx++
				}
			}
		}
		if f := m.fence; f != nil && f.node == req.id {
			// req.id's tenure marker of f.part: its records of that
			// partition before it are superseded.
			for k := range sr.states {
				if j.partOf(k) == f.part {
					delete(sr.states, k)
				}
			}
		}
		return nil
	}
	end := func(err error) {
		if err != nil {
			finish(nil, fmt.Errorf("reading the journal of %s: %w", req.id, err))
			return
		}
		j.log.Debug("journal read", "node", req.id, "from", from, "upto", req.upto, "keys", len(sr.states))
		sr.next = max(sr.next, req.upto+1)
		sr.at = j.now()
		if req.id != j.cfg.Self {
			r.mu.Lock()
			r.cache[req.id] = sr
			r.mu.Unlock()
		}
		finish(sr.states, nil)
	}
	if sr.next > req.upto {
		end(nil)
		return
	}
	j.cfg.Stream.Read(j.subjOf(req.id), sr.next, req.upto, j.until(req.deadline), apply, func(err error) {
		if !errors.Is(err, ErrReadIncomplete) {
			end(err)
			return
		}
		j.ck.markOf(req.id, j.opTimeout(req.deadline), func(mark, rev uint64, merr error) {
			req.markRev = max(req.markRev, rev)
			if merr == nil && mark >= req.upto {
				err = nil
			}
			end(err)
		})
	})
}

// expire forgets cached reads older than the read cache time.
func (r *reader) expire() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for id, sr := range r.cache {
		if r.j.now().Sub(sr.at) > r.j.cfg.ReadCache {
			delete(r.cache, id)
		}
	}
}
