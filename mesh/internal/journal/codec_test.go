package journal

import (
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/ownership"
	"github.com/limitmesh/limitmesh/policies"

	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"strings"
	"testing"
)

// sameItems reports whether a and b hold the same keys and values (a nil
// and an empty value are the same: the format does not tell them apart).
func sameItems(a, b []item) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i].key != b[i].key || !bytes.Equal(a[i].val, b[i].val) || !bytes.Equal(a[i].usageB, b[i].usageB) {
			return false
		}
	}
	return true
}

func TestJournalBatchRoundTrip(t *testing.T) {
	long := strings.Repeat("k", 256) // a two-byte length
	cases := []struct {
		name  string
		nonce uint64
		items []item
	}{
		{"empty", 0, nil},
		{"one", 1, []item{{key: "a", val: []byte("v")}}},
		{"several", math.MaxUint64, []item{
			{key: "p.slow.tenant=a", val: []byte{1, 2, 3}},
			{key: "", val: nil},
			{key: "empty-value", val: []byte{}},
			{key: long, val: bytes.Repeat([]byte{0xff}, 300)},
			{key: "p.slow.tenant=a", val: []byte("again")},
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			b := appendBatch([]byte("prefix"), c.nonce, "boot-1", c.items)
			if !bytes.HasPrefix(b, []byte("prefix")) {
				t.Fatalf("appendBatch did not append to dst: %q", b)
			}
			m, err := decode(b[len("prefix"):])
			if err != nil {
				t.Fatalf("decode: %v", err)
			}
			if m.fence != nil || m.nonce != c.nonce || m.boot != "boot-1" || !sameItems(m.items, c.items) {
				t.Fatalf("decoded %+v, want nonce %d items %+v", m, c.nonce, c.items)
			}
		})
	}
}

func TestJournalFenceRoundTrip(t *testing.T) {
	for _, f := range []fence{
		{part: 0, epoch: 1, node: "n"},
		{part: ownership.MaxPartitions - 1, epoch: math.MaxUint64, node: strings.Repeat("x", 64)},
		{part: 127, epoch: 1 << 40, node: "node-1_A"},
		{part: 128, epoch: 0, node: ""},
	} {
		m, err := decode(appendFence(nil, f))
		if err != nil {
			t.Fatalf("%+v: %v", f, err)
		}
		if m.fence == nil || *m.fence != f || len(m.items) != 0 || m.nonce != 0 {
			t.Fatalf("%+v decoded as %+v (fence %+v)", f, m, m.fence)
		}
	}
}

// The golden bytes are written out from the format comment in codec.go,
// not taken from the encoder: they pin the wire format other nodes (and
// older versions) read.
var (
	goldenBatch = []byte{
		'J', 2, // kind, format
		0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, // nonce, big endian
		0x02, 'b', '7', // boot "b7"
		0x02,                                      // two items
		0x02, 'a', 'b', 0x03, 'x', 'y', 'z', 0x00, // "ab" = "xyz", no usage
		0x01, 'k', 0x00, 0x00, // "k" = "", no usage
	}
	// goldenBatch1 is a batch of format 1: no boot, no usage.
	goldenBatch1 = []byte{
		'J', 1, // kind, format
		0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, // nonce, big endian
		0x02,                                // two items
		0x02, 'a', 'b', 0x03, 'x', 'y', 'z', // "ab" = "xyz"
		0x01, 'k', 0x00, // "k" = ""
	}
	goldenBatchNonce = uint64(0x0102030405060708)
	goldenBatchItems = []item{{key: "ab", val: []byte("xyz")}, {key: "k", val: []byte{}}}

	goldenFence = []byte{
		'F', 1, // kind, version
		0xac, 0x02, // partition 300 = 0b10_0101100: 0x2c|0x80, 0x02
		0xc8, 0x01, // epoch 200 = 0b1_1001000: 0x48|0x80, 0x01
		0x02, 'n', '1', // node "n1"
	}
	goldenFenceValue = fence{part: 300, epoch: 200, node: "n1"}
)

func TestJournalGolden(t *testing.T) {
	if got := appendBatch(nil, goldenBatchNonce, "b7", goldenBatchItems); !bytes.Equal(got, goldenBatch) {
		t.Fatalf("batch encoding\n got %x\nwant %x", got, goldenBatch)
	}
	m, err := decode(goldenBatch)
	if err != nil || m.fence != nil || m.nonce != goldenBatchNonce || m.boot != "b7" || !sameItems(m.items, goldenBatchItems) {
		t.Fatalf("golden batch decoded as %+v, %v", m, err)
	}
	m, err = decode(goldenBatch1)
	if err != nil || m.fence != nil || m.nonce != goldenBatchNonce || m.boot != "" || !sameItems(m.items, goldenBatchItems) {
		t.Fatalf("golden batch of format 1 decoded as %+v, %v", m, err)
	}
	if got := appendFence(nil, goldenFenceValue); !bytes.Equal(got, goldenFence) {
		t.Fatalf("fence encoding\n got %x\nwant %x", got, goldenFence)
	}
	m, err = decode(goldenFence)
	if err != nil || m.fence == nil || *m.fence != goldenFenceValue || m.items != nil {
		t.Fatalf("golden fence decoded as %+v, %v", m, err)
	}
}

// decodeCorrupt decodes b and fails unless it is rejected with an error
// wrapping ErrCorrupt and an empty message.
func decodeCorrupt(t *testing.T, what string, b []byte) {
	t.Helper()
	m, err := decode(b)
	if !errors.Is(err, ErrCorrupt) {
		t.Fatalf("%s (%x): err %v, want ErrCorrupt", what, b, err)
	}
	if m.fence != nil || m.items != nil || m.nonce != 0 {
		t.Fatalf("%s (%x): rejected, but returned %+v", what, b, m)
	}
}

func TestJournalTruncated(t *testing.T) {
	valid := [][]byte{
		goldenBatch,
		goldenFence,
		appendBatch(nil, 7, "b", nil),
		appendBatch(nil, 7, "b", []item{{key: strings.Repeat("k", 256), val: []byte{}}}),
		appendFence(nil, fence{part: ownership.MaxPartitions - 1, epoch: math.MaxUint64, node: "node"}),
	}
	for _, b := range valid {
		if _, err := decode(b); err != nil {
			t.Fatalf("%x: %v", b, err)
		}
		for i := range len(b) {
			decodeCorrupt(t, "truncated", b[:i:i])
		}
	}
}

func TestJournalMalformed(t *testing.T) {
	batch := func(rest ...byte) []byte {
		return append([]byte{'J', 1, 0, 0, 0, 0, 0, 0, 0, 9}, rest...)
	}
	fence := func(part uint64) []byte {
		b := binary.AppendUvarint([]byte{'F', 1}, part)
		return append(b, 1, 1, 'n')
	}
	cases := []struct {
		name string
		b    []byte
	}{
		{"nil", nil},
		{"kind only", []byte{'J'}},
		{"unknown kind", append([]byte{'X'}, goldenBatch[1:]...)},
		{"lower-case kind", append([]byte{'j'}, goldenBatch[1:]...)},
		{"fence kind lower-case", append([]byte{'f'}, goldenFence[1:]...)},
		{"version 0", append([]byte{'J', 0}, goldenBatch[2:]...)},
		{"version 3", append([]byte{'J', 3}, goldenBatch[2:]...)},
		{"fence version 2", append([]byte{'F', 2}, goldenFence[2:]...)},
		{"batch trailing byte", append(bytes.Clone(goldenBatch), 0)},
		{"fence trailing byte", append(bytes.Clone(goldenFence), 'x')},
		{"empty batch trailing byte", append(appendBatch(nil, 1, "", nil), 0)},
		{"count 3, two items", batch(3, 1, 'a', 1, 'b', 1, 'c', 1, 'd')},
		{"count 1, no item", batch(1)},
		{"count beyond the bytes", batch(200, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0)},
		{"count 2^62", binary.AppendUvarint(batch(), 1<<62)},
		{"count max uint64", binary.AppendUvarint(batch(), math.MaxUint64)},
		{"count overflows", batch(0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01)},
		{"key length beyond", batch(1, 5, 'a', 'b', 0)},
		{"value length beyond", batch(1, 1, 'a', 9, 'b')},
		{"value length huge", binary.AppendUvarint(batch(1, 1, 'a'), math.MaxUint64)},
		{"partition 4096", fence(ownership.MaxPartitions)},
		{"partition 2^63", fence(1 << 63)},
		{"partition max uint64", fence(math.MaxUint64)},
		{"fence node length beyond", []byte{'F', 1, 0, 1, 5, 'n'}},
		{"fence without node", []byte{'F', 1, 0, 1}},
	}
	for _, c := range cases {
		decodeCorrupt(t, c.name, c.b)
	}
	// The bound just inside: partition ownership.MaxPartitions-1 decodes.
	if m, err := decode(fence(ownership.MaxPartitions - 1)); err != nil || m.fence.part != ownership.MaxPartitions-1 {
		t.Fatalf("partition %d: %+v, %v", ownership.MaxPartitions-1, m, err)
	}
}

// refDecodeJournal is a naive reference decoder of the format comment in
// journal_codec.go, written independently of decode. canonical is
// false when a length, count or number uses more bytes than needed (the
// decoder accepts those, so they do not re-encode to the same bytes).
func refDecodeJournal(b []byte) (m message, canonical, ok bool) {
	canonical = true
	pos := 0
	num := func() (uint64, bool) {
		var v uint64
		for i := 0; i < 10; i++ {
			if pos >= len(b) {
				return 0, false
			}
			c := b[pos]
			pos++
			if i == 9 && c > 1 {
				return 0, false
			}
			v |= uint64(c&0x7f) << (7 * i)
			if c < 0x80 {
				if i > 0 && c == 0 {
					canonical = false
				}
				return v, true
			}
		}
		return 0, false
	}
	field := func() ([]byte, bool) {
		n, ok := num()
		if !ok || n > uint64(len(b)-pos) {
			return nil, false
		}
		v := b[pos : pos+int(n)]
		pos += int(n)
		return v, true
	}
	if len(b) < 2 || !(b[1] == 1 || b[0] == 'J' && b[1] == 2) {
		return message{}, false, false
	}
	pos = 2
	switch b[0] {
	case 'J':
		if len(b) < 10 {
			return message{}, false, false
		}
		for _, c := range b[2:10] {
			m.nonce = m.nonce<<8 | uint64(c)
		}
		pos = 10
		v2 := b[1] == 2
		if v2 {
			boot, ok := field()
			if !ok {
				return message{}, false, false
			}
			m.boot = string(boot)
		}
		n, ok := num()
		if !ok {
			return message{}, false, false
		}
		for range n {
			k, ok1 := field()
			v, ok2 := field()
			var u []byte
			ok3 := true
			if v2 {
				u, ok3 = field()
			}
			if !ok1 || !ok2 || !ok3 {
				return message{}, false, false
			}
			m.items = append(m.items, item{key: string(k), val: v, usageB: u})
		}
		if !v2 {
			canonical = false // re-encoded in format 2
		}
	case 'F':
		part, ok1 := num()
		epoch, ok2 := num()
		node, ok3 := field()
		if !ok1 || !ok2 || !ok3 || part >= ownership.MaxPartitions {
			return message{}, false, false
		}
		m.fence = &fence{part: int(part), epoch: epoch, node: string(node)}
	default:
		return message{}, false, false
	}
	if pos != len(b) {
		return message{}, false, false
	}
	return m, canonical, true
}

func sameJournalMsg(a, b message) bool {
	if (a.fence == nil) != (b.fence == nil) || a.fence != nil && *a.fence != *b.fence {
		return false
	}
	return a.nonce == b.nonce && a.boot == b.boot && sameItems(a.items, b.items)
}

func encodeJournalMsg(m message) []byte {
	if m.fence != nil {
		return appendFence(nil, *m.fence)
	}
	return appendBatch(nil, m.nonce, m.boot, m.items)
}

// TestJournalNonCanonicalVarint documents that the decoder accepts a
// number written with more bytes than needed (Go's binary.Uvarint does):
// such a message decodes, and re-encodes shorter (here: in format 2, one
// byte longer for the empty boot). No writer produces it.
func TestJournalNonCanonicalVarint(t *testing.T) {
	b := []byte{'J', 1, 0, 0, 0, 0, 0, 0, 0, 1, 0x80, 0x00} // count 0 in two bytes
	m, err := decode(b)
	if err != nil || len(m.items) != 0 || m.nonce != 1 {
		t.Fatalf("%+v, %v", m, err)
	}
	if _, canonical, ok := refDecodeJournal(b); !ok || canonical {
		t.Fatalf("reference: ok %v canonical %v", ok, canonical)
	}
	if re := encodeJournalMsg(m); bytes.Equal(re, b) || len(re) != len(b) {
		t.Fatalf("re-encoded as %x", re)
	}
}

// FuzzDecodeJournal: decoding never panics; it accepts exactly what the
// reference decoder accepts, with the same result; whatever decodes
// re-encodes to the same bytes (when its numbers are minimal, as every
// writer's are) and to a message that decodes the same.
func FuzzDecodeJournal(f *testing.F) {
	f.Add(goldenBatch)
	f.Add(goldenFence)
	f.Add(goldenBatch1)
	f.Add(appendBatch(nil, 0, "", nil))
	f.Add(appendBatch(nil, math.MaxUint64, "boot", []item{{key: strings.Repeat("k", 256), val: nil}, {key: "a", val: []byte("b"), usageB: []byte{0}}}))
	// Usage blocks of form 1 and of form 2 (a reservation's end, cost 0).
	fuzzDesc := policies.Descriptor{{Name: "t", Value: "a"}}
	f.Add(appendBatch(nil, 3, "b", []item{
		{key: "p.p.t=a", val: []byte{1}, usage: []keyrec.Usage{{At: 5, Revision: 3, Cost: 2, Desc: fuzzDesc, RequestID: "q"}}},
		{key: "p.p.t=b", val: []byte{2}, usage: []keyrec.Usage{{At: 6, Revision: 3, Desc: fuzzDesc, Reservation: "r1.00000000002a.p.p.t=b"}, {At: 7, Revision: 3, Cost: 1, Desc: fuzzDesc}}},
	}))
	f.Add(appendFence(nil, fence{part: ownership.MaxPartitions - 1, epoch: math.MaxUint64, node: "n"}))
	f.Add([]byte{'J', 1, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f})
	f.Add([]byte{'F', 1, 0x80, 0x20, 1, 0})
	f.Add([]byte{'J', 1, 0, 0, 0, 0, 0, 0, 0, 1, 0x80, 0x00})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := decode(b)
		ref, canonical, ok := refDecodeJournal(b)
		if (err == nil) != ok {
			t.Fatalf("decode err %v, reference accepts: %v", err, ok)
		}
		if err != nil {
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("error %v does not wrap ErrCorrupt", err)
			}
			return
		}
		if !sameJournalMsg(m, ref) {
			t.Fatalf("decoded %+v, reference %+v", m, ref)
		}
		re := encodeJournalMsg(m)
		if canonical && !bytes.Equal(re, b) {
			t.Fatalf("re-encoded\n got %x\nwant %x", re, b)
		}
		again, err := decode(re)
		if err != nil || !sameJournalMsg(again, m) {
			t.Fatalf("re-encoding decodes as %+v, %v", again, err)
		}
	})
}
