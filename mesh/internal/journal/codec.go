package journal

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/ownership"
)

// The encoding of state journal messages (writer.go, reader.go). Two
// kinds, each starting with a kind byte and a format version:
//
//	batch: 'J' 2 nonce[8] uvarint(len) boot uvarint(n)
//	       n × (uvarint(len) key, uvarint(len) value, uvarint(len) usage)
//	fence: 'F' 1 uvarint(partition) uvarint(epoch) uvarint(len) node
//
// A batch carries the new records of n keys, committed together, each
// with the usage of the admissions it spends (keyrec.AppendUsage; empty:
// none); boot names the writer's incarnation (usage ids are per node and
// boot). A usage block says its own form: form 1 (the only one before
// reservations) when none of its entries ends a reservation, else form 2,
// which carries the reservation ids (so a journal of a deployment that
// uses no reservations is byte for byte what it was); this codec copies
// blocks as they are and the reader decodes either. The nonce lets the writer recognise its own batch after an
// unknown outcome. Batches of format 1 ('J' 1 nonce n × (key, value))
// decode with no boot and no usage. A fence says that node claimed
// partition in epoch: the journal's owner must not write that partition's
// keys any more.

const (
	format      = 1 // of fences
	batchFormat = 2
)

// ErrCorrupt is the error of a journal message that does not decode.
var ErrCorrupt = errors.New("mesh: corrupt state journal message")

// item is one key's record in a batch, with the usage of the admissions
// it spends: decoded (usage, when written here) or encoded (usageB, when
// read).
type item struct {
	key    string
	val    []byte
	usage  []keyrec.Usage
	usageB []byte
}

// fence is a decoded fence message.
type fence struct {
	part  int
	epoch uint64
	node  string
}

// appendBatch appends the encoding of a batch of items to dst.
func appendBatch(dst []byte, nonce uint64, boot string, items []item) []byte {
	dst = append(dst, 'J', batchFormat)
	dst = binary.BigEndian.AppendUint64(dst, nonce)
	dst = binary.AppendUvarint(dst, uint64(len(boot)))
	dst = append(dst, boot...)
	dst = binary.AppendUvarint(dst, uint64(len(items)))
	for _, it := range items {
		dst = binary.AppendUvarint(dst, uint64(len(it.key)))
		dst = append(dst, it.key...)
		dst = binary.AppendUvarint(dst, uint64(len(it.val)))
		dst = append(dst, it.val...)
		if len(it.usage) == 0 {
			// Usage already encoded (a message read and written again),
			// or none.
			dst = binary.AppendUvarint(dst, uint64(len(it.usageB)))
			dst = append(dst, it.usageB...)
			continue
		}
		// The usage's length prefix is a uvarint: encode it after a
		// one-byte gap and widen the gap only when needed.
		at := len(dst)
		dst = append(dst, 0)
		dst = keyrec.AppendUsage(dst, it.usage)
		n := len(dst) - at - 1
		if n < 0x80 {
			dst[at] = byte(n)
			continue
		}
		var pre [binary.MaxVarintLen64]byte
		w := binary.PutUvarint(pre[:], uint64(n))
		dst = append(dst, pre[:w-1]...)
		copy(dst[at+w:], dst[at+1:at+1+n])
		copy(dst[at:], pre[:w])
	}
	return dst
}

// appendFence appends the encoding of a fence to dst.
func appendFence(dst []byte, f fence) []byte {
	dst = append(dst, 'F', format)
	dst = binary.AppendUvarint(dst, uint64(f.part))
	dst = binary.AppendUvarint(dst, f.epoch)
	dst = binary.AppendUvarint(dst, uint64(len(f.node)))
	return append(dst, f.node...)
}

// message is a decoded journal message: a batch (items, nonce) or a
// fence (fence != nil). Item keys and values alias the input.
type message struct {
	nonce uint64
	boot  string
	items []item
	fence *fence
}

// decode decodes one journal message. It never panics; malformed
// input gives an error wrapping ErrCorrupt.
func decode(b []byte) (message, error) {
	var m message
	if len(b) < 2 || !(b[0] == 'F' && b[1] == format || b[0] == 'J' && (b[1] == 1 || b[1] == batchFormat)) {
		return m, fmt.Errorf("%w: no header", ErrCorrupt)
	}
	d := decoder{b: b[2:]}
	switch b[0] {
	case 'J':
		v2 := b[1] == batchFormat
		if len(d.b) < 8 {
			return m, fmt.Errorf("%w: short nonce", ErrCorrupt)
		}
		m.nonce = binary.BigEndian.Uint64(d.b)
		d.b = d.b[8:]
		if v2 {
			m.boot = string(d.bytes())
		}
		n := d.uvarint()
		// Every item takes at least two bytes: bound n before allocating.
		if d.err == nil && n > uint64(len(d.b)/2) {
			d.err = fmt.Errorf("%w: %d items in %d bytes", ErrCorrupt, n, len(d.b))
		}
		if d.err == nil {
			m.items = make([]item, 0, n)
		}
		for i := uint64(0); i < n && d.err == nil; i++ {
			k := d.bytes()
			v := d.bytes()
			var u []byte
			if v2 {
				u = d.bytes()
			}
			if d.err == nil {
				m.items = append(m.items, item{key: string(k), val: v, usageB: u})
			}
		}
	case 'F':
		f := &fence{}
		part := d.uvarint()
		f.epoch = d.uvarint()
		f.node = string(d.bytes())
		if d.err == nil && part >= ownership.MaxPartitions {
			d.err = fmt.Errorf("%w: partition %d", ErrCorrupt, part)
		}
		f.part = int(part)
		m.fence = f
	default:
		return m, fmt.Errorf("%w: kind %q", ErrCorrupt, b[0])
	}
	if d.err == nil && len(d.b) != 0 {
		d.err = fmt.Errorf("%w: %d trailing bytes", ErrCorrupt, len(d.b))
	}
	if d.err != nil {
		return message{}, d.err
	}
	return m, nil
}

type decoder struct {
	b   []byte
	err error
}

func (d *decoder) uvarint() uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.b)
	if n <= 0 {
		d.err = fmt.Errorf("%w: bad varint", ErrCorrupt)
		return 0
	}
	d.b = d.b[n:]
	return v
}

// varint reads a signed varint (binary.PutVarint's zig-zag encoding of
// an unsigned one).
func (d *decoder) varint() int64 {
	u := d.uvarint()
	v := int64(u >> 1)
	if u&1 != 0 {
		v = ^v
	}
	return v
}

func (d *decoder) bytes() []byte {
	n := d.uvarint()
	if d.err != nil {
		return nil
	}
	if n > uint64(len(d.b)) {
		d.err = fmt.Errorf("%w: length %d beyond the message", ErrCorrupt, n)
		return nil
	}
	v := d.b[:n:n]
	d.b = d.b[n:]
	return v
}

// Message is a decoded journal message, for tools and the simulation: a
// batch (Items, with its nonce and its writer's boot) or a fence.
type Message struct {
	Nonce uint64
	Boot  string
	Items []Item
	Fence *Fence
}

// Item is one key's record in a batch, with its usage (keyrec.AppendUsage;
// empty: none).
type Item struct {
	Key   string
	Val   []byte
	Usage []byte
}

// Fence says that Node claimed partition Part in Epoch.
type Fence struct {
	Part  int
	Epoch uint64
	Node  string
}

// Decode decodes a journal message; errors wrap ErrCorrupt.
func Decode(b []byte) (Message, error) {
	m, err := decode(b)
	if err != nil {
		return Message{}, err
	}
	out := Message{Nonce: m.nonce, Boot: m.boot}
	for _, it := range m.items {
		out.Items = append(out.Items, Item{Key: it.key, Val: it.val, Usage: it.usageB})
	}
	if f := m.fence; f != nil {
		out.Fence = &Fence{Part: f.part, Epoch: f.epoch, Node: f.node}
	}
	return out, nil
}
