package usage

import (
	"strconv"

	"github.com/limitmesh/limitmesh/internal/wire"
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
		dst = wire.AppendString(dst, r.ID)
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
	dst = wire.AppendString(dst, r.Key)
	dst = append(dst, `,"descriptor":{`...)
	for i, d := range r.Descriptor {
		if i > 0 {
			dst = append(dst, ',')
		}
		dst = wire.AppendString(dst, d.Name)
		dst = append(dst, ':')
		dst = wire.AppendString(dst, d.Value)
	}
	dst = append(dst, `},"cost":`...)
	dst = wire.AppendUnits(dst, r.Cost)
	if r.Allowed {
		dst = append(dst, `,"result":"allowed"`...)
	} else {
		dst = append(dst, `,"result":"denied"`...)
	}
	if r.RequestID != "" {
		dst = append(dst, `,"request_id":`...)
		dst = wire.AppendString(dst, r.RequestID)
	}
	if r.Reservation != "" {
		dst = append(dst, `,"reservation":`...)
		dst = wire.AppendString(dst, r.Reservation)
	}
	return append(dst, '}')
}

// FormatMicro returns micro-units v as a decimal ("2.5" for 2500000).
func FormatMicro(v int64) string { return wire.FormatUnits(v) }
