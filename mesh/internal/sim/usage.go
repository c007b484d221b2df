package sim

import (
	"fmt"
	"reflect"
	"strconv"
	"strings"

	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/usage"
)

// The usage model. Every admission of the run's policies (both strict) is
// journalled with the record write that spends it; the journal hands its
// usage to a sink (journal.UsageSink) when the write commits, and again,
// with the same position, whenever a node reads the journal. Here each
// node incarnation's sink is its publisher (usage.Publisher.AddJournal: a
// record at or below the last one it took of an origin is skipped), a
// publish is instant, and the usage stream is the order in which the
// publishers take records. The ledger's rule for journalled records
// (usage.ledgerCore) counts a record when its position is above its
// origin's watermark, which it then becomes; the check applies it as
// written here and also runs the stream through the ledger's own core
// (usage.Tally), whose totals must agree key by key. At the end of a run:
//
//	U1  every record in the stream is counted (it never first appears
//	    below its origin's watermark);
//	U2  every admission a client was told of is counted;
//	U3  no call is counted twice (under two positions), and none a client
//	    was told was denied.
//
// The publisher's real timing (acknowledgements, a death before
// publishing) is not modelled: what it covers is the order in which the
// journal offers records, across writers and readers of a journal. The
// stream is made of real usage messages: each publisher's consecutive
// records of a policy are cut into batches, written grouped by key
// (usage.EncodeGrouped, CONTRACT.md §6a) and read back with
// usage.DecodeBatch; the check reads the positions from the decoded
// records' ids.

// usagePos is a record's position: its journal message and index.
type usagePos struct {
	seq uint64
	idx uint32
}

func (a usagePos) less(b usagePos) bool { return a.seq < b.seq || a.seq == b.seq && a.idx < b.idx }

// usageRec is one published record.
type usageRec struct {
	origin string // <node>.<boot>
	pos    usagePos
	call   string // the client call it admitted (its "call" dimension)
	pub    string // the publisher: <node>.<boot> of the incarnation that published it
	policy string
	rec    usage.Record
	// As decoded from the stream: the record's key, cost (micro-units)
	// and the reservation it ends ("" none).
	key  string
	cost int64
	res  string
}

// usageModel is the usage stream of a run.
type usageModel struct {
	stream []usageRec
}

// simUsage is a node incarnation's usage sink and publisher.
type simUsage struct {
	n    *node
	m    *usageModel
	last map[string]usagePos // per origin, the last record taken
}

func (u *simUsage) Add(node, boot string, seq uint64, idx uint32, key string, record []byte, us *keyrec.Usage) {
	origin := node + "." + boot
	pos := usagePos{seq, idx}
	if last, ok := u.last[origin]; ok && !last.less(pos) {
		return
	}
	u.last[origin] = pos
	var call string
	for _, d := range us.Desc {
		if d.Name == "call" {
			call = d.Value
		}
	}
	policy, _, _ := keyrec.PeekPolicy(record)
	u.m.stream = append(u.m.stream, usageRec{origin: origin, pos: pos, call: call,
		pub: u.n.id + ".b" + strconv.Itoa(u.n.life), policy: policy,
		rec: usage.Record{ID: usage.JournalID(node, boot, seq, idx), TimeUs: us.At / 1000, Revision: us.Revision,
			Key: key, Descriptor: us.Desc, Cost: us.Cost, Allowed: true, RequestID: us.RequestID, Reservation: us.Reservation}})
	if u.n.sim.cfg.Debug {
		u.n.sim.logf("%s publishes %s.j%d.%d (call %s)", u.n.id, origin, seq, idx, call)
	}
}

// Sync implements journal.UsageSink: publishing is instant.
func (u *simUsage) Sync(done func(error)) { nodeRT{u.n}.Go(func() { done(nil) }) }

// check applies the ledger's rule to the stream and checks U1-U3 against
// the calls clients were told were admitted and denied; it returns the
// records the ledger counted.
func (m *usageModel) check(admitted, denied map[string]bool) ([]usageRec, error) {
	tally := usage.NewTally()
	stream, err := m.messages(tally)
	if err != nil {
		return nil, err
	}
	var out []usageRec
	type id struct {
		origin string
		pos    usagePos
	}
	marks := map[string]usagePos{}
	counted := map[id]bool{}
	times := map[string]int{}
	first := map[string]usageRec{} // per call, its first counted record
	for _, r := range stream {
		k := id{r.origin, r.pos}
		if w, ok := marks[r.origin]; ok && !w.less(r.pos) {
			if !counted[k] {
				return nil, fmt.Errorf("U1: record %s.j%d.%d (call %s) published after a later record of its origin was counted: in the stream, never in the ledger",
					r.origin, r.pos.seq, r.pos.idx, r.call)
			}
			continue
		}
		marks[r.origin] = r.pos
		counted[k] = true
		out = append(out, r)
		times[r.call]++
		if times[r.call] > 1 {
			if f := first[r.call]; r.res != "" && f.res == r.res {
				// rescheck.go: a reservation ends once.
				return nil, fmt.Errorf("R2: reservation %s (call %s) ended twice: counted at %s.j%d.%d and %s.j%d.%d (U3)",
					r.res, r.call, f.origin, f.pos.seq, f.pos.idx, r.origin, r.pos.seq, r.pos.idx)
			}
			return nil, fmt.Errorf("U3: call %s counted twice (the second at %s.j%d.%d)", r.call, r.origin, r.pos.seq, r.pos.idx)
		}
		first[r.call] = r
		if denied[r.call] {
			return nil, fmt.Errorf("U3: call %s counted (%s.j%d.%d), but its client was told it was denied", r.call, r.origin, r.pos.seq, r.pos.idx)
		}
	}
	// The ledger's own rule (usage.Tally: the reconciler's core) counts
	// what the rule above counts, key by key.
	type policyKey struct{ policy, key string }
	want := map[policyKey]int64{}
	var keys []policyKey
	for _, r := range out {
		if r.rec.Allowed {
			k := policyKey{r.policy, r.key}
			if want[k] == 0 {
				keys = append(keys, k)
			}
			want[k]++
		}
	}
	for _, k := range keys {
		if got := tally.Allowed(k.policy, k.key); got != want[k] {
			return nil, fmt.Errorf("U3: the ledger (usage.Tally) counted %d admissions of %s, the stream holds %d distinct ones", got, k.key, want[k])
		}
	}
	for call := range admitted {
		if times[call] == 0 {
			return nil, fmt.Errorf("U2: call %s was admitted but is not in the ledger", call)
		}
	}
	return out, nil
}

// callID names client call n in its descriptor.
func callID(n int) string { return strconv.Itoa(n) }

// messages returns the stream as the ledger reads it: each publisher's
// consecutive records of one policy cut into batches of 1 to 7 (sizes
// drawn from the records' positions, so a run replays exactly), each
// encoded grouped by key and decoded again, its records' origins and
// positions read from their ids.
func (m *usageModel) messages(tally *usage.Tally) ([]usageRec, error) {
	var out []usageRec
	var seq uint64
	for start := 0; start < len(m.stream); {
		first := m.stream[start]
		size := 1 + int(first.pos.seq+uint64(first.pos.idx))%7
		end := start + 1
		for end < len(m.stream) && end-start < size && m.stream[end].pub == first.pub && m.stream[end].policy == first.policy {
			end++
		}
		recs := make([]usage.Record, 0, end-start)
		for _, r := range m.stream[start:end] {
			recs = append(recs, r.rec)
		}
		data := usage.EncodeGrouped(first.pub[:strings.IndexByte(first.pub, '.')], first.policy, first.pub+"."+strconv.Itoa(start), recs)
		b, err := usage.DecodeBatch(data)
		if err != nil {
			return nil, fmt.Errorf("U1: the usage message of records %d..%d does not decode: %v: %s", start, end-1, err, data)
		}
		seq++
		tally.Apply(seq, &b)
		if len(b.Records) != end-start {
			return nil, fmt.Errorf("U1: the usage message of records %d..%d holds %d records", start, end-1, len(b.Records))
		}
		for i := range b.Records {
			if got, want := b.Records[i], m.stream[start+i].rec; !reflect.DeepEqual(got, want) {
				return nil, fmt.Errorf("U1: record %d published as %+v, decoded as %+v", start+i, want, got)
			}
			origin, pos, ok := usage.ParseJournalID(b.Records[i].ID)
			if !ok {
				return nil, fmt.Errorf("U1: record %d decoded with id %q, not a journalled id", start+i, b.Records[i].ID)
			}
			call, _ := b.Records[i].Descriptor.Get("call")
			out = append(out, usageRec{origin: origin, pos: usagePos{pos.JSeq, pos.Idx}, call: call, policy: first.policy, rec: b.Records[i],
				key: b.Records[i].Key, cost: b.Records[i].Cost, res: b.Records[i].Reservation})
		}
		start = end
	}
	return out, nil
}
