package usage

import (
	"math"
	"slices"
	"strings"
	"time"

	"github.com/limitmesh/limitmesh/internal/bugs"
)

// ledgerCore applies usage messages to ledger entries held in memory,
// without I/O: the reconciler loads the entries and watermarks a group of
// messages needs ([ledgerCore.missing]), applies the messages in stream
// order ([ledgerCore.apply]), writes what changed ([ledgerCore.dirty]) and
// only then acknowledges the messages.
//
// Exactly once (the ledger's half of invariant I6, docs/protocol.md; U1-U3
// are the journal's half). A record counts in its policy's day and month
// entries:
//
//  1. A stream message is applied to an entry only if the entry's Seq (the
//     last message applied to it, stored with it) is below the message's
//     sequence; the entry then takes that sequence. So a message delivered
//     again (after a crash anywhere between the first write and the
//     acknowledgement) changes nothing it already changed, and completes
//     what it had not: entries are written with compare-and-swap, each in
//     one write, and the watermarks and the cursor after every entry of the
//     group.
//  2. A journalled record (<origin>.j<jseq>.<idx>) counts only if its
//     (jseq, idx) is above the watermark of (origin, policy), which it then
//     becomes. One publisher publishes an origin's journalled records of a
//     policy in increasing order (on one subject, in order), and whoever
//     publishes them again uses the same ids, so a record already counted
//     is at or below the watermark when it comes again, and the decision
//     depends only on the watermark and the stream's order, both the same
//     when a message is applied again.
//  3. Ordinary records count once per stream message; the stream stores a
//     batch once per Nats-Msg-Id within its duplicates window.
type ledgerCore struct {
	entries map[entryID]*ledgerEntry
	origins map[string]*originState
	dirtyE  []*ledgerEntry
	dirtyO  []*originState

	// touched: the greatest t_us of an allowed record counted, per
	// (policy, key), since the caller last took it.
	touched map[policyKey]int64

	dayIdx     int64 // the UTC day (Unix days) day and month are of; MinInt64: none
	day, month string

	skip  []int32           // applyGrouped's: the records skipped as counted before
	names map[string]string // intern's
	slow  []bool            // applyGrouped's: per group, applied record by record
}

// entryID names a totals entry.
type entryID struct{ policy, period, key string }

// policyKey names a limit key of a policy.
type policyKey struct{ policy, key string }

// ledgerEntry is a totals entry held in memory.
type ledgerEntry struct {
	id    entryID
	kvKey string
	rev   uint64 // KV revision to compare-and-swap on (0: no message)
	t     Totals
	pendA int64 // allowed micro-units not yet added to t.AllowedUnits
	pendD int64
	open  uint64 // the message being applied to it
	dirty bool
}

// originState is an origin's watermark entry held in memory.
type originState struct {
	kvKey string
	rev   uint64
	m     *marks
	dirty bool
}

func newLedgerCore() *ledgerCore {
	return &ledgerCore{
		entries: make(map[entryID]*ledgerEntry),
		origins: make(map[string]*originState),
		touched: make(map[policyKey]int64),
		names:   make(map[string]string),
		dayIdx:  math.MinInt64,
	}
}

// periods returns the UTC day and month of t_us.
func (c *ledgerCore) periods(tUs int64) (string, string) {
	idx := tUs / usPerDay
	if tUs < 0 && tUs%usPerDay != 0 {
		idx--
	}
	if idx != c.dayIdx {
		t := time.UnixMicro(tUs).UTC()
		c.dayIdx, c.day, c.month = idx, t.Format(dayFormat), t.Format(monthFormat)
	}
	return c.day, c.month
}

// policyToken is a policy's name in watermarks ("_" for none).
func policyToken(policy string) string {
	if policy == "" {
		return UnmatchedToken
	}
	return policy
}

// missing calls entry for every totals entry and origin for every origin
// that applying b needs and c does not hold (possibly more than once).
func (c *ledgerCore) missing(b *Batch, entry func(entryID), origin func(string)) {
	if b.Groups != nil {
		for _, o := range b.origins {
			if c.origins[o] == nil {
				origin(o)
			}
		}
		for gi := range b.Groups {
			g := &b.Groups[gi]
			dayLo, _ := c.periods(g.MinUs)
			day, month := c.periods(g.MaxUs)
			if dayLo != day {
				c.missingRecords(b, entry) // a batch over two days: its records' days
				return
			}
			for _, per := range [2]string{day, month} {
				id := entryID{b.Policy, per, g.Key}
				if c.entries[id] == nil {
					entry(id)
				}
			}
		}
		return
	}
	for i := range b.Records {
		if o, _, ok := ParseJournalID(b.Records[i].ID); ok && c.origins[o] == nil {
			origin(o)
		}
	}
	c.missingRecords(b, entry)
}

// missingRecords calls entry for the totals entries of b's records that c
// does not hold.
func (c *ledgerCore) missingRecords(b *Batch, entry func(entryID)) {
	recs := b.records()
	for i := range recs {
		r := &recs[i]
		day, month := c.periods(r.TimeUs)
		for _, per := range [2]string{day, month} {
			id := entryID{b.Policy, per, r.Key}
			if c.entries[id] == nil {
				entry(id)
			}
		}
	}
}

// hold adds an entry as loaded: t (the zero Totals for a new entry) at
// revision rev. The strings of id are copied: a decoded batch's strings
// share its whole message, which a long-lived entry must not keep alive.
func (c *ledgerCore) hold(id entryID, rev uint64, t Totals) *ledgerEntry {
	id = entryID{strings.Clone(id.policy), strings.Clone(id.period), strings.Clone(id.key)}
	t.Policy, t.Key, t.Period = id.policy, id.key, id.period
	e := &ledgerEntry{id: id, kvKey: TotalsKey(id.policy, id.period, id.key), rev: rev, t: t}
	c.entries[id] = e
	return e
}

// holdOrigin adds an origin's watermarks as loaded (m nil: none yet).
func (c *ledgerCore) holdOrigin(origin string, rev uint64, m *marks) {
	origin = strings.Clone(origin)
	if m == nil {
		m = &marks{pos: map[string]JournalPos{}}
	}
	m.Origin = origin
	c.origins[origin] = &originState{kvKey: marksKey(origin), rev: rev, m: m}
}

// apply applies stream message seq, holding batch b, to the entries (all
// of which c must hold: see missing). It returns how many records counted
// and how many were skipped as already counted (journalled records at or
// below their watermark). A grouped message's groups are applied with
// their totals at once, except a group with a record skipped or with
// records of two UTC days, whose records are applied one by one.
func (c *ledgerCore) apply(seq uint64, b *Batch) (counted, dup int) {
	if b.Groups != nil {
		return c.applyGrouped(seq, b)
	}
	for i := range b.Records {
		r := &b.Records[i]
		if origin, pos, ok := ParseJournalID(r.ID); ok && !c.advance(seq, b.Policy, origin, pos, r.TimeUs) {
			dup++
			continue
		}
		counted++
		c.count(seq, b.Policy, r)
	}
	return counted, dup
}

// advance applies the watermark rule to a journalled record of policy
// at pos of origin, seen at tUs: it reports whether the record counts
// (its position is above the watermark, which it then becomes).
func (c *ledgerCore) advance(seq uint64, policy, origin string, pos JournalPos, tUs int64) bool {
	o := c.origins[origin]
	if tUs > o.m.SeenUs {
		o.m.SeenUs = tUs
		c.dirtyOrigin(o)
	}
	// The token the map is written with is one the core owns: an
	// assignment replaces a string key with the one given, and a
	// message's substring would keep the whole message alive.
	ptok := c.intern(policyToken(policy))
	if cur, ok := o.m.pos[ptok]; ok && !cur.Less(pos) && !bugs.Planted(bugs.LedgerWatermark) {
		return false
	}
	o.m.pos[ptok] = pos
	o.m.Seq = seq
	c.dirtyOrigin(o)
	return true
}

// open returns the entry of policy's key in period per for message seq,
// or nil when that message was applied to it before.
func (c *ledgerCore) open(seq uint64, policy, per, key string) *ledgerEntry {
	e := c.entries[entryID{policy, per, key}]
	if e.open != seq {
		if e.t.Seq >= seq {
			return nil // applied before this message was delivered again
		}
		e.open, e.t.Seq = seq, seq
		if !e.dirty {
			e.dirty = true
			c.dirtyE = append(c.dirtyE, e)
		}
	}
	return e
}

// add adds n decisions of units micro-units to e's allowed or denied
// totals, the latest at lastUs.
func (e *ledgerEntry) add(allowed bool, n, units, lastUs int64) {
	if allowed {
		e.t.Allowed += n
		if e.pendA > math.MaxInt64-units {
			addMicro(&e.t.AllowedUnits, e.pendA)
			e.pendA = 0
		}
		e.pendA += units
	} else {
		e.t.Denied += n
		if e.pendD > math.MaxInt64-units {
			addMicro(&e.t.DeniedUnits, e.pendD)
			e.pendD = 0
		}
		e.pendD += units
	}
	e.t.LastUs = max(e.t.LastUs, lastUs)
}

// count counts record r of policy in its day and month entries.
func (c *ledgerCore) count(seq uint64, policy string, r *Record) {
	day, month := c.periods(r.TimeUs)
	for _, per := range [2]string{day, month} {
		if e := c.open(seq, policy, per, r.Key); e != nil {
			e.add(r.Allowed, 1, r.Cost, r.TimeUs)
		}
	}
	if r.Allowed {
		c.touch(policy, r.Key, r.TimeUs)
	}
}

// touch notes an allowed record of policy's key at tUs. The map is
// written with the strings of the key's month entry, which the core owns
// (an assignment replaces a string key with the one given, and a
// message's substring would keep the whole message alive).
func (c *ledgerCore) touch(policy, key string, tUs int64) {
	if policy == "" {
		return
	}
	_, month := c.periods(tUs)
	var pk policyKey
	if e := c.entries[entryID{policy, month, key}]; e != nil {
		pk = policyKey{e.id.policy, e.id.key}
	} else {
		pk = policyKey{strings.Clone(policy), strings.Clone(key)}
	}
	if last, ok := c.touched[pk]; !ok || tUs > last {
		c.touched[pk] = tUs
	}
}

// intern returns a copy of s the core owns (policy names: few).
func (c *ledgerCore) intern(s string) string {
	if v, ok := c.names[s]; ok {
		return v
	}
	v := strings.Clone(s)
	c.names[v] = v
	return v
}

// applyGrouped is apply for a grouped message.
func (c *ledgerCore) applyGrouped(seq uint64, b *Batch) (counted, dup int) {
	// Journalled records first, in order: the watermarks decide which
	// count; a group with one that does not is applied record by record.
	c.skip = c.skip[:0]
	c.slow = append(c.slow[:0], make([]bool, len(b.Groups))...)
	for _, j := range b.journal {
		if !c.advance(seq, b.Policy, b.origins[j.origin], j.pos, j.tUs) {
			c.skip = append(c.skip, j.i)
			c.slow[j.group] = true
			dup++
		}
	}
	for gi := range b.Groups {
		g := &b.Groups[gi]
		if c.slow[gi] {
			continue
		}
		dayLo, _ := c.periods(g.MinUs)
		day, month := c.periods(g.MaxUs)
		if dayLo != day {
			c.slow[gi] = true
			continue
		}
		for _, per := range [2]string{day, month} {
			e := c.open(seq, b.Policy, per, g.Key)
			if e == nil {
				continue
			}
			if g.Allowed > 0 {
				e.add(true, g.Allowed, g.AllowedUnits, g.MaxUs)
			}
			if g.Denied > 0 {
				e.add(false, g.Denied, g.DeniedUnits, g.MaxUs)
			}
		}
		if g.Allowed > 0 {
			c.touch(b.Policy, g.Key, g.MaxAllowedUs)
		}
		counted += int(g.Allowed + g.Denied)
	}
	if !slices.Contains(c.slow, true) {
		return counted, dup
	}
	recs := b.records()
	skip := c.skip // increasing
	for i := range recs {
		if len(skip) > 0 && int(skip[0]) == i {
			skip = skip[1:]
			continue
		}
		if !c.slow[b.groupOf(i)] {
			continue
		}
		counted++
		c.count(seq, b.Policy, &recs[i])
	}
	return counted, dup
}

func (c *ledgerCore) dirtyOrigin(o *originState) {
	if !o.dirty {
		o.dirty = true
		c.dirtyO = append(c.dirtyO, o)
	}
}

// settle adds the pending micro-units of e to its decimals.
func (e *ledgerEntry) settle() {
	if e.pendA != 0 {
		addMicro(&e.t.AllowedUnits, e.pendA)
		e.pendA = 0
	}
	if e.pendD != 0 {
		addMicro(&e.t.DeniedUnits, e.pendD)
		e.pendD = 0
	}
}

// written records that every dirty entry and origin was written, at the
// revisions the caller set.
func (c *ledgerCore) written() {
	for _, e := range c.dirtyE {
		e.dirty = false
	}
	for _, o := range c.dirtyO {
		o.dirty = false
	}
	c.dirtyE, c.dirtyO = c.dirtyE[:0], c.dirtyO[:0]
}

// takeTouched returns the keys touched since the last call and forgets
// them.
func (c *ledgerCore) takeTouched() map[policyKey]int64 {
	t := c.touched
	c.touched = make(map[policyKey]int64)
	return t
}
