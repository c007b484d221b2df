package usage

import (
	"math"
	"strconv"
	"strings"

	"github.com/limitmesh/limitmesh/internal/wire"
	"github.com/limitmesh/limitmesh/policies"
)

// Records grouped by key (CONTRACT.md §6a; the exact shape is in
// docs/contract.md §6a). A message holds one batch of decisions of one
// policy in the order the publisher took them:
//
//	{"node":"n1","policy":"p","batch":"n1.<boot>.p.17","t_us":T,"span_us":S,"n":3,
//	 "keys":["tenant=a","tenant=b"],"revisions":[4,4],
//	 "allowed":[2,0],"allowed_units":[2,0],"denied":[0,1],"denied_units":[0,2.5],
//	 "costs":[1,2.5],"results":["aA","d"],
//	 "order":[0,1,0],"dt_us":[0,12,3],
//	 "origins":["n1.<boot>"],"journal":[0,8812,4,1],
//	 "request_ids":[[2,"7f1c2e"]],"reservations":[[1,"r.7.9f3c"]]}
//
// A group is one (key, revision, descriptor); its fields are columns, one
// entry per group. A key is written without "p.<policy>." (full_keys
// names one of another form); a descriptor only when the key does not
// carry it (policies.KeyCarries), in "descriptors" ([[g,{...}],...]).
// "costs" has a group's cost when all its decisions cost the same, else
// an array of them. "results" has a letter per decision of the group, in
// batch order: a (allowed), d (denied), upper case when the decision is
// journalled. "order" names each decision's group, "dt_us" its time minus
// the previous decision's (the first: minus t_us, the earliest time;
// every time lies in [t_us, t_us+span_us]). Journalled decisions take, in
// batch order, the positions of "journal": runs of four numbers (origin
// index, journal sequence, first index, count). Ids: a journalled
// decision's is <origin>.j<jseq>.<idx>, an ordinary one's <batch>.<i> (i
// its index in the batch) unless "ids" names it ([[i,"id"],...]).
// "request_ids" and "reservations" (the reservation a decision ends,
// CONTRACT.md §10; only such a decision may cost 0) are [[i,"value"],...]
// too, each present only when some decision has one.

// maxGroupedBytes is the most bytes a grouped message is made of (below
// NATS's default payload limit of 1 MiB, with room for headers). The
// publisher takes less when the server's limit is lower.
const maxGroupedBytes = 768 << 10

// maxBatchIDLen is the most bytes of a batch id: its ordinary record ids,
// <batch>.<i>, stay within MaxIDLen.
const maxBatchIDLen = MaxIDLen - 12

// groupEncoder writes grouped messages; one per sender, reused.
type groupEncoder struct {
	first   map[string]int32 // key -> its first group
	groups  []encGroup
	order   []int32 // per decision: its group
	sorted  []int32 // decisions by group, in batch order within a group
	origins map[originKey]int32
	olist   []originKey
}

// encGroup is one group being written.
type encGroup struct {
	r                 *Record // its first decision: key, revision, descriptor
	next              int32   // the next group of the same key; -1: none
	n, start, fill    int32   // decisions; where they start in sorted; the fill's cursor
	allowed, denied   int64   // decisions
	allowedU, deniedU int64   // micro-units
	cost              int64   // the first decision's
	uniform           bool    // every decision costs cost
}

// groupedGroupBytes is the fixed part of a group's JSON, a bound for the size
// estimate: field names, punctuation and numbers at their widest.
const groupedGroupBytes = 220

// groupedDecisionBytes bounds the bytes a decision adds outside its
// request_id and reservation: its group index, time delta, result letter,
// cost and a journal run of its own.
const groupedDecisionBytes = 100

// groupedPairBytes bounds an [i,"value"] pair's bytes outside its value.
const groupedPairBytes = 16

func (g *groupEncoder) reset() {
	if g.first == nil {
		g.first = make(map[string]int32)
		g.origins = make(map[originKey]int32)
	}
	clear(g.first)
	clear(g.origins)
	g.groups = g.groups[:0]
	g.order = g.order[:0]
	g.sorted = g.sorted[:0]
	g.olist = g.olist[:0]
}

// group returns the group of r, adding one when none fits (same key,
// revision and descriptor, and room in its unit sums).
func (g *groupEncoder) group(r *Record) int32 {
	gi, ok := g.first[r.Key]
	last := int32(-1)
	if ok {
		for i := gi; i >= 0; i = g.groups[i].next {
			e := &g.groups[i]
			last = i
			if e.r.Revision != r.Revision || !sameDescriptor(e.r.Descriptor, r.Descriptor) {
				continue
			}
			if r.Allowed && e.allowedU > math.MaxInt64-r.Cost || !r.Allowed && e.deniedU > math.MaxInt64-r.Cost {
				continue
			}
			return i
		}
	}
	ni := int32(len(g.groups))
	g.groups = append(g.groups, encGroup{r: r, next: -1, cost: r.Cost, uniform: true})
	if last >= 0 {
		g.groups[last].next = ni
	} else {
		g.first[r.Key] = ni
	}
	return ni
}

func sameDescriptor(a, b policies.Descriptor) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// groupBytes bounds the JSON of a new group of r.
func groupBytes(r *Record) int {
	n := groupedGroupBytes + 6*len(r.Key)
	for _, d := range r.Descriptor {
		n += 6 + 6*len(d.Name) + 6*len(d.Value)
	}
	return n
}

// encode writes the grouped message of the first entries of es (at most
// maxN, and no more than maxBytes unless one decision alone is more) and
// returns it with the number of decisions it holds (at least 1 when es is
// not empty). batch is the message's Nats-Msg-Id.
func (g *groupEncoder) encode(dst []byte, node, policy, batch string, es []entry, maxN, maxBytes int) ([]byte, int) {
	g.reset()
	est := 300 + 2*len(node) + len(policy) + len(batch)
	n := 0
	var tMin, tMax int64
	for n < len(es) && n < maxN {
		r := &es[n].r
		add := groupedDecisionBytes + 6*len(r.RequestID) + 6*len(r.ID) + 6*len(es[n].node) + 6*len(es[n].boot)
		if r.Reservation != "" {
			add += groupedPairBytes + 6*len(r.Reservation)
		}
		if n > 0 && est+add+groupBytes(r) > maxBytes {
			break
		}
		gi := g.group(r)
		e := &g.groups[gi]
		if e.n == 0 {
			add += groupBytes(r)
		}
		est += add
		e.n++
		if r.Cost != e.cost {
			e.uniform = false
		}
		if r.Allowed {
			e.allowed++
			e.allowedU += r.Cost
		} else {
			e.denied++
			e.deniedU += r.Cost
		}
		if n == 0 || r.TimeUs < tMin {
			tMin = r.TimeUs
		}
		if n == 0 || r.TimeUs > tMax {
			tMax = r.TimeUs
		}
		g.order = append(g.order, gi)
		n++
	}
	// Decisions by group: offsets, then a stable fill.
	var off int32
	for i := range g.groups {
		g.groups[i].start, g.groups[i].fill = off, off
		off += g.groups[i].n
	}
	g.sorted = append(g.sorted[:0], make([]int32, n)...)
	for i, gi := range g.order {
		e := &g.groups[gi]
		g.sorted[e.fill] = int32(i)
		e.fill++
	}

	dst = append(dst, `{"node":`...)
	dst = wire.AppendString(dst, node)
	dst = append(dst, `,"policy":`...)
	dst = wire.AppendString(dst, policy)
	dst = append(dst, `,"batch":`...)
	dst = wire.AppendString(dst, batch)
	dst = append(dst, `,"t_us":`...)
	dst = strconv.AppendInt(dst, tMin, 10)
	dst = append(dst, `,"span_us":`...)
	dst = strconv.AppendInt(dst, tMax-tMin, 10)
	dst = append(dst, `,"n":`...)
	dst = strconv.AppendInt(dst, int64(n), 10)
	// The groups, one column per field.
	column := func(name string, item func(e *encGroup) []byte) {
		dst = append(dst, `,"`...)
		dst = append(dst, name...)
		dst = append(dst, `":[`...)
		for gi := range g.groups {
			if gi > 0 {
				dst = append(dst, ',')
			}
			dst = item(&g.groups[gi])
		}
		dst = append(dst, ']')
	}
	column("keys", func(e *encGroup) []byte {
		suffix, _ := keySuffix(e.r.Key, policy)
		return wire.AppendString(dst, suffix)
	})
	column("revisions", func(e *encGroup) []byte { return strconv.AppendUint(dst, e.r.Revision, 10) })
	column("allowed", func(e *encGroup) []byte { return strconv.AppendInt(dst, e.allowed, 10) })
	column("allowed_units", func(e *encGroup) []byte { return wire.AppendUnits(dst, e.allowedU) })
	column("denied", func(e *encGroup) []byte { return strconv.AppendInt(dst, e.denied, 10) })
	column("denied_units", func(e *encGroup) []byte { return wire.AppendUnits(dst, e.deniedU) })
	column("costs", func(e *encGroup) []byte {
		if e.uniform {
			return wire.AppendUnits(dst, e.cost)
		}
		dst = append(dst, '[')
		for i, di := range g.sorted[e.start : e.start+e.n] {
			if i > 0 {
				dst = append(dst, ',')
			}
			dst = wire.AppendUnits(dst, es[di].r.Cost)
		}
		return append(dst, ']')
	})
	column("results", func(e *encGroup) []byte {
		dst = append(dst, '"')
		for _, di := range g.sorted[e.start : e.start+e.n] {
			c := byte('d')
			if es[di].r.Allowed {
				c = 'a'
			}
			if es[di].node != "" {
				c -= 'a' - 'A'
			}
			dst = append(dst, c)
		}
		return append(dst, '"')
	})
	// Keys not of the form p.<policy>[.suffix] (none of a node's).
	first := true
	for gi := range g.groups {
		if _, ok := keySuffix(g.groups[gi].r.Key, policy); ok {
			continue
		}
		if first {
			dst = append(dst, `,"full_keys":[`...)
			first = false
		} else {
			dst = append(dst, ',')
		}
		dst = append(dst, '[')
		dst = strconv.AppendInt(dst, int64(gi), 10)
		dst = append(dst, ',')
		dst = wire.AppendString(dst, g.groups[gi].r.Key)
		dst = append(dst, ']')
	}
	if !first {
		dst = append(dst, ']')
	}
	// Descriptors the keys do not carry.
	first = true
	for gi := range g.groups {
		e := &g.groups[gi]
		if policy != "" && policies.KeyCarries(e.r.Key, policy, e.r.Descriptor) {
			continue
		}
		if first {
			dst = append(dst, `,"descriptors":[`...)
			first = false
		} else {
			dst = append(dst, ',')
		}
		dst = append(dst, '[')
		dst = strconv.AppendInt(dst, int64(gi), 10)
		dst = append(dst, `,{`...)
		for i, d := range e.r.Descriptor {
			if i > 0 {
				dst = append(dst, ',')
			}
			dst = wire.AppendString(dst, d.Name)
			dst = append(dst, ':')
			dst = wire.AppendString(dst, d.Value)
		}
		dst = append(dst, "}]"...)
	}
	if !first {
		dst = append(dst, ']')
	}
	dst = append(dst, `,"order":[`...)
	for i, gi := range g.order {
		if i > 0 {
			dst = append(dst, ',')
		}
		dst = strconv.AppendInt(dst, int64(gi), 10)
	}
	dst = append(dst, `],"dt_us":[`...)
	prev := tMin
	for i := 0; i < n; i++ {
		if i > 0 {
			dst = append(dst, ',')
		}
		t := es[i].r.TimeUs
		dst = strconv.AppendInt(dst, t-prev, 10)
		prev = t
	}
	dst = append(dst, ']')
	dst = g.appendJournal(dst, es[:n])
	dst = appendIndexed(dst, `,"request_ids":[`, es[:n], func(e *entry) string { return e.r.RequestID })
	dst = appendIndexed(dst, `,"reservations":[`, es[:n], func(e *entry) string { return e.r.Reservation })
	dst = appendIndexed(dst, `,"ids":[`, es[:n], func(e *entry) string {
		if e.node != "" {
			return ""
		}
		return e.r.ID
	})
	return append(dst, '}'), n
}

// appendJournal writes "origins" and "journal" when some decision of es
// is journalled.
func (g *groupEncoder) appendJournal(dst []byte, es []entry) []byte {
	type run struct {
		o          int32
		jseq       uint64
		idx, count uint64
	}
	var (
		runs []run
		last originKey
		lo   int32 = -1
	)
	for i := range es {
		e := &es[i]
		if e.node == "" {
			continue
		}
		k := originKey{e.node, e.boot}
		if lo < 0 || k != last {
			oi, ok := g.origins[k]
			if !ok {
				oi = int32(len(g.olist))
				g.olist = append(g.olist, k)
				g.origins[k] = oi
			}
			last, lo = k, oi
		}
		if n := len(runs); n > 0 {
			r := &runs[n-1]
			if r.o == lo && r.jseq == e.pos.JSeq && r.idx+r.count == uint64(e.pos.Idx) {
				r.count++
				continue
			}
		}
		runs = append(runs, run{lo, e.pos.JSeq, uint64(e.pos.Idx), 1})
	}
	if len(runs) == 0 {
		return dst
	}
	dst = append(dst, `,"origins":[`...)
	for i, o := range g.olist {
		if i > 0 {
			dst = append(dst, ',')
		}
		dst = wire.AppendString(dst, o.node+"."+o.boot)
	}
	dst = append(dst, `],"journal":[`...)
	for i, r := range runs {
		if i > 0 {
			dst = append(dst, ',')
		}
		dst = strconv.AppendInt(dst, int64(r.o), 10)
		dst = append(dst, ',')
		dst = strconv.AppendUint(dst, r.jseq, 10)
		dst = append(dst, ',')
		dst = strconv.AppendUint(dst, r.idx, 10)
		dst = append(dst, ',')
		dst = strconv.AppendUint(dst, r.count, 10)
	}
	return append(dst, ']')
}

// appendIndexed writes field (its name and '[' included) as pairs
// [i, "value"] for the decisions whose value is not "", or nothing when
// none has one.
func appendIndexed(dst []byte, field string, es []entry, value func(*entry) string) []byte {
	any := false
	for i := range es {
		v := value(&es[i])
		if v == "" {
			continue
		}
		if !any {
			dst = append(dst, field...)
			any = true
		} else {
			dst = append(dst, ',')
		}
		dst = append(dst, '[')
		dst = strconv.AppendInt(dst, int64(i), 10)
		dst = append(dst, ',')
		dst = wire.AppendString(dst, v)
		dst = append(dst, ']')
	}
	if any {
		dst = append(dst, ']')
	}
	return dst
}

// EncodeGrouped returns the grouped message (CONTRACT.md §6a) of records,
// published by node as batch (its Nats-Msg-Id) for policy, all of them in
// one message. A record whose ID is a journalled id (ParseJournalID) is
// written as journalled, one whose ID is "" gets <batch>.<i>, any other ID
// is kept. It is the publisher's encoding, for tests and tools.
func EncodeGrouped(node, policy, batch string, records []Record) []byte {
	es := make([]entry, len(records))
	for i, r := range records {
		es[i].r = r
		if origin, pos, ok := ParseJournalID(r.ID); ok {
			if j := strings.LastIndexByte(origin, '.'); j > 0 {
				es[i].node, es[i].boot, es[i].pos = origin[:j], origin[j+1:], pos
				es[i].r.ID = ""
			}
		}
	}
	var g groupEncoder
	out, _ := g.encode(nil, node, policy, batch, es, len(es), math.MaxInt)
	return out
}

// keySuffix is key as a grouped message of policy writes it in "keys":
// without "p.<policy>." ("" for the key "p.<policy>" itself); the keys of
// policy "" as they are. ok is false for a key of another form (then
// "keys" has "" and "full_keys" the key).
func keySuffix(key, policy string) (string, bool) {
	if policy == "" {
		return key, true
	}
	if len(key) < len(policy)+2 || key[:2] != "p." || key[2:2+len(policy)] != policy {
		return "", false
	}
	rest := key[2+len(policy):]
	switch {
	case rest == "":
		return "", true
	case rest[0] == '.' && len(rest) > 1:
		return rest[1:], true
	}
	return "", false
}

// fullKey reverses keySuffix.
func fullKey(suffix, policy string) string {
	switch {
	case policy == "":
		return suffix
	case suffix == "":
		return "p." + policy
	}
	return "p." + policy + "." + suffix
}
