package shadow

import (
	"reflect"
	"slices"
	"strings"
	"testing"

	"pgregory.net/rapid"
)

// TestPoolAgreesWithReplay: candidates split over workers count exactly
// what one Replay holding them all counts, through changes of the
// candidate set; the pool's checkpoint restores into one Replay, and one
// Replay's checkpoint into a pool, with the same summaries.
func TestPoolAgreesWithReplay(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		cands := genCandidates(t)
		recs := genRecords(t, 200)
		opt := Options{MaxKeys: rapid.SampledFrom([]int{3, 1000}).Draw(t, "max keys")}
		p := newPool(rapid.IntRange(1, 4).Draw(t, "workers"), opt)
		defer p.stop()
		one := NewReplay(opt)
		cut := rapid.IntRange(0, len(recs)).Draw(t, "change")
		first := cands[:rapid.IntRange(0, len(cands)).Draw(t, "first candidates")]
		p.setCandidates(first)
		one.SetCandidates(first)
		for i := range recs {
			if i == cut {
				p.setCandidates(cands)
				one.SetCandidates(cands)
			}
			p.apply(recs[i : i+1])
			one.Apply(&recs[i])
		}
		if got, want := p.summaries(), one.Summaries(); !reflect.DeepEqual(got, want) {
			t.Fatalf("pool\n%+v\none replay\n%+v", got, want)
		}
		b, sums := p.appendCheckpoint(nil, 7) // summaries by worker
		slices.SortFunc(sums, func(a, b Summary) int { return strings.Compare(a.Policy, b.Policy) })
		if len(sums) == 0 {
			sums = []Summary{}
		}
		if !reflect.DeepEqual(sums, one.Summaries()) {
			t.Fatalf("the checkpoint's summaries\n%+v\nwant\n%+v", sums, one.Summaries())
		}
		back := NewReplay(opt)
		back.SetCandidates(candidatesOf(one))
		if info, err := back.Restore(b); err != nil || info.Seq != 7 {
			t.Fatalf("restore the pool's checkpoint: %+v, %v", info, err)
		}
		if !reflect.DeepEqual(back.Summaries(), one.Summaries()) {
			t.Fatal("the pool's checkpoint restored differs")
		}
		q := newPool(3, opt)
		defer q.stop()
		q.setCandidates(candidatesOf(one))
		if _, err := q.restore(appendCheckpoint(nil, 9, one)); err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(q.summaries(), one.Summaries()) {
			t.Fatal("a Replay's checkpoint restored into a pool differs")
		}
	})
}
