package usage

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math"
	"time"

	"github.com/cockroachdb/apd/v3"
)

// The ledger bucket (<prefix>_ledger) holds four kinds of entries, told
// apart by their first token:
//
//	t.<policy>.<period>.<limit key>   totals of a policy's limit key in a UTC period
//	t._.<period>._                    totals of the decisions no policy matched
//	w.<origin>                        the journalled-record watermarks of an origin
//	wh.<sha-256 of origin, hex>       the same, for an origin that is not a valid KV key
//	cursor                            the last stream sequence wholly applied
//	leader.ledger                     the reconciler's lease (its elector)
//
// Policy names ([a-z0-9][a-z0-9_-]{0,63}), periods (2026-12, 2026-12-03)
// and limit keys (p.<policy>...., policies/KEYS.md) are valid KV key
// strings, and neither a policy name nor a limit key is "_", so the keys
// are unambiguous: t.<policy>.<period>. is followed by the whole limit key.
// The keys of one policy are watched as t.<policy>.>, of one period as
// t.*.<period>.>.
const (
	totalsPrefix = "t."
	marksPrefix  = "w."
	marksHashed  = "wh."
	cursorKey    = "cursor"
	// LedgerLeaderKey is the lease entry of the reconciler's elector in the
	// ledger bucket.
	LedgerLeaderKey = "leader.ledger"
)

// TotalsKey is the ledger key of policy's limit key in period ("" policy
// and key: the decisions no policy matched).
func TotalsKey(policy, period, key string) string {
	if policy == "" {
		policy = UnmatchedToken
	}
	if key == "" {
		key = UnmatchedToken
	}
	return totalsPrefix + policy + "." + period + "." + key
}

// TotalsFilter is the KV key filter of the totals of policy (any when ""),
// period (any when "") and limit key (any when "").
func TotalsFilter(policy, period, key string) string {
	if policy == "" {
		policy = "*"
	}
	if period == "" {
		period = "*"
	}
	if key == "" {
		key = ">"
	}
	return totalsPrefix + policy + "." + period + "." + key
}

// marksKey is the ledger key of origin's watermarks.
func marksKey(origin string) string {
	if len(origin) <= 200 && ValidKVKey(origin) {
		return marksPrefix + origin
	}
	h := sha256.Sum256([]byte(origin))
	return marksHashed + hex.EncodeToString(h[:])
}

// Periods. A record counts in the UTC day and the UTC month of its t_us.
const (
	dayFormat   = "2006-01-02"
	monthFormat = "2006-01"
	usPerDay    = 86_400_000_000
)

// Day returns the UTC day of t_us, "2026-12-03".
func Day(tUs int64) string { return time.UnixMicro(tUs).UTC().Format(dayFormat) }

// Month returns the UTC month of t_us, "2026-12".
func Month(tUs int64) string { return time.UnixMicro(tUs).UTC().Format(monthFormat) }

// Totals is the value of a totals entry of the ledger (CONTRACT.md §6):
// decision counts and exact decimal units, allowed and denied, of one
// policy's limit key in one UTC period. Seq and LastUs extend the
// contract's value compatibly: Seq is the last usage stream sequence
// applied to the entry (it makes applying a message idempotent), LastUs
// the greatest t_us counted.
type Totals struct {
	Policy       string
	Key          string
	Period       string
	Allowed      int64
	AllowedUnits apd.Decimal
	Denied       int64
	DeniedUnits  apd.Decimal
	Seq          uint64
	LastUs       int64
}

// totalsJSON is the stored form of Totals.
type totalsJSON struct {
	Policy       string `json:"policy"`
	Key          string `json:"key"`
	Period       string `json:"period"`
	Allowed      int64  `json:"allowed"`
	AllowedUnits string `json:"allowed_units"`
	Denied       int64  `json:"denied"`
	DeniedUnits  string `json:"denied_units"`
	Seq          uint64 `json:"seq"`
	LastUs       int64  `json:"last_us,omitempty"`
}

// MarshalJSON writes the stored form: {"policy","key","period","allowed",
// "allowed_units","denied","denied_units","seq","last_us"}, units as plain
// decimals ("2.5", "0").
func (t *Totals) MarshalJSON() ([]byte, error) {
	return json.Marshal(totalsJSON{
		Policy: t.Policy, Key: t.Key, Period: t.Period,
		Allowed: t.Allowed, AllowedUnits: FormatUnits(&t.AllowedUnits),
		Denied: t.Denied, DeniedUnits: FormatUnits(&t.DeniedUnits),
		Seq: t.Seq, LastUs: t.LastUs,
	})
}

// ParseTotals decodes a stored totals entry. Errors match ErrCorruptEntry.
func ParseTotals(data []byte) (Totals, error) {
	var j totalsJSON
	if err := json.Unmarshal(data, &j); err != nil {
		return Totals{}, fmt.Errorf("%w: %v", ErrCorruptEntry, err)
	}
	t := Totals{Policy: j.Policy, Key: j.Key, Period: j.Period, Allowed: j.Allowed, Denied: j.Denied, Seq: j.Seq, LastUs: j.LastUs}
	for _, u := range []struct {
		s string
		d *apd.Decimal
	}{{j.AllowedUnits, &t.AllowedUnits}, {j.DeniedUnits, &t.DeniedUnits}} {
		d, _, err := apd.NewFromString(u.s)
		if err != nil || d.Form != apd.Finite || d.Negative || !ledgerUnits(d) {
			return Totals{}, fmt.Errorf("%w: units %q", ErrCorruptEntry, u.s)
		}
		u.d.Set(d)
	}
	if t.Allowed < 0 || t.Denied < 0 {
		return Totals{}, fmt.Errorf("%w: negative count", ErrCorruptEntry)
	}
	return t, nil
}

// maxUnitDigits bounds the integer digits of a stored total: sums of
// costs of at most 1e9 units each stay far below 10^40.
const maxUnitDigits = 40

// ledgerUnits reports whether d (units) is a total the ledger can hold
// and add to: at most 6 fractional digits (micro-units) once trailing
// zeros are dropped, and at most maxUnitDigits integer digits. (An
// exponent near apd's limit made the next addition fail.)
func ledgerUnits(d *apd.Decimal) bool {
	var r apd.Decimal
	r.Reduce(d)
	return r.Exponent >= -6 && r.NumDigits()+int64(r.Exponent) <= maxUnitDigits
}

// MicroUnits returns d (units) in micro-units and whether it fits int64
// exactly.
func MicroUnits(d *apd.Decimal) (int64, bool) {
	var m apd.Decimal
	m.Set(d)
	m.Exponent += 6
	var r apd.Decimal
	if _, err := microCtx.Quantize(&r, &m, 0); err != nil {
		return 0, false
	}
	if r.Cmp(&m) != 0 {
		return 0, false
	}
	v, err := r.Int64()
	return v, err == nil
}

// microCtx converts decimals to micro-units: its precision is far above
// int64's 19 digits, so a value too large shows as an Int64 error.
var microCtx = apd.Context{Precision: 64, MaxExponent: apd.MaxExponent, MinExponent: apd.MinExponent, Traps: apd.DefaultTraps}

// addMicro adds micro-units v to the decimal d (units), exactly.
func addMicro(d *apd.Decimal, v int64) {
	var x apd.Decimal
	x.SetFinite(v, -6)
	if _, err := apd.BaseContext.Add(d, d, &x); err != nil {
		// Precision 0 never rounds; an exponent overflow needs 10^100000 units.
		panic("usage: decimal add: " + err.Error())
	}
}

// FormatUnits writes units d as a plain decimal without trailing zeros:
// "2.5", "1000", "0".
func FormatUnits(d *apd.Decimal) string {
	if d.IsZero() {
		return "0"
	}
	var r apd.Decimal
	r.Reduce(d)
	return r.Text('f')
}

// marks is the value of an origin's watermark entry: for each policy
// ("_" for none), the greatest (jseq, idx) counted of the origin's
// journalled records; SeenUs is the greatest t_us of its records, which
// pruning compares with the stream's retention.
type marks struct {
	Origin string                `json:"origin"`
	SeenUs int64                 `json:"seen_us"`
	Marks  map[string][2]uint64  `json:"marks"`
	Seq    uint64                `json:"seq"`
	pos    map[string]JournalPos // decoded Marks
}

func parseMarks(data []byte) (*marks, error) {
	var m marks
	if err := json.Unmarshal(data, &m); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrCorruptEntry, err)
	}
	m.pos = make(map[string]JournalPos, len(m.Marks))
	for p, v := range m.Marks {
		if v[1] > math.MaxUint32 {
			return nil, fmt.Errorf("%w: mark index %d", ErrCorruptEntry, v[1])
		}
		m.pos[p] = JournalPos{JSeq: v[0], Idx: uint32(v[1])}
	}
	return &m, nil
}

func (m *marks) encode() ([]byte, error) {
	m.Marks = make(map[string][2]uint64, len(m.pos))
	for p, v := range m.pos {
		m.Marks[p] = [2]uint64{v.JSeq, uint64(v.Idx)}
	}
	return json.Marshal(m)
}

// cursor is the value of the cursor entry.
type cursor struct {
	Seq  uint64 `json:"seq"`
	TUs  int64  `json:"t_us"`
	Node string `json:"node,omitempty"`
}
