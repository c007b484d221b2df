package usage

import (
	"errors"
	"math"
	"strconv"
	"strings"

	"github.com/limitmesh/limitmesh/policies"
)

// KeyGroup is one group of a grouped message (CONTRACT.md §6a): the
// decisions of one limit key, revision and descriptor, with their totals
// and the span of their times. The ledger applies a group's totals at
// once.
type KeyGroup struct {
	Key          string
	Revision     uint64
	Descriptor   policies.Descriptor
	Allowed      int64 // allowed decisions
	AllowedUnits int64 // their cost, micro-units
	Denied       int64
	DeniedUnits  int64
	MinUs, MaxUs int64 // the earliest and latest decision's t_us
	MaxAllowedUs int64 // the latest allowed decision's t_us; -1: none
}

// groupedRaw is a grouped message's fields as read, before they are
// checked against each other.
type groupedRaw struct {
	seen        uint16
	batch       string
	tUs, spanUs uint64
	n           uint64
	keys        []rawGroup
	order       []int64
	dt          []int64
	origins     []string
	journal     []int64
	requestIDs  []indexed
	ids         []indexed
}

// capHint is the capacity for a per-decision array: n when it came
// first (as publishers write it), within bounds.
func (g *groupedRaw) capHint() int {
	if g.seen&gN != 0 {
		return int(g.n)
	}
	return 64
}

// rawGroup is one element of "keys" as read.
type rawGroup struct {
	key               string
	revision          uint64
	desc              []policies.Dim // its descriptor as read (a slab's part); nil: left out
	allowed, denied   uint64
	allowedU, deniedU int64
	cost              int64 // "cost"; 0: "costs" given
	costs             []int64
	results           string
}

// indexed is one [i, "value"] pair.
type indexed struct {
	i int64
	v string
}

const (
	gBatch = 1 << iota
	gTime
	gSpan
	gN
	gKeys
	gOrder
	gDt
	gOrigins
	gJournal
	gRequestIDs
	gIDs
	gRequired = gBatch | gTime | gSpan | gN | gKeys | gOrder | gDt
)

var groupedNames = [...]string{"batch", "t_us", "span_us", "n", "keys", "order", "dt_us", "origins", "journal", "request_ids", "ids"}

// maxGrouped bounds the decisions of one grouped message (far above what
// a publisher writes: MaxBatch and the message size bound it).
const maxGrouped = 1 << 20

// groupedField reads top-level field name of a grouped message into g;
// known is false for a name that is no such field.
func (d *decoder) groupedField(name string, g *groupedRaw) (known bool, err error) {
	bit := -1
	for i, n := range groupedNames {
		if n == name {
			bit = i
			break
		}
	}
	if bit < 0 {
		return false, nil
	}
	at := top.with(name)
	if g.seen&(1<<bit) != 0 {
		return true, fail(at, "given twice")
	}
	g.seen |= 1 << bit
	switch 1 << bit {
	case gBatch:
		if g.batch, err = d.str(at); err == nil {
			err = checkID(at, g.batch)
			if err == nil && len(g.batch) > maxBatchIDLen {
				err = fail(at, "is "+strconv.Itoa(len(g.batch))+" bytes (at most "+strconv.Itoa(maxBatchIDLen)+")")
			}
		}
	case gTime:
		g.tUs, err = d.uint(at)
	case gSpan:
		g.spanUs, err = d.uint(at)
	case gN:
		if g.n, err = d.uint(at); err == nil && g.n > maxGrouped {
			err = fail(at, "is over "+strconv.Itoa(maxGrouped))
		}
	case gKeys:
		err = d.array(at, func(i int) error {
			rg, err := d.group(at, i)
			g.keys = append(g.keys, rg)
			return err
		})
	case gOrder:
		g.order, err = d.ints(at, make([]int64, 0, g.capHint()), false)
	case gDt:
		g.dt, err = d.ints(at, make([]int64, 0, g.capHint()), true)
	case gOrigins:
		err = d.array(at, func(int) error {
			s, err := d.str(at)
			if err == nil {
				err = checkID(at, s)
			}
			g.origins = append(g.origins, s)
			return err
		})
	case gJournal:
		g.journal, err = d.ints(at, g.journal[:0], false)
	case gRequestIDs:
		g.requestIDs, err = d.pairs(at, g.requestIDs[:0])
	case gIDs:
		g.ids, err = d.pairs(at, g.ids[:0])
	}
	return true, err
}

// array reads a JSON array, calling elem for each element.
func (d *decoder) array(at loc, elem func(i int) error) error {
	if err := d.expect('[', at); err != nil {
		return err
	}
	if d.peek() == ']' {
		d.pos++
		return nil
	}
	for i := 0; ; i++ {
		if i >= maxGrouped {
			return fail(at, "has over "+strconv.Itoa(maxGrouped)+" elements")
		}
		if err := elem(i); err != nil {
			return err
		}
		switch d.peek() {
		case ',':
			d.pos++
		case ']':
			d.pos++
			return nil
		default:
			return fail(at, "unexpected input after an element")
		}
	}
}

// ints reads an array of integers (negative ones too when signed) into
// dst.
func (d *decoder) ints(at loc, dst []int64, signed bool) ([]int64, error) {
	err := d.array(at, func(int) error {
		neg := false
		if signed && d.peek() == '-' {
			neg = true
			d.pos++
		}
		u, err := d.uint(at)
		if err != nil {
			return err
		}
		if u > math.MaxInt64 {
			return fail(at, "has a number out of range")
		}
		v := int64(u)
		if neg {
			if v == 0 {
				return fail(at, `has "-0"`)
			}
			v = -v
		}
		dst = append(dst, v)
		return nil
	})
	return dst, err
}

// pairs reads an array of [i, "string"] pairs into dst.
func (d *decoder) pairs(at loc, dst []indexed) ([]indexed, error) {
	err := d.array(at, func(int) error {
		if err := d.expect('[', at); err != nil {
			return err
		}
		i, err := d.uint(at)
		if err != nil {
			return err
		}
		if err := d.expect(',', at); err != nil {
			return err
		}
		s, err := d.str(at)
		if err != nil {
			return err
		}
		if i > maxGrouped {
			return fail(at, "has an index out of range")
		}
		dst = append(dst, indexed{int64(i), s})
		return d.expect(']', at)
	})
	return dst, err
}

// group reads element i of "keys".
func (d *decoder) group(keysAt loc, i int) (rawGroup, error) {
	var rg rawGroup
	self := loc{rec: -1, field: "keys[" + strconv.Itoa(i) + "]"}
	var seen uint16
	const (
		kKey = 1 << iota
		kRevision
		kDescriptor
		kAllowed
		kAllowedUnits
		kDenied
		kDeniedUnits
		kCost
		kCosts
		kResults
	)
	err := d.object(self, func(name string) (bool, error) {
		var bit uint16
		switch name {
		case "key":
			bit = kKey
		case "revision":
			bit = kRevision
		case "descriptor":
			bit = kDescriptor
		case "allowed":
			bit = kAllowed
		case "allowed_units":
			bit = kAllowedUnits
		case "denied":
			bit = kDenied
		case "denied_units":
			bit = kDeniedUnits
		case "cost":
			bit = kCost
		case "costs":
			bit = kCosts
		case "results":
			bit = kResults
		default:
			return false, nil
		}
		at := self.with(name)
		if seen&bit != 0 {
			return true, fail(at, "given twice")
		}
		seen |= bit
		var err error
		switch bit {
		case kKey:
			if rg.key, err = d.str(at); err == nil {
				err = checkKey(at, rg.key)
			}
		case kRevision:
			rg.revision, err = d.uint(at)
		case kDescriptor:
			var start, n int
			if start, n, err = d.descriptor(at); err == nil {
				rg.desc = d.dims[start : start+n : start+n]
				if rg.desc == nil {
					rg.desc = []policies.Dim{}
				}
			}
		case kAllowed:
			rg.allowed, err = d.uint(at)
		case kDenied:
			rg.denied, err = d.uint(at)
		case kAllowedUnits, kDeniedUnits:
			var s string
			if s, err = d.str(at); err == nil {
				var v int64
				if v, err = parseUnits(at, s); err == nil {
					if bit == kAllowedUnits {
						rg.allowedU = v
					} else {
						rg.deniedU = v
					}
				}
			}
		case kCost:
			var text string
			if text, err = d.number(at); err == nil {
				rg.cost, err = parseCost(at, text)
			}
		case kCosts:
			err = d.array(at, func(int) error {
				text, err := d.number(at)
				if err != nil {
					return err
				}
				c, err := parseCost(at, text)
				rg.costs = append(rg.costs, c)
				return err
			})
		case kResults:
			rg.results, err = d.str(at)
		}
		return true, err
	})
	if err != nil {
		return rg, err
	}
	switch {
	case seen&kKey == 0:
		return rg, fail(self.with("key"), "missing")
	case seen&kRevision == 0:
		return rg, fail(self.with("revision"), "missing")
	case seen&kResults == 0:
		return rg, fail(self.with("results"), "missing")
	case seen&(kCost|kCosts) == 0:
		return rg, fail(self.with("cost"), `missing (or "costs")`)
	case seen&kCost != 0 && seen&kCosts != 0:
		return rg, fail(self.with("costs"), `given with "cost"`)
	case seen&kAllowed != 0 != (seen&kAllowedUnits != 0):
		return rg, fail(self.with("allowed_units"), `given without "allowed" or missing`)
	case seen&kDenied != 0 != (seen&kDeniedUnits != 0):
		return rg, fail(self.with("denied_units"), `given without "denied" or missing`)
	}
	return rg, nil
}

// parseUnits parses a total's decimal string: >= 0, at most 6 fractional
// digits, at most MaxInt64 micro-units.
func parseUnits(at loc, s string) (int64, error) {
	bad := func() (int64, error) {
		return 0, fail(at, strconv.Quote(s)+" is not a decimal >= 0 with at most 6 fractional digits")
	}
	i := 0
	var whole uint64
	for i < len(s) && s[i] >= '0' && s[i] <= '9' {
		if whole > (math.MaxInt64/1_000_000)/10+1 {
			return bad()
		}
		whole = whole*10 + uint64(s[i]-'0')
		i++
	}
	if i == 0 || i > 1 && s[0] == '0' {
		return bad()
	}
	var frac uint64
	scale := uint64(1_000_000)
	if i < len(s) {
		if s[i] != '.' || i+1 == len(s) || len(s)-i-1 > 6 {
			return bad()
		}
		for j := i + 1; j < len(s); j++ {
			if s[j] < '0' || s[j] > '9' {
				return bad()
			}
			frac = frac*10 + uint64(s[j]-'0')
			scale /= 10
		}
		if s[len(s)-1] == '0' {
			return bad() // written with the digits it needs
		}
	}
	if whole > math.MaxInt64/1_000_000 {
		return bad()
	}
	v := whole*1_000_000 + frac*scale
	if v > math.MaxInt64 {
		return bad()
	}
	return int64(v), nil
}

// assemble checks a grouped message's fields against each other and
// builds b's records (the v1.1 view, CONTRACT.md §6) and groups.
func (d *decoder) assemble(b *Batch, g *groupedRaw) error {
	if missing := gRequired &^ g.seen; missing != 0 {
		for i, n := range groupedNames {
			if missing&(1<<i) != 0 {
				return fail(top.with(n), "missing")
			}
		}
	}
	if g.seen&gOrigins != 0 != (g.seen&gJournal != 0) {
		return fail(top.with("journal"), `"origins" and "journal" go together`)
	}
	n := int(g.n)
	if len(g.order) != n {
		return fail(top.with("order"), "has "+strconv.Itoa(len(g.order))+" entries, n is "+strconv.Itoa(n))
	}
	if len(g.dt) != n {
		return fail(top.with("dt_us"), "has "+strconv.Itoa(len(g.dt))+" entries, n is "+strconv.Itoa(n))
	}
	if g.tUs > math.MaxInt64 || g.spanUs > math.MaxInt64-g.tUs {
		return fail(top.with("span_us"), "is out of range")
	}
	lo, hi := int64(g.tUs), int64(g.tUs+g.spanUs)
	// Per group: its decisions, counted from "order".
	counts := make([]int, len(g.keys))
	for i, gi := range g.order {
		if gi < 0 || gi >= int64(len(g.keys)) {
			return fail(top.with("order"), "entry "+strconv.Itoa(i)+" names group "+strconv.FormatInt(gi, 10)+" of "+strconv.Itoa(len(g.keys)))
		}
		counts[gi]++
	}
	for gi, c := range counts {
		if c == 0 {
			return fail(loc{rec: -1, field: "keys[" + strconv.Itoa(gi) + "]"}, "has no decision in order")
		}
	}
	groups := make([]KeyGroup, len(g.keys))
	for gi := range g.keys {
		rg := &g.keys[gi]
		at := loc{rec: -1, field: "keys[" + strconv.Itoa(gi) + "]"}
		if len(rg.results) != counts[gi] {
			return fail(at.with("results"), "has "+strconv.Itoa(len(rg.results))+" letters for "+strconv.Itoa(counts[gi])+" decisions")
		}
		if rg.costs != nil && len(rg.costs) != counts[gi] {
			return fail(at.with("costs"), "has "+strconv.Itoa(len(rg.costs))+" costs for "+strconv.Itoa(counts[gi])+" decisions")
		}
		switch {
		case b.Policy == "" && rg.key != "":
			return fail(at.with("key"), `must be "" in a batch of policy ""`)
		case b.Policy != "" && rg.key == "":
			return fail(at.with("key"), "is empty")
		}
		kg := &groups[gi]
		kg.Key, kg.Revision, kg.MaxAllowedUs = rg.key, rg.revision, -1
		if rg.desc != nil {
			desc, err := policies.NewDescriptor(rg.desc)
			if err != nil {
				var pe *policies.Error
				if errors.As(err, &pe) {
					return fail(at.with(pe.Path), pe.Reason)
				}
				return fail(at.with("descriptor"), err.Error())
			}
			kg.Descriptor = desc
		} else {
			desc, ok := policies.DescriptorOfKey(rg.key, b.Policy)
			if !ok {
				return fail(at.with("descriptor"), "missing, and the key does not carry it")
			}
			kg.Descriptor = desc
		}
	}
	// The decisions, in batch order.
	recs := make([]Record, n)
	groupOf := make([]int32, n)
	next := make([]int, len(g.keys)) // per group: its next decision
	jo := make([]int32, n)
	jp := make([]JournalPos, n)
	journalled := 0
	t := lo
	for i := 0; i < n; i++ {
		gi := g.order[i]
		rg, kg := &g.keys[gi], &groups[gi]
		k := next[gi]
		next[gi]++
		if g.dt[i] > 0 && t > math.MaxInt64-g.dt[i] || g.dt[i] < 0 && t < math.MinInt64-g.dt[i] {
			return fail(top.with("dt_us"), "entry "+strconv.Itoa(i)+" is out of range")
		}
		t += g.dt[i]
		if t < lo || t > hi {
			return fail(top.with("dt_us"), "entry "+strconv.Itoa(i)+" puts a decision outside the batch's [t_us, t_us+span_us]")
		}
		r := &recs[i]
		r.TimeUs, r.Revision, r.Key, r.Descriptor = t, kg.Revision, kg.Key, kg.Descriptor
		r.Cost = rg.cost
		if rg.costs != nil {
			r.Cost = rg.costs[k]
		}
		switch rg.results[k] {
		case 'a', 'A':
			r.Allowed = true
			kg.Allowed++
			if kg.AllowedUnits > math.MaxInt64-r.Cost {
				return fail(loc{rec: -1, field: "keys[" + strconv.Itoa(int(gi)) + "]"}, "allowed units overflow")
			}
			kg.AllowedUnits += r.Cost
			kg.MaxAllowedUs = max(kg.MaxAllowedUs, t)
		case 'd', 'D':
			kg.Denied++
			if kg.DeniedUnits > math.MaxInt64-r.Cost {
				return fail(loc{rec: -1, field: "keys[" + strconv.Itoa(int(gi)) + "]"}, "denied units overflow")
			}
			kg.DeniedUnits += r.Cost
		default:
			return fail(loc{rec: -1, field: "keys[" + strconv.Itoa(int(gi)) + "]", sub: "results"}, "has "+strconv.Quote(rg.results[k:k+1])+", not one of a, A, d, D")
		}
		if k == 0 {
			kg.MinUs, kg.MaxUs = t, t
		} else {
			kg.MinUs, kg.MaxUs = min(kg.MinUs, t), max(kg.MaxUs, t)
		}
		jo[i] = -1
		if rg.results[k] <= 'Z' {
			jo[i] = 0 // journalled: its position is filled below
			journalled++
		}
		groupOf[i] = int32(gi)
	}
	for gi := range g.keys {
		rg, kg := &g.keys[gi], &groups[gi]
		at := loc{rec: -1, field: "keys[" + strconv.Itoa(gi) + "]"}
		if uint64(kg.Allowed) != rg.allowed || kg.AllowedUnits != rg.allowedU || uint64(kg.Denied) != rg.denied || kg.DeniedUnits != rg.deniedU {
			return fail(at, "its totals disagree with its decisions")
		}
	}
	// Journal positions, in batch order.
	if len(g.journal)%4 != 0 {
		return fail(top.with("journal"), "is not runs of four numbers")
	}
	run, left := 0, int64(0)
	var cur JournalPos
	var curO int32
	for i := 0; i < n; i++ {
		if jo[i] < 0 {
			continue
		}
		for left == 0 {
			if run+4 > len(g.journal) {
				return fail(top.with("journal"), "has positions for fewer decisions than are journalled")
			}
			o, jseq, idx, cnt := g.journal[run], g.journal[run+1], g.journal[run+2], g.journal[run+3]
			run += 4
			if o >= int64(len(g.origins)) || cnt <= 0 || idx+cnt-1 > math.MaxUint32 {
				return fail(top.with("journal"), "run "+strconv.Itoa(run/4-1)+" is out of range")
			}
			curO, cur, left = int32(o), JournalPos{JSeq: uint64(jseq), Idx: uint32(idx)}, cnt
		}
		jo[i], jp[i] = curO, cur
		cur.Idx++
		left--
	}
	if left != 0 || run != len(g.journal) {
		return fail(top.with("journal"), "has positions for more decisions than are journalled")
	}
	for _, o := range g.origins {
		if len(o)+24 > MaxIDLen {
			return fail(top.with("origins"), "has an origin over "+strconv.Itoa(MaxIDLen-24)+" bytes")
		}
	}
	// Request ids and explicit ids: increasing indexes below n.
	for _, f := range []struct {
		name string
		list []indexed
	}{{"request_ids", g.requestIDs}, {"ids", g.ids}} {
		at := top.with(f.name)
		last := int64(-1)
		for _, p := range f.list {
			if p.i <= last || p.i >= int64(n) {
				return fail(at, "index "+strconv.FormatInt(p.i, 10)+" is out of order or range")
			}
			last = p.i
			if f.name == "request_ids" {
				if len(p.v) > MaxRequestIDLen {
					return fail(at, "has one of "+strconv.Itoa(len(p.v))+" bytes (at most 128)")
				}
				if reason := printable(p.v); reason != "" || p.v == "" {
					return fail(at, "has one that "+reason)
				}
				recs[p.i].RequestID = p.v
			} else {
				if jo[p.i] >= 0 {
					return fail(at, "names a journalled decision")
				}
				if err := checkID(at, p.v); err != nil {
					return err
				}
				if _, _, ok := ParseJournalID(p.v); ok {
					return fail(at, "has a journalled id (journalled decisions take their positions from \"journal\")")
				}
				recs[p.i].ID = p.v
			}
		}
	}
	if !d.noIDs {
		deriveIDs(recs, jo, jp, g.origins, g.batch)
	}
	b.Records, b.Groups, b.groupOf = recs, groups, groupOf
	b.jOrigin, b.jPos, b.origins = jo, jp, g.origins
	if journalled == 0 {
		b.jOrigin = nil
	}
	return nil
}

// deriveIDs gives the records without an id theirs: <origin>.j<jseq>.<idx>
// for a journalled one (jo[i] >= 0), else <batch>.<i>, all of them
// substrings of one string.
func deriveIDs(recs []Record, jo []int32, jp []JournalPos, origins []string, batch string) {
	size := 0
	for i := range recs {
		switch {
		case recs[i].ID != "":
		case jo[i] >= 0:
			size += len(origins[jo[i]]) + 24
		default:
			size += len(batch) + 8
		}
	}
	var sb strings.Builder
	sb.Grow(size)
	var num [24]byte
	for i := range recs {
		switch {
		case recs[i].ID != "":
		case jo[i] >= 0:
			sb.WriteString(origins[jo[i]])
			sb.WriteString(".j")
			sb.Write(strconv.AppendUint(num[:0], jp[i].JSeq, 10))
			sb.WriteByte('.')
			sb.Write(strconv.AppendUint(num[:0], uint64(jp[i].Idx), 10))
		default:
			sb.WriteString(batch)
			sb.WriteByte('.')
			sb.Write(strconv.AppendInt(num[:0], int64(i), 10))
		}
	}
	ids := sb.String()
	from := 0
	for i := range recs {
		if recs[i].ID != "" {
			continue
		}
		var n int
		if jo[i] >= 0 {
			n = len(origins[jo[i]]) + 2 + digits(jp[i].JSeq) + 1 + digits(uint64(jp[i].Idx))
		} else {
			n = len(batch) + 1 + digits(uint64(i))
		}
		recs[i].ID = ids[from : from+n]
		from += n
	}
}

// digits returns the number of decimal digits of v.
func digits(v uint64) int {
	n := 1
	for v >= 10 {
		v /= 10
		n++
	}
	return n
}
