package keyrec

import (
	"testing"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/policies"
)

// reservedRecord has grants (the section before the reservations), two
// open reservations (one with a request_id and a descriptor) and an ended
// one that expires first.
func reservedRecord(t testing.TB) Record {
	r := grantRecord()
	d, err := policies.NewDescriptor([]policies.Dim{{Name: "user", Value: "u1"}})
	if err != nil {
		t.Fatal(err)
	}
	r.ResSeq = 12
	r.Reservations = []Reservation{
		{Seq: 3, Nonce: 5, Units: kvstate.Unit, Revision: 12, At: 1 * kvstate.Second, Expires: 2 * kvstate.Second,
			Outcome: Expired, Settled: kvstate.Unit, EndedAt: 2 * kvstate.Second},
		{Seq: 9, Nonce: 6, Units: 2 * kvstate.Unit, Revision: 12, At: 3 * kvstate.Second, Expires: 9 * kvstate.Second,
			HasReqID: true, ReqID: IDHash("r"), RequestID: "r", Desc: d, Room: []int64{noRoom}},
		{Seq: 12, Nonce: 7, Units: 3 * kvstate.Unit, Revision: 12, At: 4 * kvstate.Second, Expires: 7 * kvstate.Second, Room: []int64{4}},
	}
	return r
}

// TestPeekReservations: peeking at a record's open reservations agrees
// with decoding it whole, for records with and without the section, and
// refuses what is not a record.
func TestPeekReservations(t *testing.T) {
	ended := reservedRecord(t)
	ended.Reservations = ended.Reservations[:1]
	for _, r := range []Record{reservedRecord(t), ended, sampleRecord(), bigRecord(), grantRecord(), {}} {
		b := Append(nil, &r)
		policy, version, open, next, ok := PeekReservations(b)
		wantOpen, wantNext := r.OpenReservations()
		if !ok || policy != r.Policy || version != r.Version || open != wantOpen || next != wantNext {
			t.Errorf("PeekReservations = %q v%d %d open, next %d, %v; want %q v%d %d open, next %d",
				policy, version, open, next, ok, r.Policy, r.Version, wantOpen, wantNext)
		}
	}
	if _, _, open, next, _ := PeekReservations(Append(nil, new(reservedRecord(t)))); open != 2 || next != 7*kvstate.Second {
		t.Errorf("reservedRecord: %d open, next %d; want 2, 7s", open, next)
	}
	b := Append(nil, new(reservedRecord(t)))
	for _, bad := range [][]byte{nil, {0}, {9, 1, 'p'}, b[:len(b)-1]} {
		if _, _, _, _, ok := PeekReservations(bad); ok {
			t.Errorf("PeekReservations(%x) accepted", bad)
		}
	}
}
