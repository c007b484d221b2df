package keys

import (
	"errors"
	"fmt"
	"testing"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/fail"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/policies"
	"pgregory.net/rapid"
)

func resCall(p *policies.Policy, cost, deadline int64, op *ResOp) *Call {
	c := newCall(p, 0, deadline)
	c.Cost, c.Res = cost, op
	return c
}

// resOwner is an owner core with a one-key store the test drives: each
// call is submitted, written if it must be, and finished.
type resOwner struct {
	t  fataler
	o  *owner
	st storeAt
	// writes counts the record writes; usage the usage entries they
	// carried.
	writes int
	usage  []keyrec.Usage
}

// fataler is what resOwner needs of a *testing.T or *rapid.T.
type fataler interface {
	Helper()
	Fatalf(format string, args ...any)
}

func newResOwner(t fataler, ps ...*policies.Policy) *resOwner {
	ro := &resOwner{t: t, o: newOwner(newFakeEnv(ps...), 8, 0)}
	ro.o.loaded = true // a new key, read already: absent
	return ro
}

// do runs c at now to its end and returns it.
func (ro *resOwner) do(c *Call, now int64) *Call {
	ro.t.Helper()
	ro.o.submit(c)
	a := ro.o.next(now)
	for a.kind == actWrite {
		if len(a.finished) != 0 {
			ro.t.Fatalf("a call finished before the write that holds it")
		}
		ro.writes++
		ro.usage = append(ro.usage, a.usage...)
		if a.rev != ro.st.rev {
			ro.t.Fatalf("write expects rev %d, store at %d", a.rev, ro.st.rev)
		}
		ro.st.seq++
		ro.st.val, ro.st.rev = append([]byte(nil), a.value...), ro.st.seq
		ro.o.written(ro.st.rev, nil)
		a = ro.o.next(now)
	}
	if len(a.finished) != 1 || a.finished[0] != c {
		ro.t.Fatalf("finished %d calls", len(a.finished))
	}
	return c
}

func (ro *resOwner) stored() keyrec.Record {
	ro.t.Helper()
	rec, err := keyrec.Decode(ro.st.val)
	if err != nil {
		ro.t.Fatalf("stored record: %v", err)
	}
	return rec
}

const unit = kvstate.Unit

// TestReserveSettle: a reserve debits its cost and is answered once the
// record holding it is written; settling keeps the settled units spent
// and gives the rest back (never above the burst); a settle sent again
// returns the first outcome and writes nothing; an unknown or wrong-nonce
// id is not found.
func TestReserveSettle(t *testing.T) {
	p := tbPolicy(t, "p", 1, "1/s", 100, "")
	ro := newResOwner(t, p)
	now := int64(1000 * sec)
	op := &ResOp{Kind: ResReserve, Key: "p.p", TTL: 30 * sec, Nonce: 7}
	c := ro.do(resCall(p, 100*unit, now+sec, op), now)
	if !c.Out.Allowed || c.Out.Remaining != 0 || op.Res.Seq == 0 || op.Res.Units != 100*unit || op.Res.Expires != now+30*sec || op.Open != 1 {
		t.Fatalf("reserve: %+v %+v", c.Out, op)
	}
	if rec := ro.stored(); len(rec.Reservations) != 1 || rec.Reservations[0].Nonce != 7 {
		t.Fatalf("stored %+v", rec.Reservations)
	}
	if len(ro.usage) != 0 {
		t.Fatalf("a reserve recorded usage %+v (usage comes at its end)", ro.usage)
	}
	// A decision sees the debit.
	if d := ro.do(newCall(p, 1, now+sec), now); d.Out.Allowed {
		t.Fatalf("decision after reserving the burst: %+v", d.Out)
	}
	// Settle 37 two seconds later: 63 come back on top of the 2 refilled.
	now += 2 * sec
	wrong := &ResOp{Kind: ResSettle, Key: "p.p", Seq: op.Res.Seq, Nonce: 8, Units: 37 * unit}
	if ro.do(resCall(p, 0, now+sec, wrong), now); !wrong.NotFound {
		t.Fatalf("a settle with the wrong nonce: %+v", wrong)
	}
	st := &ResOp{Kind: ResSettle, Key: "p.p", Seq: op.Res.Seq, Nonce: 7, Units: 37 * unit}
	c = ro.do(resCall(p, 0, now+sec, st), now)
	if c.Err != nil || st.Res.Outcome != keyrec.Settled || st.Res.Settled != 37*unit || st.Res.Returned != 63*unit || c.Out.Remaining != 65*unit || st.Open != 0 {
		t.Fatalf("settle: %v %+v %+v", c.Err, st.Res, c.Out)
	}
	if len(ro.usage) != 1 || ro.usage[0].Cost != 37*unit || ro.usage[0].Reservation != keyrec.ReservationID("p.p", op.Res.Seq, 7) {
		t.Fatalf("usage of the end: %+v", ro.usage)
	}
	writes := ro.writes
	again := &ResOp{Kind: ResRelease, Key: "p.p", Seq: op.Res.Seq, Nonce: 7}
	if ro.do(resCall(p, 0, now+sec, again), now); !again.Again || again.Res.Outcome != keyrec.Settled || again.Res.Settled != 37*unit || ro.writes != writes {
		t.Fatalf("release after the settle: %+v, %d writes", again, ro.writes-writes)
	}
	// Settling 60 of a 50 reservation is refused; 50 of 50 refunds nothing.
	op2 := &ResOp{Kind: ResReserve, Key: "p.p", TTL: sec, Nonce: 9}
	ro.do(resCall(p, 50*unit, now+sec, op2), now)
	over := &ResOp{Kind: ResSettle, Key: "p.p", Seq: op2.Res.Seq, Nonce: 9, Units: 60 * unit}
	if c := ro.do(resCall(p, 0, now+sec, over), now); !errors.Is(c.Err, fail.ErrBadRequest) {
		t.Fatalf("settle above the reserved: %v", c.Err)
	}
	full := &ResOp{Kind: ResSettle, Key: "p.p", Seq: op2.Res.Seq, Nonce: 9, Units: -1}
	if c := ro.do(resCall(p, 0, now+sec, full), now); c.Err != nil || full.Res.Settled != 50*unit || full.Res.Returned != 0 || c.Out.Remaining != 15*unit {
		t.Fatalf("settle of the whole: %v %+v %+v", c.Err, full.Res, c.Out)
	}
}

// TestReserveRefundCapped: a bucket that refilled meanwhile gets back only
// up to its burst.
func TestReserveRefundCapped(t *testing.T) {
	p := tbPolicy(t, "p", 1, "10/s", 100, "")
	ro := newResOwner(t, p)
	now := int64(1000 * sec)
	op := &ResOp{Kind: ResReserve, Key: "p.p", TTL: 60 * sec, Nonce: 1}
	ro.do(resCall(p, 80*unit, now+sec, op), now)
	now += 5 * sec // +50: 70 in the bucket
	rel := &ResOp{Kind: ResRelease, Key: "p.p", Seq: op.Res.Seq, Nonce: 1}
	c := ro.do(resCall(p, 0, now+sec, rel), now)
	if c.Out.Remaining != 100*unit || rel.Res.Outcome != keyrec.Released || rel.Res.Returned != 80*unit {
		t.Fatalf("release: %+v %+v", c.Out, rel.Res)
	}
	if len(ro.usage) != 1 || ro.usage[0].Cost != 0 {
		t.Fatalf("usage of a release: %+v", ro.usage)
	}
}

// TestReserveIdempotent: a reserve retried with its request_id gets the
// same reservation and spends once; a denied one is remembered as denied.
func TestReserveIdempotent(t *testing.T) {
	p := tbPolicy(t, "p", 1, "1/s", 10, "")
	ro := newResOwner(t, p)
	now := int64(1000 * sec)
	first := &ResOp{Kind: ResReserve, Key: "p.p", TTL: 30 * sec, Nonce: 1}
	ro.do(withID(resCall(p, 6*unit, now+sec, first), "a"), now)
	retry := &ResOp{Kind: ResReserve, Key: "p.p", TTL: 30 * sec, Nonce: 2}
	c := ro.do(withID(resCall(p, 6*unit, now+sec, retry), "a"), now)
	if !c.Deduped || !c.Out.Allowed || retry.Res.Seq != first.Res.Seq || retry.Res.Nonce != 1 || c.Out.Remaining != 4*unit {
		t.Fatalf("retry: %+v %+v", c.Out, retry.Res)
	}
	denied := &ResOp{Kind: ResReserve, Key: "p.p", TTL: 30 * sec, Nonce: 3}
	if c := ro.do(withID(resCall(p, 6*unit, now+sec, denied), "b"), now); c.Out.Allowed {
		t.Fatal("a reserve beyond the bucket admitted")
	}
	ro.do(newCall(p, 0, now+sec), now)
	now += 10 * sec
	again := &ResOp{Kind: ResReserve, Key: "p.p", TTL: 30 * sec, Nonce: 4}
	if c := ro.do(withID(resCall(p, 6*unit, now+sec, again), "b"), now); c.Out.Allowed || !c.Deduped {
		t.Fatalf("a denied reserve retried: %+v", c.Out)
	}
}

// TestConcurrencySlots: a concurrency limit of 2 admits two holders and
// denies the third until a release, then until the first expiry; an
// expired reservation ends (its units spent in rate limits, its slot back)
// by a sweep, with its usage.
func TestConcurrencySlots(t *testing.T) {
	doc := `{"match":{"tenant":"*"},"limits":[{"algorithm":"concurrency","limit":2},{"algorithm":"token_bucket","rate":"1/s","burst":100}]}`
	p, err := policies.Parse("c", []byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	p.Revision = 1
	ro := newResOwner(t, p)
	now := int64(1000 * sec)
	reserve := func(nonce uint64, ttl int64) (*Call, *ResOp) {
		op := &ResOp{Kind: ResReserve, Key: "p.c", TTL: ttl, Nonce: nonce}
		return ro.do(resCall(p, unit, now+sec, op), now), op
	}
	_, a := reserve(1, 10*sec)
	_, b := reserve(2, 20*sec)
	c, _ := reserve(3, 10*sec)
	if c.Out.Allowed || c.Out.RetryAfter != 10*sec {
		t.Fatalf("third holder: %+v", c.Out)
	}
	rel := &ResOp{Kind: ResRelease, Key: "p.c", Seq: b.Res.Seq, Nonce: 2}
	ro.do(resCall(p, 0, now+sec, rel), now)
	if c, _ := reserve(4, 5*sec); !c.Out.Allowed {
		t.Fatalf("after a release: %+v", c.Out)
	}
	// At +5s the fourth's reservation expires: a sweep ends it.
	now += 5 * sec
	sw := &ResOp{Kind: ResSweep, Key: "p.c"}
	ro.do(resCall(p, 0, now+sec, sw), now)
	if sw.Ended[keyrec.Expired] != 1 || sw.Open != 1 || sw.Next != a.Res.Expires {
		t.Fatalf("sweep: %+v", sw)
	}
	last := ro.usage[len(ro.usage)-1]
	if last.Cost != unit || last.Reservation == "" {
		t.Fatalf("usage of the expiry: %+v", last)
	}
	if c, _ := reserve(5, 5*sec); !c.Out.Allowed {
		t.Fatalf("after the expiry: %+v", c.Out)
	}
	// An expired reservation is not found.
	late := &ResOp{Kind: ResSettle, Key: "p.c", Seq: ro.usageSeq(t, last), Nonce: 4, Units: -1}
	if ro.do(resCall(p, 0, now+sec, late), now); !late.NotFound {
		t.Fatalf("settle after the expiry: %+v", late)
	}
}

// usageSeq returns the reservation sequence a usage entry names.
func (ro *resOwner) usageSeq(t *testing.T, u keyrec.Usage) uint64 {
	_, seq, _, ok := keyrec.ParseReservationID(u.Reservation)
	if !ok {
		t.Fatalf("usage names %q", u.Reservation)
	}
	return seq
}

// TestRenewKeepsTheSlot: a renewed reservation keeps its concurrency slot
// past its first expiry.
func TestRenewKeepsTheSlot(t *testing.T) {
	p, err := policies.Parse("c", []byte(`{"limits":[{"algorithm":"concurrency","limit":1}]}`))
	if err != nil {
		t.Fatal(err)
	}
	p.Revision = 1
	ro := newResOwner(t, p)
	now := int64(1000 * sec)
	op := &ResOp{Kind: ResReserve, Key: "p.c", TTL: 2 * sec, Nonce: 1}
	ro.do(resCall(p, unit, now+sec, op), now)
	now += sec
	rn := &ResOp{Kind: ResRenew, Key: "p.c", Seq: op.Res.Seq, Nonce: 1, TTL: 10 * sec}
	ro.do(resCall(p, 0, now+sec, rn), now)
	if rn.Res.Expires != now+10*sec || rn.Res.Outcome != keyrec.Open {
		t.Fatalf("renew: %+v", rn.Res)
	}
	now += 5 * sec
	other := &ResOp{Kind: ResReserve, Key: "p.c", TTL: 2 * sec, Nonce: 2}
	if c := ro.do(resCall(p, unit, now+sec, other), now); c.Out.Allowed {
		t.Fatal("a second holder got the renewed slot")
	}
	now += 6 * sec
	if c := ro.do(resCall(p, unit, now+sec, other), now); !c.Out.Allowed {
		t.Fatalf("after the renewed expiry: %+v", c.Out)
	}
}

// TestReservationProperty: any sequence of reserves, settles, releases,
// renews, sweeps and time steps leaves the bucket within its burst and the
// concurrency limit within [0, limit], ends each reservation at most once,
// records each end once with its settled units, and keeps the contract
// for the settled costs: the units that stay spent of the reservations
// admitted in any [t1, t2] are at most burst + rate*(t2-t1).
func TestReservationProperty(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		const burst, rate, slots = 20, 2, 40 // units, units/s, concurrent units
		doc := fmt.Sprintf(`{"limits":[{"algorithm":"token_bucket","rate":"%d/s","burst":%d},{"algorithm":"concurrency","limit":%d}]}`, rate, burst, slots)
		p, err := policies.Parse("q", []byte(doc))
		if err != nil {
			rt.Fatal(err)
		}
		p.Revision = 1
		ro := newResOwner(rt, p)
		now := int64(1000 * sec)
		type res struct {
			seq, nonce uint64
			at, units  int64
			spent      int64 // units that stay spent (reserved while open)
			expires    int64
			ended      bool
		}
		var all []*res
		nonce := uint64(0)
		for step := 0; step < 100; step++ {
			switch rapid.IntRange(0, 6).Draw(rt, "op") {
			case 0, 1:
				nonce++
				cost := rapid.Int64Range(1, 8*unit).Draw(rt, "cost")
				ttl := rapid.Int64Range(1, 20).Draw(rt, "ttl") * sec / 4
				op := &ResOp{Kind: ResReserve, Key: "p.q", TTL: ttl, Nonce: nonce}
				if c := ro.do(resCall(p, cost, now+sec, op), now); c.Out.Allowed {
					all = append(all, &res{seq: op.Res.Seq, nonce: nonce, at: now, units: cost, spent: cost, expires: op.Res.Expires})
				}
			case 2, 3:
				if len(all) == 0 {
					continue
				}
				// Mostly the latest reservations, which are likelier open.
				r := all[max(len(all)-1-rapid.IntRange(0, 3).Draw(rt, "back"), rapid.IntRange(0, len(all)-1).Draw(rt, "which")*rapid.IntRange(0, 1).Draw(rt, "old"))]
				kind := []ResKind{ResSettle, ResRelease, ResRenew}[rapid.IntRange(0, 2).Draw(rt, "kind")]
				units := rapid.Int64Range(-1, r.units).Draw(rt, "units")
				op := &ResOp{Kind: kind, Key: "p.q", Seq: r.seq, Nonce: r.nonce, Units: units, TTL: sec}
				c := ro.do(resCall(p, 0, now+sec, op), now)
				switch {
				case c.Err != nil:
					rt.Fatalf("%v", c.Err)
				case op.NotFound:
					if !r.ended && now < r.expires {
						rt.Fatalf("open reservation %d not found before its expiry", r.seq)
					}
				case op.Again:
					if !r.ended {
						rt.Fatalf("open reservation %d answered as ended", r.seq)
					}
				case kind == ResRenew:
					r.expires = op.Res.Expires
				default:
					if r.ended {
						rt.Fatalf("reservation %d ended twice", r.seq)
					}
					want := units
					if kind == ResRelease {
						want = 0
					} else if units == -1 {
						want = r.units
					}
					if op.Res.Settled != want {
						rt.Fatalf("settled %d, want %d", op.Res.Settled, want)
					}
					r.ended, r.spent = true, want
				}
			case 4:
				ro.do(resCall(p, 0, now+sec, &ResOp{Kind: ResSweep, Key: "p.q"}), now)
			case 5:
				// Small steps, or long enough to fill the bucket again.
				now += rapid.SampledFrom([]int64{1, 250, 2000, 15_000}).Draw(rt, "ms") * (sec / 1000)
			case 6:
				// A plain admission (a decide) between reservations: the
				// policy has a concurrency limit, so decide it as a
				// reservation settled at once, in full.
				nonce++
				cost := rapid.Int64Range(1, 8*unit).Draw(rt, "cost")
				op := &ResOp{Kind: ResReserve, Key: "p.q", TTL: sec, Nonce: nonce}
				if c := ro.do(resCall(p, cost, now+sec, op), now); c.Out.Allowed {
					ro.do(resCall(p, 0, now+sec, &ResOp{Kind: ResSettle, Key: "p.q", Seq: op.Res.Seq, Nonce: nonce, Units: -1}), now)
					all = append(all, &res{seq: op.Res.Seq, nonce: nonce, at: now, units: cost, spent: cost, expires: op.Res.Expires, ended: true})
				}
			}
			rec := ro.o.rec
			if len(rec.States) > 0 {
				if tb := kvstate.Advance(p.Limits[0].Limit, rec.States[0], now); tb.Tokens > burst*unit {
					rt.Fatalf("bucket holds %d > burst", tb.Tokens)
				}
			}
			if len(rec.States) > 1 {
				var held int64
				for _, h := range kvstate.Advance(p.Limits[1].Limit, rec.States[1], now).Holds {
					held += h.Cost
				}
				if held < 0 || held > slots*unit {
					rt.Fatalf("concurrency holds %d", held)
				}
			}
		}
		// Each end recorded once, with its settled units.
		ends := map[string]int{}
		for _, u := range ro.usage {
			ends[u.Reservation]++
			if ends[u.Reservation] > 1 {
				rt.Fatalf("reservation %s recorded twice", u.Reservation)
			}
			_, seq, _, _ := keyrec.ParseReservationID(u.Reservation)
			for _, r := range all {
				if r.seq == seq && r.ended && u.Cost != r.spent {
					rt.Fatalf("reservation %d recorded %d, settled %d", seq, u.Cost, r.spent)
				}
			}
		}
		// The contract over the reservations' admission instants.
		for i, a := range all {
			var sum int64
			for _, b := range all[i:] {
				sum += b.spent
				if sum > burst*unit+rate*unit*(b.at-a.at)/sec {
					rt.Fatalf("%d units spent between %d and %d", sum, a.at, b.at)
				}
			}
		}
	})
}

// TestSettleGivesBackNoMoreThanNeverTaken: a reservation made on a full
// bucket that refills meanwhile, then drained by other admissions, gets
// back on release only what the bucket would hold had it never been made
// (its least headroom since: 0 here), not up to the burst: otherwise the
// key admits more than burst + rate × span.
func TestSettleGivesBackNoMoreThanNeverTaken(t *testing.T) {
	p := tbPolicy(t, "p", 1, "2/s", 20, "")
	ro := newResOwner(t, p)
	now := int64(1000 * sec)
	a := &ResOp{Kind: ResReserve, Key: "p.p", TTL: 60 * sec, Nonce: 1}
	ro.do(resCall(p, 8*unit, now+sec, a), now) // 12 left
	now += 15 * sec                            // full again: 20
	for range 2 {
		if c := ro.do(newCall(p, 8, now+sec), now); !c.Out.Allowed {
			t.Fatal("decide on a full bucket denied")
		}
	} // 4 left
	rel := &ResOp{Kind: ResRelease, Key: "p.p", Seq: a.Res.Seq, Nonce: 1}
	c := ro.do(resCall(p, 0, now+sec, rel), now)
	if rel.Res.Outcome != keyrec.Released || rel.Res.Returned != 8*unit || c.Out.Remaining != 4*unit {
		t.Fatalf("release: %+v, remaining %d; want 4 left: the bucket was full since, nothing comes back", rel.Res, c.Out.Remaining)
	}
	// Made on a bucket that stayed below full, the whole is given back.
	b := &ResOp{Kind: ResReserve, Key: "p.p", TTL: 60 * sec, Nonce: 2}
	ro.do(resCall(p, 4*unit, now+sec, b), now) // 0 left
	now += sec                                 // 2
	ro.do(newCall(p, 1, now+sec), now)         // 1
	rel = &ResOp{Kind: ResRelease, Key: "p.p", Seq: b.Res.Seq, Nonce: 2}
	if c := ro.do(resCall(p, 0, now+sec, rel), now); c.Out.Remaining != 5*unit {
		t.Fatalf("release gave back %d, want 4 (remaining 5)", c.Out.Remaining-unit)
	}
}
