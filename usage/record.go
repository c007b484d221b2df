package usage

import (
	"strconv"
	"unicode/utf8"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/policies"
)

// Record is one decision as it appears in the usage stream (CONTRACT.md
// §6). A Record is a value; the publisher keeps it (its strings and the
// Descriptor's backing array) until it is published, so the caller must not
// modify a Descriptor it handed over.
type Record struct {
	ID         string              // unique and stable (see ids.go); at most MaxIDLen bytes
	TimeUs     int64               // t_us: Unix microseconds at the serialization point
	Revision   uint64              // KV revision of the deciding policy; 0 when none matched
	Key        string              // canonical limit key; "" when no policy matched
	Descriptor policies.Descriptor // the request's dimensions, sorted by name
	Cost       int64               // micro-units, > 0, or 0 for a reservation's end (JSON: a decimal number such as 3 or 2.5)
	Allowed    bool                // result "allowed" (true) or "denied"
	RequestID  string              // the request's request_id; omitted from the JSON when ""
	// Reservation is the id of the reservation this record ends (CONTRACT
	// §10: one allowed record with the settled cost, which may be 0 for a
	// release); omitted from the JSON when "". At most MaxReservationLen
	// bytes of printable UTF-8.
	Reservation string
}

// Batch is one message of the usage stream: the records of one policy
// ("" when no policy matched) published by one node.
type Batch struct {
	Node    string
	Policy  string
	Records []Record

	// Groups are the groups of a grouped message (CONTRACT.md §6a), nil
	// for a v1.1 message; Records are its decisions all the same.
	Groups []KeyGroup

	journal []journalled // a grouped message's journalled decisions, in order
	origins []string     // their origins
	raw     *groupedRaw  // a grouped message's fields (Records are built from them when needed)
}

// Len returns the number of decisions in b.
func (b *Batch) Len() int {
	if b.Records == nil && b.raw != nil {
		return int(b.raw.n)
	}
	return len(b.Records)
}

// groupOf returns the group of decision i of a grouped message.
func (b *Batch) groupOf(i int) int32 { return int32(b.raw.order[i]) }

// records returns b's records, building them first for a grouped message
// decoded without them (decodeLedger).
func (b *Batch) records() []Record {
	if b.Records == nil && b.raw != nil {
		b.Records = b.raw.records(b, false)
	}
	return b.Records
}

// Field limits of the usage stream.
const (
	MaxIDLen        = 256 // most bytes of a record id and of a node name
	MaxRequestIDLen = 128 // most bytes of a request_id (CONTRACT.md §2)
	MaxKeyLen       = 256 // most bytes of a limit key (policies/KEYS.md)
	// MaxReservationLen is the most bytes of a reservation id (CONTRACT.md
	// §10).
	MaxReservationLen = 128
)

// AppendRecord appends the JSON object of one record, as it appears in a
// batch, to dst.
func AppendRecord(dst []byte, r *Record) []byte { return appendRecord(dst, r, "", 0) }

// appendRecord writes one record object. A record without an id gets
// idPrefix followed by n in decimal (the publisher's ordinary ids, made
// only when encoded).
func appendRecord(dst []byte, r *Record, idPrefix string, n uint64) []byte {
	dst = append(dst, `{"id":`...)
	if r.ID != "" || idPrefix == "" {
		dst = appendString(dst, r.ID)
	} else {
		dst = append(dst, '"')
		dst = append(dst, idPrefix...) // node and boot are plain ASCII (validated)
		dst = strconv.AppendUint(dst, n, 10)
		dst = append(dst, '"')
	}
	dst = append(dst, `,"t_us":`...)
	dst = strconv.AppendInt(dst, r.TimeUs, 10)
	dst = append(dst, `,"revision":`...)
	dst = strconv.AppendUint(dst, r.Revision, 10)
	dst = append(dst, `,"key":`...)
	dst = appendString(dst, r.Key)
	dst = append(dst, `,"descriptor":{`...)
	for i, d := range r.Descriptor {
		if i > 0 {
			dst = append(dst, ',')
		}
		dst = appendString(dst, d.Name)
		dst = append(dst, ':')
		dst = appendString(dst, d.Value)
	}
	dst = append(dst, `},"cost":`...)
	dst = appendMicro(dst, r.Cost)
	if r.Allowed {
		dst = append(dst, `,"result":"allowed"`...)
	} else {
		dst = append(dst, `,"result":"denied"`...)
	}
	if r.RequestID != "" {
		dst = append(dst, `,"request_id":`...)
		dst = appendString(dst, r.RequestID)
	}
	if r.Reservation != "" {
		dst = append(dst, `,"reservation":`...)
		dst = appendString(dst, r.Reservation)
	}
	return append(dst, '}')
}

const hexDigits = "0123456789abcdef"

// appendString writes s as a JSON string: '"' and '\' escaped, control
// characters as \u00XX, invalid UTF-8 as \ufffd, everything else as is.
func appendString(dst []byte, s string) []byte {
	dst = append(dst, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c >= 0x20 && c != '"' && c != '\\' && c < utf8.RuneSelf {
			i++
			continue
		}
		if c >= utf8.RuneSelf {
			r, size := utf8.DecodeRuneInString(s[i:])
			if r != utf8.RuneError || size != 1 {
				i += size
				continue
			}
			dst = append(dst, s[start:i]...)
			dst = append(dst, `\ufffd`...)
			i++
			start = i
			continue
		}
		dst = append(dst, s[start:i]...)
		switch c {
		case '"', '\\':
			dst = append(dst, '\\', c)
		case '\n':
			dst = append(dst, '\\', 'n')
		case '\r':
			dst = append(dst, '\\', 'r')
		case '\t':
			dst = append(dst, '\\', 't')
		default:
			dst = append(dst, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
		}
		i++
		start = i
	}
	dst = append(dst, s[start:]...)
	return append(dst, '"')
}

// appendMicro writes micro-units v as a decimal with the fractional digits
// it needs: 1500000 -> 1.5, 3000000 -> 3, -1 -> -0.000001.
func appendMicro(dst []byte, v int64) []byte {
	u := uint64(v)
	if v < 0 {
		dst = append(dst, '-')
		u = uint64(-(v + 1)) + 1
	}
	unit := uint64(kvstate.Unit)
	dst = strconv.AppendUint(dst, u/unit, 10)
	frac := u % unit
	if frac == 0 {
		return dst
	}
	var digits [6]byte
	for i := 5; i >= 0; i-- {
		digits[i] = byte('0' + frac%10)
		frac /= 10
	}
	n := 6
	for digits[n-1] == '0' {
		n--
	}
	dst = append(dst, '.')
	return append(dst, digits[:n]...)
}

// FormatMicro returns micro-units v as a decimal ("2.5" for 2500000).
func FormatMicro(v int64) string { return string(appendMicro(nil, v)) }
