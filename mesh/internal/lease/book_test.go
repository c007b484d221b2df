package lease

import (
	"errors"
	"testing"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
)

const (
	u  = kvstate.Unit
	ms = int64(1_000_000)
	s  = kvstate.Second
)

// acme is the Acme contract: 10/s, burst 40; grants of 10, at most 40
// outstanding, ttl 2 s (margin 200 ms).
var (
	acme       = []kvstate.Limit{{Algorithm: kvstate.TokenBucket, Rate: 10 * u, Burst: 40 * u}}
	acmeParams = Params{Size: 10 * u, MaxOutstanding: 40 * u, TTL: 2 * s}
)

// step is one operation of a book timeline.
type step struct {
	at    int64 // ns
	epoch uint64
	// one of:
	acquire *AcquireReq
	report  *ReportReq
	decide  int64 // a strict decision of this cost (micro-units)

	// expectations
	outcome     Outcome // acquire
	units       int64   // acquire: granted; report: refunded
	err         error   // report
	allowed     bool    // decide
	outstanding int64   // after the step, at its instant
}

func runBook(t *testing.T, p Params, limits []kvstate.Limit, steps []step) *keyrec.Record {
	t.Helper()
	rec := &keyrec.Record{}
	for i, st := range steps {
		switch {
		case st.acquire != nil:
			r, _ := Acquire(p, limits, rec, st.at, st.epoch, *st.acquire)
			if r.Outcome != st.outcome || r.Grant.Units != st.units {
				t.Fatalf("step %d: acquire = %v %d units (%+v), want %v %d", i, r.Outcome, r.Grant.Units, r, st.outcome, st.units)
			}
		case st.report != nil:
			refunded, _, err := Report(p, limits, rec, st.at, st.epoch, *st.report)
			if !errors.Is(err, st.err) || err == nil && st.err != nil || refunded != st.units {
				t.Fatalf("step %d: report = %d, %v; want %d, %v", i, refunded, err, st.units, st.err)
			}
		default:
			d, states := kvstate.DecideAll(limits, rec.States, st.at, st.decide, nil)
			if d.Allowed != st.allowed {
				t.Fatalf("step %d: decide %d = %v, want %v", i, st.decide, d.Allowed, st.allowed)
			}
			if d.Allowed {
				rec.States = states
			}
		}
		if got := Outstanding(rec.Grants, st.at, Margin(p.TTL)); got != st.outstanding {
			t.Fatalf("step %d: outstanding %d, want %d", i, got, st.outstanding)
		}
	}
	return rec
}

func acq(holder string, want, least int64) *AcquireReq {
	return &AcquireReq{Holder: holder, Want: want, Min: least}
}

// TestBookAcme: the Acme key hands out grants of 10 until max_outstanding
// (40) is reached; reports lower the outstanding units and make room;
// returns refund into the bucket; the bucket's own envelope still decides
// strict requests; grants expire (with the margin) without a refund.
func TestBookAcme(t *testing.T) {
	runBook(t, acmeParams, acme, []step{
		{at: 0, epoch: 1, acquire: acq("a", 10*u, u), outcome: Granted, units: 10 * u, outstanding: 10 * u},
		{at: 0, epoch: 1, acquire: acq("b", 50*u, u), outcome: Granted, units: 10 * u, outstanding: 20 * u},
		{at: 0, epoch: 1, acquire: acq("a", 10*u, u), outcome: Granted, units: 10 * u, outstanding: 30 * u},
		{at: 0, epoch: 1, acquire: acq("c", 10*u, u), outcome: Granted, units: 10 * u, outstanding: 40 * u},
		// 40 outstanding, and the bucket is empty as well: exhausted
		// (holders deny locally until it refills), not full (which
		// sends every request to the owner).
		{at: 0, epoch: 1, acquire: acq("d", 10*u, u), outcome: Exhausted, outstanding: 40 * u},
		{at: 0, epoch: 1, decide: u, allowed: false, outstanding: 40 * u},
		// Full: 40 outstanding while the bucket holds a unit (100 ms).
		{at: 100 * ms, epoch: 1, acquire: acq("d", 10*u, u), outcome: Full, outstanding: 40 * u},
		// a spent 6 of grant 1: 34 outstanding, room for 6, but the
		// bucket has 1 unit after 100 ms.
		{at: 100 * ms, epoch: 1, report: &ReportReq{ID: 1, Epoch: 1, Spent: 6 * u}, outstanding: 34 * u},
		{at: 100 * ms, epoch: 1, acquire: acq("d", 10*u, u), outcome: Granted, units: u, outstanding: 35 * u},
		{at: 100 * ms, epoch: 1, acquire: acq("d", 10*u, u), outcome: Exhausted, outstanding: 35 * u},
		// A report that goes backwards keeps the larger spend.
		{at: 100 * ms, epoch: 1, report: &ReportReq{ID: 1, Epoch: 1, Spent: 2 * u}, outstanding: 35 * u},
		// b returns grant 2 having spent 4: 6 go back to the bucket.
		{at: 100 * ms, epoch: 1, report: &ReportReq{ID: 2, Epoch: 1, Spent: 4 * u, Return: true}, units: 6 * u, outstanding: 25 * u},
		{at: 100 * ms, epoch: 1, decide: 6 * u, allowed: true, outstanding: 25 * u},
		{at: 100 * ms, epoch: 1, decide: u, allowed: false, outstanding: 25 * u},
		// Returned already: unknown.
		{at: 100 * ms, epoch: 1, report: &ReportReq{ID: 2, Epoch: 1, Spent: 4 * u, Return: true}, err: ErrUnknownGrant, outstanding: 25 * u},
		{at: 100 * ms, epoch: 1, report: &ReportReq{ID: 99, Epoch: 1}, err: ErrUnknownGrant, outstanding: 25 * u},
		{at: 100 * ms, epoch: 1, report: &ReportReq{ID: 1, Epoch: 1, Spent: 11 * u}, err: ErrBadSpend, outstanding: 25 * u},
		// The grants of t=0 still count 200 ms after their expiry (2 s).
		{at: 2199 * ms, epoch: 1, decide: 0, allowed: true, outstanding: 25 * u},
		{at: 2200 * ms, epoch: 1, decide: 0, allowed: true, outstanding: 1 * u},
		// Expired: a return is refused and refunds nothing.
		{at: 2200 * ms, epoch: 1, report: &ReportReq{ID: 3, Epoch: 1, Return: true}, err: ErrUnknownGrant, outstanding: u},
	})
}

// TestBookEpochs: after a failover (epoch 2) the new owner keeps the old
// owner's grants outstanding until they expire, refuses their reports and
// returns (stale epoch), and grants only within the room they leave.
func TestBookEpochs(t *testing.T) {
	rec := runBook(t, acmeParams, acme, []step{
		{at: 0, epoch: 1, acquire: acq("a", 10*u, u), outcome: Granted, units: 10 * u, outstanding: 10 * u},
		{at: 0, epoch: 1, acquire: acq("b", 10*u, u), outcome: Granted, units: 10 * u, outstanding: 20 * u},
		{at: 0, epoch: 1, acquire: acq("c", 10*u, u), outcome: Granted, units: 10 * u, outstanding: 30 * u},
		{at: 500 * ms, epoch: 2, report: &ReportReq{ID: 1, Epoch: 1, Spent: 10 * u}, err: ErrStaleEpoch, outstanding: 30 * u},
		{at: 500 * ms, epoch: 2, report: &ReportReq{ID: 2, Epoch: 1, Return: true}, err: ErrStaleEpoch, outstanding: 30 * u},
		// An id of the old epoch named with the new epoch is unknown.
		{at: 500 * ms, epoch: 2, report: &ReportReq{ID: 2, Epoch: 2}, err: ErrUnknownGrant, outstanding: 30 * u},
		{at: 500 * ms, epoch: 2, acquire: acq("d", 10*u, u), outcome: Granted, units: 10 * u, outstanding: 40 * u},
		{at: 500 * ms, epoch: 2, acquire: acq("d", 10*u, u), outcome: Full, outstanding: 40 * u},
		{at: 500 * ms, epoch: 2, report: &ReportReq{ID: 4, Epoch: 2, Spent: 3 * u, Return: true}, units: 7 * u, outstanding: 30 * u},
		{at: 2200 * ms, epoch: 2, decide: 0, allowed: true, outstanding: 0},
	})
	if rec.GrantSeq != 4 {
		t.Fatalf("grant sequence %d, want 4", rec.GrantSeq)
	}
}

// TestBookLimits: a grant is debited from every limit of the key and
// sized by the one with the least; a cost above a limit's capacity is
// Exhausted with RetryAfter Never; a holder's min above what is held is
// Exhausted with the time it would take.
func TestBookLimits(t *testing.T) {
	limits := []kvstate.Limit{
		{Algorithm: kvstate.TokenBucket, Rate: 10 * u, Burst: 40 * u},
		{Algorithm: kvstate.Quota, Limit: 25 * u, Period: kvstate.Day},
	}
	p := Params{Size: 20 * u, MaxOutstanding: 100 * u, TTL: 2 * s}
	rec := &keyrec.Record{}
	r, _ := Acquire(p, limits, rec, 0, 1, AcquireReq{Holder: "a", Want: 20 * u, Min: u})
	if r.Outcome != Granted || r.Grant.Units != 20*u || r.Remaining != 5*u {
		t.Fatalf("first grant %+v", r)
	}
	r, _ = Acquire(p, limits, rec, 0, 1, AcquireReq{Holder: "a", Want: 20 * u, Min: u})
	if r.Outcome != Granted || r.Grant.Units != 5*u {
		t.Fatalf("second grant %+v, want the quota's last 5", r)
	}
	r, _ = Acquire(p, limits, rec, 0, 1, AcquireReq{Holder: "a", Want: 20 * u, Min: u})
	if r.Outcome != Exhausted || r.RetryAfter != 86400*s {
		t.Fatalf("third %+v, want Exhausted until the day ends", r)
	}
	rec = &keyrec.Record{}
	big := Params{Size: 100 * u, MaxOutstanding: 100 * u, TTL: 2 * s}
	r, _ = Acquire(big, limits, rec, 0, 1, AcquireReq{Holder: "a", Want: 30 * u, Min: 30 * u})
	if r.Outcome != Exhausted || r.RetryAfter != kvstate.Never {
		t.Fatalf("min above capacity: %+v", r)
	}
	r, _ = Acquire(p, limits, rec, 0, 1, AcquireReq{Holder: "a", Want: 50 * u, Min: 21 * u})
	if r.Outcome != Full {
		t.Fatalf("min above the grant size: %+v, want Full", r)
	}
	r, _ = Acquire(p, limits[:1], rec, 0, 1, AcquireReq{Holder: "a", Want: 20 * u, Min: 20 * u})
	r, _ = Acquire(p, limits[:1], rec, 0, 1, AcquireReq{Holder: "a", Want: 20 * u, Min: 20 * u})
	r, _ = Acquire(p, limits[:1], rec, 0, 1, AcquireReq{Holder: "a", Want: 20 * u, Min: 3 * u})
	if r.Outcome != Exhausted || r.RetryAfter != 300*ms {
		t.Fatalf("min 3 on an empty 10/s bucket: %+v, want 300ms", r)
	}
	// 150 ms later the bucket holds 1.5: a holder of whole units gets 1,
	// one that takes half units gets 1.5.
	if r, _ = Acquire(p, limits[:1], rec, 150*ms, 1, AcquireReq{Holder: "a", Want: 20 * u, Min: u}); r.Grant.Units != u {
		t.Fatalf("whole units: %+v", r)
	}
	if r, _ = Acquire(p, limits[:1], rec, 250*ms, 1, AcquireReq{Holder: "a", Want: 20 * u, Min: u / 2}); r.Grant.Units != 3*u/2 {
		t.Fatalf("half units 100 ms later (0.5 + 1 held): %+v", r)
	}
	for _, bad := range []AcquireReq{{Holder: "", Want: u}, {Holder: "a", Want: 0}} {
		if r, _ := Acquire(p, limits, rec, 0, 1, bad); r.Outcome != Exhausted || r.RetryAfter != kvstate.Never {
			t.Fatalf("bad request %+v: %+v", bad, r)
		}
	}
}
