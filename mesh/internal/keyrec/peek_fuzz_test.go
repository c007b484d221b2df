package keyrec

import "testing"

// FuzzPeekPolicy: peeking at a stored value (any bytes in the state
// bucket) never panics, and agrees with Decode on every value Decode
// accepts: the policy, the revision, the version and the open
// reservations.
func FuzzPeekPolicy(f *testing.F) {
	f.Add(Append(nil, new(sampleRecord())))
	f.Add(Append(nil, &Record{}))
	f.Add(Append(nil, new(reservedRecord(f))))
	f.Add([]byte{1})
	f.Add([]byte{2, 200, 200, 200, 200, 200, 200, 200, 200, 200, 1})
	f.Add([]byte{2, 1, 'p', 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01})
	f.Fuzz(func(t *testing.T, b []byte) {
		name, rev, ok := PeekPolicy(b)
		v, vok := PeekVersion(b)
		rname, rv, open, next, rok := PeekReservations(b)
		r, err := Decode(b)
		if err != nil {
			return
		}
		if !ok || !vok || name != r.Policy || rev != r.Revision || v != r.Version {
			t.Fatalf("peek %q@%d v%d (%v %v); Decode %q@%d v%d", name, rev, v, ok, vok, r.Policy, r.Revision, r.Version)
		}
		wantOpen, wantNext := r.OpenReservations()
		if !rok || rname != r.Policy || rv != r.Version || open != wantOpen || next != wantNext {
			t.Fatalf("PeekReservations %q v%d %d open, next %d (%v); Decode %q v%d %d open, next %d",
				rname, rv, open, next, rok, r.Policy, r.Version, wantOpen, wantNext)
		}
	})
}
