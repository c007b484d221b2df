package usage

import (
	"errors"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/limitmesh/limitmesh/internal/wire"
	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/policies"
)

// DecodeBatch decodes and validates one usage stream message (CONTRACT.md
// §6). It is strict, because anyone able to publish on the usage subjects
// can send it anything:
//
//   - the body is one JSON object (whitespace around it is allowed) with
//     "node" (1..256 bytes of printable UTF-8), "policy" ("" or a policy
//     name, [a-z0-9][a-z0-9_-]{0,63}) and "records" (an array);
//   - each record has "id" (1..256 bytes of printable UTF-8), "t_us" (an
//     integer >= 0), "revision" (an integer >= 0), "key" ("" exactly when
//     the batch's policy is "", else a valid KV key of at most 256 bytes),
//     "descriptor" (an object following CONTRACT.md §2), "cost" (a JSON
//     number > 0 and <= 1e9 with at most 6 fractional digits, no exponent;
//     0 only in a record with a "reservation"), "result" ("allowed" or
//     "denied"), optionally "request_id" (at most 128 bytes of UTF-8,
//     control characters included: decide takes any) and optionally "reservation" (the id of the reservation the
//     record ends, CONTRACT.md §10: 1..128 bytes of printable UTF-8);
//   - unknown fields are skipped (new optional fields are a compatible
//     extension); a known field given twice, a missing required field,
//     invalid UTF-8 in a string and trailing data are errors.
//
// Errors match [ErrInvalid] and name the field. The returned descriptors
// are sorted by name. The strings of the result share one copy of data.
func DecodeBatch(data []byte) (Batch, error) {
	// One copy of the message: every string without escapes is a
	// substring of it.
	d := decoder{sc: wire.Scanner{Text: string(data)}}
	return d.batch()
}

// decodeLedger is DecodeBatch for the ledger: a grouped message is checked
// as DecodeBatch checks it, but gets its records (without ids) only when
// Batch.records asks for them: the ledger applies groups' totals and
// reads journal positions from the batch.
func decodeLedger(data []byte) (Batch, error) {
	d := decoder{sc: wire.Scanner{Text: string(data)}, noIDs: true, noRecords: true}
	return d.batch()
}

// decodeError is a rejection naming the offending field.
type decodeError struct {
	path   string
	reason string
}

func (e *decodeError) Error() string {
	if e.path == "" {
		return "usage: invalid batch: " + e.reason
	}
	return "usage: invalid batch: " + e.path + ": " + e.reason
}

func (e *decodeError) Is(target error) bool { return target == ErrInvalid }

// maxSkipDepth bounds the nesting of unknown fields' values.
const maxSkipDepth = 32

// dimSlab is how many descriptor entries are allocated at once.
const dimSlab = 1024

// decoder reads one batch.
type decoder struct {
	sc        wire.Scanner   // the message's text and the cursor
	dims      []policies.Dim // free part of the slab descriptors are cut from
	noIDs     bool           // grouped records get no ids (decodeLedger)
	noRecords bool           // grouped messages get no records until asked (decodeLedger)
}

// loc names a field for error messages; its text is built only when an
// error is reported. rec < 0 for the batch's own fields.
type loc struct {
	rec   int
	grp   int // 1 + the index of a grouped message's group ("keys[i]"); 0: none
	field string
	sub   string
}

func (l loc) String() string {
	var parts []string
	if l.rec >= 0 {
		parts = append(parts, "records["+strconv.Itoa(l.rec)+"]")
	}
	if l.grp > 0 {
		parts = append(parts, "keys["+strconv.Itoa(l.grp-1)+"]")
	}
	for _, p := range []string{l.field, l.sub} {
		if p != "" {
			parts = append(parts, p)
		}
	}
	return strings.Join(parts, ".")
}

func (l loc) with(name string) loc {
	if l.field == "" {
		l.field = name
	} else {
		l.sub = name
	}
	return l
}

func fail(at loc, reason string) error { return &decodeError{path: at.String(), reason: reason} }

var top = loc{rec: -1}

func (d *decoder) batch() (Batch, error) {
	var (
		b    Batch
		seen uint8
		g    groupedRaw
	)
	const (
		fNode = 1 << iota
		fPolicy
		fRecords
	)
	err := d.object(top, func(name string) (bool, error) {
		var bit uint8
		switch name {
		case "node":
			bit = fNode
		case "policy":
			bit = fPolicy
		case "records":
			bit = fRecords
		default:
			return d.groupedField(name, &g)
		}
		at := top.with(name)
		if seen&bit != 0 {
			return true, fail(at, "given twice")
		}
		seen |= bit
		var err error
		switch bit {
		case fNode:
			if b.Node, err = d.str(at); err == nil {
				err = checkID(at, b.Node)
			}
		case fPolicy:
			b.Policy, err = d.str(at)
			if err == nil && b.Policy != "" && policies.ValidateName(b.Policy) != nil {
				err = fail(at, strconv.Quote(b.Policy)+" is not [a-z0-9][a-z0-9_-]{0,63}")
			}
		case fRecords:
			b.Records, err = d.records()
		}
		return true, err
	})
	if err != nil {
		return Batch{}, err
	}
	if d.sc.End() != nil {
		return Batch{}, fail(top, "trailing data after the batch")
	}
	switch {
	case seen&fNode == 0:
		return Batch{}, fail(top.with("node"), "missing")
	case seen&fPolicy == 0:
		return Batch{}, fail(top.with("policy"), "missing")
	case seen&fRecords != 0 && g.seen != 0:
		return Batch{}, fail(top.with("records"), `given with the fields of records grouped by key ("keys"...)`)
	case seen&fRecords == 0 && g.seen == 0:
		return Batch{}, fail(top.with("records"), `missing (or "keys")`)
	case g.seen != 0:
		if err := d.assemble(&b, &g); err != nil {
			return Batch{}, err
		}
		return b, nil
	}
	// A key is "" exactly for the decisions no policy matched.
	for i := range b.Records {
		switch k := b.Records[i].Key; {
		case b.Policy == "" && k != "":
			return Batch{}, fail(loc{rec: i, field: "key"}, `must be "" in a batch of policy ""`)
		case b.Policy != "" && k == "":
			return Batch{}, fail(loc{rec: i, field: "key"}, "is empty")
		}
	}
	return b, nil
}

func (d *decoder) records() ([]Record, error) {
	at := top.with("records")
	if err := d.expect('[', at); err != nil {
		return nil, err
	}
	// Records are about 150 bytes of JSON or more: a capacity guess that
	// saves most regrowth.
	out := make([]Record, 0, min(4096, (len(d.sc.Text)-d.sc.Pos)/150+1))
	if d.peek() == ']' {
		d.sc.Pos++
		return out, nil
	}
	for i := 0; ; i++ {
		r, err := d.record(i)
		if err != nil {
			return nil, err
		}
		out = append(out, r)
		switch d.peek() {
		case ',':
			d.sc.Pos++
		case ']':
			d.sc.Pos++
			return out, nil
		default:
			return nil, fail(at, "unexpected input after a record")
		}
	}
}

func (d *decoder) record(i int) (Record, error) {
	var (
		r     Record
		seen  uint16
		start = -1 // the record's descriptor in d.dims
		ndims int
	)
	const (
		fID = 1 << iota
		fTime
		fRevision
		fKey
		fDescriptor
		fCost
		fResult
		fRequestID
		fReservation
		required = fID | fTime | fRevision | fKey | fDescriptor | fCost | fResult
	)
	self := loc{rec: i}
	err := d.object(self, func(name string) (bool, error) {
		var bit uint16
		switch name {
		case "id":
			bit = fID
		case "t_us":
			bit = fTime
		case "revision":
			bit = fRevision
		case "key":
			bit = fKey
		case "descriptor":
			bit = fDescriptor
		case "cost":
			bit = fCost
		case "result":
			bit = fResult
		case "request_id":
			bit = fRequestID
		case "reservation":
			bit = fReservation
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
		case fID:
			if r.ID, err = d.str(at); err == nil {
				err = checkID(at, r.ID)
			}
		case fTime:
			var n uint64
			if n, err = d.uint(at); err == nil {
				if n > 1<<63-1 {
					err = fail(at, "is too large")
				}
				r.TimeUs = int64(n)
			}
		case fRevision:
			r.Revision, err = d.uint(at)
		case fKey:
			if r.Key, err = d.str(at); err == nil {
				err = checkKey(at, r.Key)
			}
		case fDescriptor:
			start, ndims, err = d.descriptor(at)
		case fCost:
			var text string
			if text, err = d.number(at); err == nil {
				r.Cost, err = parseCost(at, text)
			}
		case fResult:
			var s string
			if s, err = d.str(at); err == nil {
				switch s {
				case "allowed":
					r.Allowed = true
				case "denied":
				default:
					err = fail(at, strconv.Quote(s)+` is not "allowed" or "denied"`)
				}
			}
		case fRequestID:
			if r.RequestID, err = d.str(at); err == nil {
				if len(r.RequestID) > MaxRequestIDLen {
					err = fail(at, "is "+strconv.Itoa(len(r.RequestID))+" bytes (at most 128)")
				} else if !utf8.ValidString(r.RequestID) {
					err = fail(at, "is not valid UTF-8")
				}
			}
		case fReservation:
			if r.Reservation, err = d.str(at); err == nil {
				if reason := reservationProblem(r.Reservation); reason != "" {
					err = fail(at, reason)
				}
			}
		}
		return true, err
	})
	if err != nil {
		return Record{}, err
	}
	if missing := required &^ seen; missing != 0 {
		names := []string{"id", "t_us", "revision", "key", "descriptor", "cost", "result"}
		for k, n := range names {
			if missing&(1<<k) != 0 {
				return Record{}, fail(self.with(n), "missing")
			}
		}
	}
	if r.Cost == 0 && r.Reservation == "" {
		return Record{}, fail(self.with("cost"), zeroCost)
	}
	desc, err := policies.NewDescriptor(d.dims[start : start+ndims : start+ndims])
	if err != nil {
		var pe *policies.Error
		if errors.As(err, &pe) {
			return Record{}, fail(loc{rec: i, field: pe.Path}, pe.Reason)
		}
		return Record{}, fail(self.with("descriptor"), err.Error())
	}
	r.Descriptor = desc
	return r, nil
}

// descriptor reads a descriptor object into the slab and returns where its
// entries start and how many there are.
func (d *decoder) descriptor(at loc) (int, int, error) {
	if cap(d.dims)-len(d.dims) < policies.MaxDims {
		d.dims = make([]policies.Dim, 0, dimSlab)
	}
	start := len(d.dims)
	err := d.object(at, func(name string) (bool, error) {
		if len(d.dims)-start == policies.MaxDims {
			return true, fail(at, "has more than 16 dimensions")
		}
		v, err := d.str(at.with(name))
		if err != nil {
			return true, err
		}
		d.dims = append(d.dims, policies.Dim{Name: name, Value: v})
		return true, nil
	})
	return start, len(d.dims) - start, err
}

// zeroCost is why a cost of 0 is refused in a record that ends no
// reservation.
const zeroCost = "is 0 and the record ends no reservation (only a reservation's end may cost 0)"

// parseCost parses a cost's number text: the common forms (up to 10
// integer digits, up to 6 fractional digits) here, the rest by
// policies.ParseCost (same rules). Zero ("0", "0.0"...) parses: only the
// caller knows whether its record ends a reservation.
func parseCost(at loc, s string) (int64, error) {
	i := 0
	var whole int64
	for i < len(s) && s[i] >= '0' && s[i] <= '9' {
		whole = whole*10 + int64(s[i]-'0')
		i++
	}
	ok := i > 0 && i <= 10 && (i == 1 || s[0] != '0')
	var frac int64
	scale := kvstate.Unit
	if ok && i < len(s) && s[i] == '.' {
		j := i + 1
		for j < len(s) && s[j] >= '0' && s[j] <= '9' && j-i <= 6 {
			frac = frac*10 + int64(s[j]-'0')
			scale /= 10
			j++
		}
		ok = j > i+1
		i = j
	}
	if ok && i == len(s) {
		v := whole*kvstate.Unit + frac*scale
		if v <= policies.MaxCost {
			return v, nil
		}
	}
	v, err := policies.ParseCost(s)
	if err != nil {
		return 0, fail(at, strconv.Quote(s)+" is not a cost >= 0 and <= 1e9 with at most 6 fractional digits")
	}
	return v, nil
}

// reservationProblem returns why s is not a reservation id (1..128 bytes
// of printable UTF-8), or "".
func reservationProblem(s string) string {
	switch {
	case s == "":
		return "is empty"
	case len(s) > MaxReservationLen:
		return "is " + strconv.Itoa(len(s)) + " bytes (at most " + strconv.Itoa(MaxReservationLen) + ")"
	}
	return printable(s)
}

// checkID checks a record id or node name: 1..256 bytes of printable UTF-8.
func checkID(at loc, s string) error {
	if s == "" {
		return fail(at, "is empty")
	}
	if len(s) > MaxIDLen {
		return fail(at, "is "+strconv.Itoa(len(s))+" bytes (at most 256)")
	}
	if reason := printable(s); reason != "" {
		return fail(at, reason)
	}
	return nil
}

// printable returns why s is not printable UTF-8, or "".
func printable(s string) string {
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c < 0x20 || c == 0x7f {
				return "has a control character"
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			return "is not valid UTF-8"
		}
		if unicode.IsControl(r) {
			return "has a control character"
		}
		i += size
	}
	return ""
}

// checkKey checks a record's limit key: "" or a valid KV key
// ([-/_=.a-zA-Z0-9], no empty token) of at most 256 bytes.
func checkKey(at loc, key string) error {
	switch {
	case key == "":
		return nil
	case len(key) > MaxKeyLen:
		return fail(at, "is "+strconv.Itoa(len(key))+" bytes (at most 256)")
	case !ValidKVKey(key):
		return fail(at, strconv.Quote(key)+" is not a valid KV key")
	}
	return nil
}

// ValidKVKey reports whether s is a valid JetStream KV key: 1 or more of
// [-/_=.a-zA-Z0-9], without a leading or trailing '.' or an empty token.
func ValidKVKey(s string) bool {
	if s == "" || s[0] == '.' || s[len(s)-1] == '.' {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '-', c == '/', c == '_', c == '=':
		case c == '.':
			if s[i-1] == '.' {
				return false
			}
		default:
			return false
		}
	}
	return true
}
