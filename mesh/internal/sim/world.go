package sim

import (
	"slices"
	"sort"
)

// The simulated JetStream: streams as append-only logs with a global
// sequence each, per-subject last sequences, purges, and views of a
// stream as it was at an earlier sequence (what a replica that lags, or a
// leader cut off from its cluster, answers). Operations are applied
// atomically when a request arrives (network.go carries them).

// msg is one stored message.
type msg struct {
	seq     uint64
	subj    string
	data    []byte
	deleted bool // a KV delete marker
}

// stream is one simulated stream.
type stream struct {
	name   string
	msgs   []msg               // msgs[i].seq == i+1
	bySubj map[string][]uint64 // ascending sequences of each subject's messages
	purged map[string]uint64   // a subject's messages below this sequence are gone
	down   int64               // until this global instant no leader answers (an election)
}

func newStream(name string) *stream {
	return &stream{name: name, bySubj: map[string][]uint64{}, purged: map[string]uint64{}}
}

func (s *stream) last() uint64 { return uint64(len(s.msgs)) }

func (s *stream) add(subj string, data []byte, deleted bool) uint64 {
	seq := s.last() + 1
	s.msgs = append(s.msgs, msg{seq: seq, subj: subj, data: slices.Clone(data), deleted: deleted})
	s.bySubj[subj] = append(s.bySubj[subj], seq)
	return seq
}

// lastOf returns subj's last message at view (0: none), counting purges.
func (s *stream) lastOf(subj string, view uint64) (msg, bool) {
	seqs := s.bySubj[subj]
	i := sort.Search(len(seqs), func(i int) bool { return seqs[i] > view })
	if i == 0 || seqs[i-1] < s.purged[subj] {
		return msg{}, false
	}
	return s.msgs[seqs[i-1]-1], true
}

// from returns subj's messages with sequences in [from, upto] present at
// view.
func (s *stream) from(subj string, from, upto, view uint64) []msg {
	seqs := s.bySubj[subj]
	lo := max(from, s.purged[subj])
	i := sort.Search(len(seqs), func(i int) bool { return seqs[i] >= lo })
	var out []msg
	for ; i < len(seqs) && seqs[i] <= upto && seqs[i] <= view; i++ {
		out = append(out, s.msgs[seqs[i]-1])
	}
	return out
}

// kvGet is a KV read of key at view: the value and revision, or (nil,
// the marker's revision or 0, false) when absent.
func (s *stream) kvGet(key string, view uint64) ([]byte, uint64, bool) {
	m, ok := s.lastOf(key, view)
	switch {
	case !ok:
		return nil, 0, false
	case m.deleted:
		return nil, m.seq, false
	}
	return m.data, m.seq, true
}

// kvLastRev is the revision a compare-and-swap of key must expect now.
func (s *stream) kvLastRev(key string) uint64 {
	m, ok := s.lastOf(key, s.last())
	if !ok {
		return 0
	}
	return m.seq
}
