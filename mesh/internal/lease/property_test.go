package lease

import (
	"errors"
	"testing"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"pgregory.net/rapid"
)

// held is a grant as a holder of the model sees it.
type held struct {
	id, epoch uint64
	units     int64
	spent     int64 // the holder's true spend
	deadline  int64 // real instant it stops spending
}

// admission is one admitted request of the model, at a real instant.
type admission struct{ at, cost int64 }

// TestBoundProperty drives one leased key's owner (Acquire, Report,
// strict decisions) and several holders (spending their grants to their
// deadlines, reporting, returning honestly, losing messages, crashing)
// through random timelines with failovers (the epoch grows, the record is
// kept: the journal; the new owner's clock differs by up to the margin),
// and checks after every step that outstanding units
// never exceed max_outstanding (L1) and that every grant a holder may
// still spend is counted by the owner (L4: its clock may run up to the
// margin slow), and at the end that over every interval
//
//	admitted(t1, t2) <= burst + rate*(t2 − t1 + J) + max_outstanding
//
// where J adds up the owners' clock jumps forward at failovers (0 on one
// clock).
func TestBoundProperty(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		alg := rapid.SampledFrom([]kvstate.Algorithm{kvstate.TokenBucket, kvstate.GCRA}).Draw(t, "alg")
		rate := rapid.Int64Range(1, 50).Draw(t, "rate") * u
		burst := rapid.Int64Range(1, 60).Draw(t, "burst") * u
		limits := []kvstate.Limit{{Algorithm: alg, Rate: rate, Burst: burst}}
		size := rapid.Int64Range(1, 20).Draw(t, "size") * u
		p := Params{
			Size:           size,
			MaxOutstanding: size + rapid.Int64Range(0, 60).Draw(t, "extra")*u,
			TTL:            rapid.SampledFrom([]int64{100 * ms, s, 2 * s}).Draw(t, "ttl"),
		}
		margin := Margin(p.TTL)
		rec := &keyrec.Record{}
		epoch := uint64(1)
		// now is real time; the owner's clock reads now + off, and each
		// failover brings an owner whose clock is off by another amount
		// within the margin. A clock ahead refills the bucket early by
		// what it jumped (DESIGN.md): jumps adds those up for the bound.
		var now, off, jumps int64
		holders := make([][]held, rapid.IntRange(1, 4).Draw(t, "holders"))
		var adm []admission
		pick := func(h int) int {
			var live []int
			for i, g := range holders[h] {
				if now < g.deadline {
					live = append(live, i)
				}
			}
			if len(live) == 0 {
				return -1
			}
			return rapid.SampledFrom(live).Draw(t, "grant")
		}
		for range rapid.IntRange(50, 300).Draw(t, "steps") {
			h := rapid.IntRange(0, len(holders)-1).Draw(t, "holder")
			// Weighted: traffic-heavy timelines drain the bucket, where a
			// wrong refund or a forgotten grant shows.
			switch op := rapid.IntRange(0, 23).Draw(t, "op"); {
			case op < 2:
				now += rapid.Int64Range(0, p.TTL/4).Draw(t, "advance") / ms * ms
			case op < 4:
				now += rapid.Int64Range(0, 20).Draw(t, "tick") * ms
			case op < 8:
				want := rapid.Int64Range(1, size/u+1).Draw(t, "want") * u
				least := rapid.Int64Range(1, want/u).Draw(t, "min") * u
				r, _ := Acquire(p, limits, rec, now+off, epoch, AcquireReq{Holder: "h", Want: want, Min: least})
				if r.Outcome == Granted {
					// The holder's clock may run slow by up to the
					// margin over the ttl: its real deadline is at
					// most the grant's expiry.
					slow := rapid.Int64Range(0, margin).Draw(t, "slow")
					holders[h] = append(holders[h], held{id: r.Grant.ID, epoch: r.Grant.Epoch, units: r.Grant.Units,
						deadline: HolderDeadline(now, p.TTL) + slow})
				}
			case op < 13:
				if i := pick(h); i >= 0 {
					g := &holders[h][i]
					if left := g.units - g.spent; left >= u {
						c := left
						if !rapid.Bool().Draw(t, "all") {
							c = rapid.Int64Range(1, left/u).Draw(t, "spend") * u
						}
						g.spent += c
						adm = append(adm, admission{now, c})
					}
				}
			case op < 15:
				if i := pick(h); i >= 0 {
					g := holders[h][i]
					_, _, err := Report(p, limits, rec, now+off, epoch, ReportReq{ID: g.id, Epoch: g.epoch, Spent: g.spent})
					if err != nil && !errors.Is(err, ErrStaleEpoch) && !errors.Is(err, ErrUnknownGrant) {
						t.Fatalf("report: %v", err)
					}
				}
			case op < 19:
				if i := pick(h); i >= 0 {
					g := holders[h][i]
					if !rapid.Bool().Draw(t, "lost") {
						_, _, _ = Report(p, limits, rec, now+off, epoch, ReportReq{ID: g.id, Epoch: g.epoch, Spent: g.spent, Return: true})
					}
					holders[h] = append(holders[h][:i], holders[h][i+1:]...)
				}
			case op < 22:
				c := rapid.Int64Range(1, burst/u).Draw(t, "strict") * u
				d, states := kvstate.DecideAll(limits, rec.States, now+off, c, nil)
				if d.Allowed {
					rec.States = states
					adm = append(adm, admission{now, c})
				}
			case op < 23:
				epoch++ // failover: a new owner with the journalled record
				next := rapid.Int64Range(0, margin-1).Draw(t, "offset")
				jumps += max(next-off, 0)
				off = next
			default:
				holders[h] = nil // crash
			}
			if o := Outstanding(rec.Grants, now+off, margin); o > p.MaxOutstanding {
				t.Fatalf("L1: %d outstanding, max %d", o, p.MaxOutstanding)
			}
			for _, hs := range holders {
				for _, g := range hs {
					if now >= g.deadline {
						continue
					}
					og, ok := rec.Grant(g.id)
					if !ok || og.Epoch != g.epoch || now+off >= og.Expires+margin || og.Spent > g.spent {
						t.Fatalf("L4: grant %d (epoch %d) spendable until %d is not counted at %d: %+v %v", g.id, g.epoch, g.deadline, now, og, ok)
					}
				}
			}
		}
		for i := range adm {
			var sum int64
			for j := i; j < len(adm); j++ {
				sum += adm[j].cost
				allow := burst + ceilDiv(rate*(adm[j].at-adm[i].at+jumps), s) + p.MaxOutstanding
				if sum > allow {
					t.Fatalf("admitted %d in [%d, %d], bound %d", sum, adm[i].at, adm[j].at, allow)
				}
			}
		}
	})
}

func ceilDiv(a, b int64) int64 { return (a + b - 1) / b }
