package journal

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/policies"
)

// usageLog records every usage the journal hands its sink, with its
// position.
type usageLog struct {
	mu  sync.Mutex
	got []string
}

func (u *usageLog) Add(node, boot string, seq uint64, idx uint32, key string, record []byte, us *keyrec.Usage) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.got = append(u.got, fmt.Sprintf("%s.%s.j%d.%d %s cost=%d request_id=%q reservation=%q",
		node, boot, seq, idx, key, us.Cost, us.RequestID, us.Reservation))
}

func (u *usageLog) Sync(done func(error)) { done(nil) }

func (u *usageLog) take() []string {
	u.mu.Lock()
	defer u.mu.Unlock()
	got := u.got
	u.got = nil
	return got
}

// readJournal reads node's journal from its mark up to upto with a fresh
// reader (every usage in it goes to the sink).
func readJournal(t *testing.T, j *Journal, node string, upto uint64) {
	t.Helper()
	j.rd.cache = map[string]*sourceRead{}
	if err := wait(t, func(done func(error)) {
		j.rd.read(node, upto, 5*time.Second, func(_ map[string]state, _ uint64, err error) { done(err) })
	}); err != nil {
		t.Fatal(err)
	}
}

// TestJournalledReservationEnds: the usage of a reservation's end
// (CONTRACT §10: its settled cost, 0 for a release, and the reservation's
// id) is journalled with the record that ends it, so a reader of the
// journal (a node adopting it after its owner died) hands the sink the
// same usage at the same position as the writer did: the ledger counts it
// once, with its reservation. A journal written before reservations
// existed (format 2, usage blocks of form 1) reads as it did.
func TestJournalledReservationEnds(t *testing.T) {
	const p = 4
	key := keyIn(p, "")
	j, _, js := testJournal(t)
	sink := &usageLog{}
	j.cfg.Usage = sink
	j.recs.owned[p] = true
	desc, err := policies.NewDescriptor([]policies.Dim{{Name: "k", Value: "0"}})
	if err != nil {
		t.Fatal(err)
	}
	usage := []keyrec.Usage{
		{At: 1, Revision: 1, Cost: 0, Desc: desc, Reservation: "r1.00000000002a." + key}, // released
		{At: 2, Revision: 1, Cost: 1_000_000, Desc: desc, RequestID: "q"},                // an ordinary admission
		{At: 3, Revision: 1, Cost: 2_500_000, Desc: desc, Reservation: "r2.00000000002b." + key},
	}
	if err := wait(t, func(done func(error)) {
		j.w.enqueue(&write{key: key, val: versioned("x", 1), usage: usage, part: p, gen: j.recs.genOf(p),
			deadline: time.Now().Add(10 * time.Second), done: func(_ uint64, err error) { done(err) }})
	}); err != nil {
		t.Fatalf("the write: %v", err)
	}
	committed := sink.take()
	batches := journalBatches(t, js)
	if len(batches) != 1 {
		t.Fatalf("batches %v, want one", batches)
	}
	seq := batches[0]
	var want []string
	for i, u := range usage {
		want = append(want, fmt.Sprintf("me..j%d.%d %s cost=%d request_id=%q reservation=%q", seq, i, key, u.Cost, u.RequestID, u.Reservation))
	}
	if fmt.Sprint(committed) != fmt.Sprint(want) {
		t.Fatalf("committed usage\n%q\nwant\n%q", committed, want)
	}
	readJournal(t, j, "me", seq)
	if got := sink.take(); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("usage read from the journal\n%q\nwant (as committed)\n%q", got, want)
	}

	// A journal of an older node: format 2, a usage block of form 1 (the
	// golden message, with the usage of TestUsageGolden's form 1).
	old := append([]byte(nil), goldenBatch[:len(goldenBatch)-4]...)
	old = append(old, 0x01, 'k', 0x00) // "k" = ""
	form1 := []byte{0x01, 0x0a, 0x03, 0x04, 0x01, 'q', 0x01, 0x01, 't', 0x01, 'a'}
	old = append(append(old, byte(len(form1))), form1...)
	m, err := decode(old)
	if err != nil || len(m.items) != 2 || !bytes.Equal(m.items[1].usageB, form1) {
		t.Fatalf("the old message: %+v, %v", m, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ack, err := js.Publish(ctx, j.subjOf("old"), old)
	if err != nil {
		t.Fatal(err)
	}
	readJournal(t, j, "old", ack.Sequence)
	if got, w := sink.take(), fmt.Sprintf("old.b7.j%d.0 k cost=2 request_id=\"q\" reservation=\"\"", ack.Sequence); fmt.Sprint(got) != "["+w+"]" {
		t.Fatalf("usage of the old message %q, want [%s]", got, w)
	}
}

// A batch whose usage has no reservation is written as before
// reservations: format 2, usage blocks of form 1 (the golden bytes are
// written out from the format comments). One with a reservation has a
// block of form 2 for that item only.
func TestJournalUsageForms(t *testing.T) {
	d, err := policies.NewDescriptor([]policies.Dim{{Name: "t", Value: "a"}})
	if err != nil {
		t.Fatal(err)
	}
	plain := keyrec.Usage{At: 5, Revision: 3, Cost: 2, Desc: d, RequestID: "q"}
	ended := keyrec.Usage{At: 6, Revision: 3, Cost: 0, Desc: d, Reservation: "r1"}
	entry := []byte{0x0a, 0x03, 0x04, 0x01, 'q', 0x01, 0x01, 't', 0x01, 'a'}
	head := []byte{'J', 2, 0, 0, 0, 0, 0, 0, 0, 9, 0x01, 'b', 0x02} // nonce 9, boot "b", two items
	want := append(append([]byte(nil), head...),
		0x01, 'k', 0x01, 'v', byte(1+len(entry)), 0x01)
	want = append(want, entry...)
	want = append(want, 0x01, 'l', 0x00, 0x00) // "l" = "", no usage
	got := appendBatch(nil, 9, "b", []item{{key: "k", val: []byte("v"), usage: []keyrec.Usage{plain}}, {key: "l", val: []byte{}}})
	if !bytes.Equal(got, want) {
		t.Fatalf("a batch without reservations\n got %x\nwant %x", got, want)
	}

	block2 := append([]byte{0x00, 0x02, 0x02}, entry...)
	block2 = append(block2, 0x00) // no reservation
	block2 = append(block2, 0x0c, 0x03, 0x00, 0x00, 0x01, 0x01, 't', 0x01, 'a', 0x02, 'r', '1')
	want = append(append([]byte(nil), head...), 0x01, 'k', 0x01, 'v', byte(len(block2)))
	want = append(want, block2...)
	want = append(want, 0x01, 'l', 0x00, byte(1+len(entry)), 0x01)
	want = append(want, entry...)
	got = appendBatch(nil, 9, "b", []item{
		{key: "k", val: []byte("v"), usage: []keyrec.Usage{plain, ended}},
		{key: "l", val: []byte{}, usage: []keyrec.Usage{plain}},
	})
	if !bytes.Equal(got, want) {
		t.Fatalf("a batch with a reservation\n got %x\nwant %x", got, want)
	}
	m, err := decode(got)
	if err != nil || len(m.items) != 2 {
		t.Fatalf("decode: %+v, %v", m, err)
	}
	for i, wantUs := range [][]keyrec.Usage{{plain, ended}, {plain}} {
		us, err := keyrec.DecodeUsage(m.items[i].usageB)
		if err != nil || fmt.Sprint(us) != fmt.Sprint(wantUs) {
			t.Fatalf("item %d's usage: %+v, %v; want %+v", i, us, err, wantUs)
		}
	}
	// A usage block's length takes more than a byte: the gap widens.
	long := keyrec.Usage{At: 1, Revision: 1, Cost: 0, Desc: d, Reservation: strings.Repeat("r", 128)}
	got = appendBatch(nil, 9, "b", []item{{key: "k", val: []byte("v"), usage: []keyrec.Usage{long, plain}}})
	if m, err := decode(got); err != nil {
		t.Fatal(err)
	} else if us, err := keyrec.DecodeUsage(m.items[0].usageB); err != nil || len(us) != 2 || us[0].Reservation != long.Reservation {
		t.Fatalf("the long block: %+v, %v", us, err)
	}
}
