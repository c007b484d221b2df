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
// dst. The array as publishers write it (no spaces, integers of at most
// 18 digits without leading zeros) is read in one loop; anything else
// takes the general path from where that loop stopped.
func (d *decoder) ints(at loc, dst []int64, signed bool) ([]int64, error) {
	d.ws()
	data, i := d.data, d.pos
	if i < len(data) && data[i] == '[' && i+1 < len(data) && data[i+1] != ']' {
		i++
		for len(dst) < maxGrouped {
			start := i
			neg := false
			if signed && i < len(data) && data[i] == '-' {
				neg = true
				i++
			}
			ds := i
			var v int64
			for i < len(data) && i-ds < 18 && data[i] >= '0' && data[i] <= '9' {
				v = v*10 + int64(data[i]-'0')
				i++
			}
			if i == ds || i-ds > 1 && data[ds] == '0' || neg && v == 0 || i == len(data) || data[i] != ',' && data[i] != ']' {
				i = start // not the plain form: the general path reads this element on
				break
			}
			if neg {
				v = -v
			}
			dst = append(dst, v)
			i++
			if data[i-1] == ']' {
				d.pos = i
				return dst, nil
			}
		}
		if len(dst) > 0 {
			// Continue the array from element len(dst) in the general form.
			d.pos = i
			return d.intsRest(at, dst, signed)
		}
	}
	return d.intsRest(at, dst[:0], signed)
}

// intsRest is ints' general path: from d.pos, the array's opening bracket
// when dst is empty, else the element after dst's last.
func (d *decoder) intsRest(at loc, dst []int64, signed bool) ([]int64, error) {
	elem := func() error {
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
	}
	if len(dst) > 0 {
		for {
			if len(dst) >= maxGrouped {
				return dst, fail(at, "has over "+strconv.Itoa(maxGrouped)+" elements")
			}
			if err := elem(); err != nil {
				return dst, err
			}
			switch d.peek() {
			case ',':
				d.pos++
			case ']':
				d.pos++
				return dst, nil
			default:
				return dst, fail(at, "unexpected input after an element")
			}
		}
	}
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

// keyLoc names group i of a grouped message.
func keyLoc(i int) loc { return loc{rec: -1, grp: i + 1} }

// group reads element i of "keys".
func (d *decoder) group(keysAt loc, i int) (rawGroup, error) {
	var rg rawGroup
	self := keyLoc(i)
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
			return fail(keyLoc(gi), "has no decision in order")
		}
	}
	groups := make([]KeyGroup, len(g.keys))
	for gi := range g.keys {
		rg := &g.keys[gi]
		at := keyLoc(gi)
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
	// The decisions, in batch order: their times, results and costs
	// make the groups' totals and spans.
	next := make([]int32, len(g.keys)) // per group: its next decision
	var want int64                     // the journalled decisions the runs name
	for r := 3; r < len(g.journal); r += 4 {
		want += max(0, g.journal[r])
	}
	journal := make([]journalled, 0, min(want, int64(n)))
	t := lo
	for i := 0; i < n; i++ {
		gi := g.order[i]
		rg, kg := &g.keys[gi], &groups[gi]
		k := next[gi]
		next[gi]++
		dt := g.dt[i]
		if dt > 0 && t > math.MaxInt64-dt || dt < 0 && t < math.MinInt64-dt {
			return fail(top.with("dt_us"), "entry "+strconv.Itoa(i)+" is out of range")
		}
		t += dt
		if t < lo || t > hi {
			return fail(top.with("dt_us"), "entry "+strconv.Itoa(i)+" puts a decision outside the batch's [t_us, t_us+span_us]")
		}
		cost := rg.cost
		if rg.costs != nil {
			cost = rg.costs[k]
		}
		switch c := rg.results[k]; c {
		case 'a', 'A':
			if kg.AllowedUnits > math.MaxInt64-cost {
				return fail(keyLoc(int(gi)), "allowed units overflow")
			}
			kg.Allowed++
			kg.AllowedUnits += cost
			kg.MaxAllowedUs = max(kg.MaxAllowedUs, t)
		case 'd', 'D':
			if kg.DeniedUnits > math.MaxInt64-cost {
				return fail(keyLoc(int(gi)), "denied units overflow")
			}
			kg.Denied++
			kg.DeniedUnits += cost
		default:
			return fail(keyLoc(int(gi)).with("results"), "has "+strconv.Quote(rg.results[k:k+1])+", not one of a, A, d, D")
		}
		if k == 0 {
			kg.MinUs, kg.MaxUs = t, t
		} else {
			kg.MinUs, kg.MaxUs = min(kg.MinUs, t), max(kg.MaxUs, t)
		}
		if rg.results[k] <= 'Z' {
			journal = append(journal, journalled{i: int32(i), group: int32(gi), tUs: t})
		}
	}
	for gi := range g.keys {
		rg, kg := &g.keys[gi], &groups[gi]
		if uint64(kg.Allowed) != rg.allowed || kg.AllowedUnits != rg.allowedU || uint64(kg.Denied) != rg.denied || kg.DeniedUnits != rg.deniedU {
			return fail(keyLoc(gi), "its totals disagree with its decisions")
		}
	}
	// Journal positions: the journalled decisions take the runs' in order.
	if len(g.journal)%4 != 0 {
		return fail(top.with("journal"), "is not runs of four numbers")
	}
	for _, o := range g.origins {
		if len(o)+24 > MaxIDLen {
			return fail(top.with("origins"), "has an origin over "+strconv.Itoa(MaxIDLen-24)+" bytes")
		}
	}
	run, left := 0, int64(0)
	var cur JournalPos
	var curO int32
	for j := range journal {
		for left == 0 {
			if run+4 > len(g.journal) {
				return fail(top.with("journal"), "has positions for fewer decisions than are journalled")
			}
			o, jseq, idx, cnt := g.journal[run], g.journal[run+1], g.journal[run+2], g.journal[run+3]
			run += 4
			if o >= int64(len(g.origins)) || cnt <= 0 || idx > math.MaxUint32 || cnt-1 > math.MaxUint32-idx {
				return fail(top.with("journal"), "run "+strconv.Itoa(run/4-1)+" is out of range")
			}
			curO, cur, left = int32(o), JournalPos{JSeq: uint64(jseq), Idx: uint32(idx)}, cnt
		}
		journal[j].origin, journal[j].pos = curO, cur
		cur.Idx++
		left--
	}
	if left != 0 || run != len(g.journal) {
		return fail(top.with("journal"), "has positions for more decisions than are journalled")
	}
	// Request ids and explicit ids: increasing indexes below n, explicit
	// ids only for decisions not journalled.
	for _, f := range []struct {
		name string
		list []indexed
	}{{"request_ids", g.requestIDs}, {"ids", g.ids}} {
		at := top.with(f.name)
		last := int64(-1)
		jn := 0
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
				continue
			}
			for jn < len(journal) && int64(journal[jn].i) < p.i {
				jn++
			}
			if jn < len(journal) && int64(journal[jn].i) == p.i {
				return fail(at, "names a journalled decision")
			}
			if err := checkID(at, p.v); err != nil {
				return err
			}
			if _, _, ok := ParseJournalID(p.v); ok {
				return fail(at, "has a journalled id (journalled decisions take their positions from \"journal\")")
			}
		}
	}
	b.Groups, b.journal, b.origins, b.raw = groups, journal, g.origins, g
	if d.noRecords {
		return nil
	}
	b.Records = g.records(b, !d.noIDs)
	return nil
}

// journalled is a journalled decision of a grouped message: its index in
// the batch, its group, time, origin (in the batch's origins) and
// position.
type journalled struct {
	i, group int32
	tUs      int64
	origin   int32
	pos      JournalPos
}

// records builds the records (the v1.1 view) of a grouped message that
// assemble checked; with ids, each gets its id.
func (g *groupedRaw) records(b *Batch, ids bool) []Record {
	n := int(g.n)
	recs := make([]Record, n)
	next := make([]int32, len(g.keys))
	t := int64(g.tUs)
	for i := range recs {
		gi := g.order[i]
		rg, kg := &g.keys[gi], &b.Groups[gi]
		k := next[gi]
		next[gi]++
		t += g.dt[i]
		r := &recs[i]
		r.TimeUs, r.Revision, r.Key, r.Descriptor = t, kg.Revision, kg.Key, kg.Descriptor
		r.Cost = rg.cost
		if rg.costs != nil {
			r.Cost = rg.costs[k]
		}
		r.Allowed = rg.results[k] == 'a' || rg.results[k] == 'A'
	}
	for _, p := range g.requestIDs {
		recs[p.i].RequestID = p.v
	}
	if ids {
		for _, p := range g.ids {
			recs[p.i].ID = p.v
		}
		deriveIDs(recs, b.journal, g.origins, g.batch)
	}
	return recs
}

// deriveIDs gives the records without an id theirs: <origin>.j<jseq>.<idx>
// for a journalled one, else <batch>.<i>, all of them substrings of one
// string.
func deriveIDs(recs []Record, journal []journalled, origins []string, batch string) {
	idLen := func(i, jn int) int {
		if jn < len(journal) && int(journal[jn].i) == i {
			j := &journal[jn]
			return len(origins[j.origin]) + 2 + digits(j.pos.JSeq) + 1 + digits(uint64(j.pos.Idx))
		}
		return len(batch) + 1 + digits(uint64(i))
	}
	size, jn := 0, 0
	for i := range recs {
		if recs[i].ID == "" {
			size += idLen(i, jn)
		}
		if jn < len(journal) && int(journal[jn].i) == i {
			jn++
		}
	}
	var sb strings.Builder
	sb.Grow(size)
	var num [24]byte
	jn = 0
	for i := range recs {
		isJ := jn < len(journal) && int(journal[jn].i) == i
		if recs[i].ID == "" {
			if isJ {
				j := &journal[jn]
				sb.WriteString(origins[j.origin])
				sb.WriteString(".j")
				sb.Write(strconv.AppendUint(num[:0], j.pos.JSeq, 10))
				sb.WriteByte('.')
				sb.Write(strconv.AppendUint(num[:0], uint64(j.pos.Idx), 10))
			} else {
				sb.WriteString(batch)
				sb.WriteByte('.')
				sb.Write(strconv.AppendInt(num[:0], int64(i), 10))
			}
		}
		if isJ {
			jn++
		}
	}
	all := sb.String()
	from := 0
	jn = 0
	for i := range recs {
		if recs[i].ID == "" {
			l := idLen(i, jn)
			recs[i].ID = all[from : from+l]
			from += l
		}
		if jn < len(journal) && int(journal[jn].i) == i {
			jn++
		}
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
