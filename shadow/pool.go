package shadow

import (
	"slices"
	"strings"

	"github.com/limitmesh/limitmesh/policies"
	"github.com/limitmesh/limitmesh/usage"
)

// pool runs an evaluation on several goroutines. Candidates are
// independent, so the pool splits them over workers, each with a [Replay]
// of its own holding some of them, and every worker applies every batch
// to its Replay in stream order: the counts are those of one Replay
// holding all the candidates. A candidate stays with the worker it was
// given to (the one with the fewest candidates then) until it is dropped.
// The state is read, and the candidates changed, only while every worker
// is paused at the same point of the stream ([pool.paused]).
//
// A pool is used by one goroutine; its workers run until stop.
type pool struct {
	workers []*worker
	owner   map[string]int // candidate -> worker
}

type worker struct {
	r     *Replay
	in    chan poolJob
	count int // candidates it holds
}

// poolJob is a batch to apply or, when pause is set, a pause: the worker
// signals pause and waits for resume to close.
type poolJob struct {
	recs   []usage.Record
	pause  chan<- struct{}
	resume <-chan struct{}
}

// newPool starts n workers (at least 1).
func newPool(n int, opt Options) *pool {
	p := &pool{owner: map[string]int{}}
	for range max(n, 1) {
		w := &worker{r: NewReplay(opt), in: make(chan poolJob, 64)}
		p.workers = append(p.workers, w)
		go w.run()
	}
	return p
}

func (w *worker) run() {
	for j := range w.in {
		if j.pause != nil {
			j.pause <- struct{}{}
			<-j.resume
			continue
		}
		for i := range j.recs {
			w.r.Apply(&j.recs[i])
		}
	}
}

// apply hands a batch's records to every worker; they must not change
// until the workers are paused next.
func (p *pool) apply(recs []usage.Record) {
	for _, w := range p.workers {
		w.in <- poolJob{recs: recs}
	}
}

// paused runs fn once every worker has applied everything handed to it
// and waits; the workers go on when fn returns.
func (p *pool) paused(fn func()) {
	ack := make(chan struct{}, len(p.workers))
	resume := make(chan struct{})
	for _, w := range p.workers {
		w.in <- poolJob{pause: ack, resume: resume}
	}
	for range p.workers {
		<-ack
	}
	defer close(resume)
	fn()
}

// empty reports whether there are no candidates (the caller's goroutine
// is the one that sets them).
func (p *pool) empty() bool { return len(p.owner) == 0 }

// stop ends the workers.
func (p *pool) stop() {
	for _, w := range p.workers {
		close(w.in)
	}
}

// setCandidates makes ps the candidates (see [Replay.SetCandidates]).
func (p *pool) setCandidates(ps []*policies.Policy) {
	p.paused(func() {
		parts := make([][]*policies.Policy, len(p.workers))
		owner := map[string]int{}
		for _, w := range p.workers {
			w.count = 0
		}
		for _, c := range ps {
			if i, ok := p.owner[c.Name]; ok {
				owner[c.Name] = i
				p.workers[i].count++
			}
		}
		for _, c := range ps {
			i, ok := owner[c.Name]
			if !ok {
				i = 0
				for j, w := range p.workers {
					if w.count < p.workers[i].count {
						i = j
					}
				}
				owner[c.Name] = i
				p.workers[i].count++
			}
			parts[i] = append(parts[i], c)
		}
		for i, w := range p.workers {
			w.r.SetCandidates(parts[i])
		}
		p.owner = owner
	})
}

// summaries returns every candidate's summary, by name.
func (p *pool) summaries() []Summary {
	out := []Summary{}
	p.paused(func() {
		for _, w := range p.workers {
			out = append(out, w.r.Summaries()...)
		}
	})
	slices.SortFunc(out, func(a, b Summary) int { return strings.Compare(a.Policy, b.Policy) })
	return out
}

// appendCheckpoint appends the checkpoint of all the candidates (the
// workers' Replays in one) and returns their summaries as of it.
func (p *pool) appendCheckpoint(dst []byte, seq uint64) ([]byte, []Summary) {
	var sums []Summary
	p.paused(func() {
		rs := make([]*Replay, len(p.workers))
		for i, w := range p.workers {
			rs[i] = w.r
			sums = append(sums, w.r.Summaries()...)
		}
		dst = appendCheckpoint(dst, seq, rs...)
	})
	return dst, sums
}

// restore loads a checkpoint (see [Replay.Restore]) into every worker's
// candidates.
func (p *pool) restore(b []byte) (CheckpointInfo, error) {
	var (
		info CheckpointInfo
		err  error
	)
	p.paused(func() {
		for _, w := range p.workers {
			var i CheckpointInfo
			if i, err = w.r.Restore(b); err != nil {
				return
			}
			info.Seq, info.Candidates = i.Seq, i.Candidates
			info.Restored += i.Restored
		}
	})
	return info, err
}

// candidates returns the candidates' policies.
func (p *pool) candidates() []*policies.Policy {
	var out []*policies.Policy
	p.paused(func() {
		for _, w := range p.workers {
			out = append(out, candidatesOf(w.r)...)
		}
	})
	return out
}
