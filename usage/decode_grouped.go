package usage

import (
	"errors"
	"math"
	"strconv"
	"strings"
	"unicode/utf8"

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
	seen        uint32
	batch       string
	tUs, spanUs uint64
	n           uint64
	keys        []rawGroup // built from the columns by columns()
	order       []int64
	dt          []int64
	origins     []string
	journal     []int64
	requestIDs  []indexed
	ids         []indexed
	reserv      []indexed // "reservations"

	// The groups' columns, as read.
	keyCol            []string
	revisions         []int64
	allowed, denied   []int64
	allowedU, deniedU []int64
	costs             []rawCost
	results           []string
	descriptors       []rawDesc
	fullKeys          []indexed
}

// rawCost is a group's entry of "costs": one cost for all its decisions,
// or one each (per non-nil).
type rawCost struct {
	one int64
	per []int64
}

// rawDesc is an entry of "descriptors": group g's descriptor (a slab's
// part).
type rawDesc struct {
	g    int64
	dims []policies.Dim
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
	gRevisions
	gAllowed
	gAllowedUnits
	gDenied
	gDeniedUnits
	gCosts
	gResults
	gDescriptors
	gFullKeys
	gReservations
	gRequired = gBatch | gTime | gSpan | gN | gKeys | gOrder | gDt | gRevisions | gAllowed | gAllowedUnits | gDenied | gDeniedUnits | gCosts | gResults
)

var groupedNames = [...]string{"batch", "t_us", "span_us", "n", "keys", "order", "dt_us", "origins", "journal", "request_ids", "ids",
	"revisions", "allowed", "allowed_units", "denied", "denied_units", "costs", "results", "descriptors", "full_keys", "reservations"}

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
		err = d.array(at, func(int) error {
			k, err := d.str(at)
			g.keyCol = append(g.keyCol, k)
			return err
		})
	case gRevisions:
		g.revisions, err = d.ints(at, nil, false)
	case gAllowed:
		g.allowed, err = d.ints(at, nil, false)
	case gDenied:
		g.denied, err = d.ints(at, nil, false)
	case gAllowedUnits:
		g.allowedU, err = d.units(at, nil)
	case gDeniedUnits:
		g.deniedU, err = d.units(at, nil)
	case gCosts:
		err = d.array(at, func(int) error {
			var c rawCost
			var err error
			if d.peek() == '[' {
				err = d.array(at, func(int) error {
					v, err := d.cost(at)
					c.per = append(c.per, v)
					return err
				})
				if err == nil && c.per == nil {
					err = fail(at, "has an empty array of costs")
				}
			} else {
				c.one, err = d.cost(at)
			}
			g.costs = append(g.costs, c)
			return err
		})
	case gResults:
		err = d.array(at, func(int) error {
			r, err := d.str(at)
			g.results = append(g.results, r)
			return err
		})
	case gDescriptors:
		err = d.array(at, func(int) error {
			if err := d.expect('[', at); err != nil {
				return err
			}
			gi, err := d.uint(at)
			if err != nil {
				return err
			}
			if err := d.expect(',', at); err != nil {
				return err
			}
			start, n, err := d.descriptor(at)
			if err != nil {
				return err
			}
			if gi > maxGrouped {
				return fail(at, "has a group index out of range")
			}
			g.descriptors = append(g.descriptors, rawDesc{int64(gi), d.dims[start : start+n : start+n]})
			return d.expect(']', at)
		})
	case gFullKeys:
		g.fullKeys, err = d.pairs(at, nil)
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
	case gReservations:
		g.reserv, err = d.pairs(at, g.reserv[:0])
	}
	return true, err
}

// ints reads an array of integers (negative ones too when signed) into
// dst. The array as publishers write it (no spaces, integers of at most
// 18 digits without leading zeros) is read in one loop; anything else
// takes the general path from where that loop stopped.
func (d *decoder) ints(at loc, dst []int64, signed bool) ([]int64, error) {
	d.sc.Space()
	data, i := d.sc.Text, d.sc.Pos
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
				d.sc.Pos = i
				return dst, nil
			}
		}
		if len(dst) > 0 {
			// Continue the array from element len(dst) in the general form.
			d.sc.Pos = i
			return d.intsRest(at, dst, signed)
		}
	}
	return d.intsRest(at, dst[:0], signed)
}

// intsRest is ints' general path: from the cursor, the array's opening bracket
// when dst is empty, else the element after dst's last.
func (d *decoder) intsRest(at loc, dst []int64, signed bool) ([]int64, error) {
	elem := func(int) error {
		neg := false
		if signed && d.peek() == '-' {
			neg = true
			d.sc.Pos++
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
	var err error
	if len(dst) > 0 {
		err = d.arrayFrom(at, len(dst), elem)
	} else {
		err = d.array(at, elem)
	}
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

// units reads an array of totals' units (JSON numbers >= 0 with at most
// 6 fractional digits, as parseUnits reads them) into dst.
func (d *decoder) units(at loc, dst []int64) ([]int64, error) {
	err := d.array(at, func(int) error {
		text, err := d.number(at)
		if err != nil {
			return err
		}
		v, err := parseUnits(at, text)
		dst = append(dst, v)
		return err
	})
	return dst, err
}

// cost reads one cost (a JSON number, as in a v1.1 record; 0 too, which
// assemble allows only for a decision with a reservation).
func (d *decoder) cost(at loc) (int64, error) {
	text, err := d.number(at)
	if err != nil {
		return 0, err
	}
	return parseCost(at, text)
}

// columns builds g.keys from the groups' columns: every column has one
// entry per key.
func (g *groupedRaw) columns(policy string) error {
	ng := len(g.keyCol)
	for _, c := range []struct {
		name string
		n    int
	}{{"revisions", len(g.revisions)}, {"allowed", len(g.allowed)}, {"allowed_units", len(g.allowedU)},
		{"denied", len(g.denied)}, {"denied_units", len(g.deniedU)}, {"costs", len(g.costs)}, {"results", len(g.results)}} {
		if c.n != ng {
			return fail(top.with(c.name), "has "+strconv.Itoa(c.n)+" entries for "+strconv.Itoa(ng)+" keys")
		}
	}
	g.keys = make([]rawGroup, ng)
	for gi := range g.keys {
		rg := &g.keys[gi]
		if g.revisions[gi] < 0 || g.allowed[gi] < 0 || g.denied[gi] < 0 {
			return fail(keyLoc(gi), "has a negative count")
		}
		rg.key = fullKey(g.keyCol[gi], policy)
		rg.revision = uint64(g.revisions[gi])
		rg.allowed, rg.denied = uint64(g.allowed[gi]), uint64(g.denied[gi])
		rg.allowedU, rg.deniedU = g.allowedU[gi], g.deniedU[gi]
		rg.cost, rg.costs = g.costs[gi].one, g.costs[gi].per
		rg.results = g.results[gi]
	}
	last := int64(-1)
	for _, p := range g.fullKeys {
		if p.i <= last || p.i >= int64(ng) {
			return fail(top.with("full_keys"), "index "+strconv.FormatInt(p.i, 10)+" is out of order or range")
		}
		last = p.i
		if g.keyCol[p.i] != "" {
			return fail(top.with("full_keys"), "names a key whose entry in keys is not \"\"")
		}
		g.keys[p.i].key = p.v
	}
	last = -1
	for _, dd := range g.descriptors {
		if dd.g <= last || dd.g >= int64(ng) {
			return fail(top.with("descriptors"), "group "+strconv.FormatInt(dd.g, 10)+" is out of order or range")
		}
		last = dd.g
		g.keys[dd.g].desc = dd.dims
		if g.keys[dd.g].desc == nil {
			g.keys[dd.g].desc = []policies.Dim{}
		}
	}
	for gi := range g.keys {
		if err := checkKey(keyLoc(gi).with("key"), g.keys[gi].key); err != nil {
			return err
		}
	}
	return nil
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
	if err := g.columns(b.Policy); err != nil {
		return err
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
	var free []int32 // the decisions that cost 0
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
		if cost == 0 {
			free = append(free, int32(i))
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
	// Request ids, reservations and explicit ids: increasing indexes
	// below n, explicit ids only for decisions not journalled.
	for _, f := range []struct {
		name string
		list []indexed
	}{{"request_ids", g.requestIDs}, {"reservations", g.reserv}, {"ids", g.ids}} {
		at := top.with(f.name)
		last := int64(-1)
		jn := 0
		for _, p := range f.list {
			if p.i <= last || p.i >= int64(n) {
				return fail(at, "index "+strconv.FormatInt(p.i, 10)+" is out of order or range")
			}
			last = p.i
			switch f.name {
			case "request_ids":
				if len(p.v) > MaxRequestIDLen {
					return fail(at, "has one of "+strconv.Itoa(len(p.v))+" bytes (at most 128)")
				}
				if p.v == "" {
					return fail(at, "has one that is empty")
				}
				if !utf8.ValidString(p.v) {
					return fail(at, "has one that is not valid UTF-8")
				}
				continue
			case "reservations":
				if reason := reservationProblem(p.v); reason != "" {
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
	// A decision that costs 0 ends a reservation (both lists increase).
	res := g.reserv
	for _, i := range free {
		for len(res) > 0 && res[0].i < int64(i) {
			res = res[1:]
		}
		if len(res) == 0 || res[0].i != int64(i) {
			return fail(top.with("costs"), "the cost of decision "+strconv.Itoa(int(i))+" "+zeroCost)
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
	for _, p := range g.reserv {
		recs[p.i].Reservation = p.v
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
