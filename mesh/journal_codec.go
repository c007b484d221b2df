package mesh

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// The encoding of state journal messages (journal.go). Two kinds, each
// starting with a kind byte and a format version:
//
//	batch: 'J' 1 nonce[8] uvarint(n) n × (uvarint(len) key, uvarint(len) value)
//	fence: 'F' 1 uvarint(partition) uvarint(epoch) uvarint(len) node
//
// A batch carries the new records of n keys, committed together; the
// nonce lets the writer recognise its own batch after an unknown outcome.
// A fence says that node claimed partition in epoch: the journal's owner
// must not write that partition's keys any more.

const journalFormat = 1

// errJournalCorrupt is the error of a journal message that does not decode.
var errJournalCorrupt = errors.New("mesh: corrupt state journal message")

// journalItem is one key's record in a batch.
type journalItem struct {
	key string
	val []byte
}

// journalFence is a decoded fence message.
type journalFence struct {
	part  int
	epoch uint64
	node  string
}

// appendJournalBatch appends the encoding of a batch of items to dst.
func appendJournalBatch(dst []byte, nonce uint64, items []journalItem) []byte {
	dst = append(dst, 'J', journalFormat)
	dst = binary.BigEndian.AppendUint64(dst, nonce)
	dst = binary.AppendUvarint(dst, uint64(len(items)))
	for _, it := range items {
		dst = binary.AppendUvarint(dst, uint64(len(it.key)))
		dst = append(dst, it.key...)
		dst = binary.AppendUvarint(dst, uint64(len(it.val)))
		dst = append(dst, it.val...)
	}
	return dst
}

// appendJournalFence appends the encoding of a fence to dst.
func appendJournalFence(dst []byte, f journalFence) []byte {
	dst = append(dst, 'F', journalFormat)
	dst = binary.AppendUvarint(dst, uint64(f.part))
	dst = binary.AppendUvarint(dst, f.epoch)
	dst = binary.AppendUvarint(dst, uint64(len(f.node)))
	return append(dst, f.node...)
}

// journalMsg is a decoded journal message: a batch (items, nonce) or a
// fence (fence != nil). Item keys and values alias the input.
type journalMsg struct {
	nonce uint64
	items []journalItem
	fence *journalFence
}

// decodeJournal decodes one journal message. It never panics; malformed
// input gives an error wrapping errJournalCorrupt.
func decodeJournal(b []byte) (journalMsg, error) {
	var m journalMsg
	if len(b) < 2 || b[1] != journalFormat {
		return m, fmt.Errorf("%w: no header", errJournalCorrupt)
	}
	d := journalDecoder{b: b[2:]}
	switch b[0] {
	case 'J':
		if len(d.b) < 8 {
			return m, fmt.Errorf("%w: short nonce", errJournalCorrupt)
		}
		m.nonce = binary.BigEndian.Uint64(d.b)
		d.b = d.b[8:]
		n := d.uvarint()
		// Every item takes at least two bytes: bound n before allocating.
		if d.err == nil && n > uint64(len(d.b)/2) {
			d.err = fmt.Errorf("%w: %d items in %d bytes", errJournalCorrupt, n, len(d.b))
		}
		if d.err == nil {
			m.items = make([]journalItem, 0, n)
		}
		for i := uint64(0); i < n && d.err == nil; i++ {
			k := d.bytes()
			v := d.bytes()
			if d.err == nil {
				m.items = append(m.items, journalItem{key: string(k), val: v})
			}
		}
	case 'F':
		f := &journalFence{}
		part := d.uvarint()
		f.epoch = d.uvarint()
		f.node = string(d.bytes())
		if d.err == nil && part >= MaxPartitions {
			d.err = fmt.Errorf("%w: partition %d", errJournalCorrupt, part)
		}
		f.part = int(part)
		m.fence = f
	default:
		return m, fmt.Errorf("%w: kind %q", errJournalCorrupt, b[0])
	}
	if d.err == nil && len(d.b) != 0 {
		d.err = fmt.Errorf("%w: %d trailing bytes", errJournalCorrupt, len(d.b))
	}
	if d.err != nil {
		return journalMsg{}, d.err
	}
	return m, nil
}

type journalDecoder struct {
	b   []byte
	err error
}

func (d *journalDecoder) uvarint() uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.b)
	if n <= 0 {
		d.err = fmt.Errorf("%w: bad varint", errJournalCorrupt)
		return 0
	}
	d.b = d.b[n:]
	return v
}

func (d *journalDecoder) bytes() []byte {
	n := d.uvarint()
	if d.err != nil {
		return nil
	}
	if n > uint64(len(d.b)) {
		d.err = fmt.Errorf("%w: length %d beyond the message", errJournalCorrupt, n)
		return nil
	}
	v := d.b[:n:n]
	d.b = d.b[n:]
	return v
}
