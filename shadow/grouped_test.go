package shadow

import (
	"reflect"
	"strconv"
	"testing"

	"github.com/limitmesh/limitmesh/internal/usagetest"
	"pgregory.net/rapid"

	"github.com/limitmesh/limitmesh/usage"
)

// The shadow evaluation of the same decisions is the same whether they
// come as v1.1 records or grouped by key (CONTRACT.md §6a): the replay of
// the decoded messages gives identical summaries.
func TestReplayGroupedMatchesRecords(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		cands := genCandidates(t)
		recs := genRecords(t, 300)
		policy := rapid.SampledFrom([]string{"", "live"}).Draw(t, "policy")
		for i := range recs {
			recs[i].ID = "n1.b1." + strconv.Itoa(i)
			if policy != "" {
				recs[i].Revision = 3
				recs[i].Key = "p.live.other"
				if v, ok := recs[i].Descriptor.Get("tenant"); ok {
					recs[i].Key = "p.live.tenant=" + v // carries descriptors of tenant alone
				}
			}
		}
		replay := func(grouped bool) []Summary {
			r := NewReplay(Options{})
			r.SetCandidates(cands)
			for start := 0; start < len(recs); {
				n := min(len(recs)-start, rapid.IntRange(1, 80).Draw(t, "batch"))
				part := recs[start : start+n]
				start += n
				var data []byte
				if grouped {
					data = usage.EncodeGrouped("n1", policy, "n1.b1.live."+strconv.Itoa(start), part)
				} else {
					data = usagetest.AppendBatch(nil, &usage.Batch{Node: "n1", Policy: policy, Records: part})
				}
				b, err := usage.DecodeBatch(data)
				if err != nil {
					t.Fatalf("%v: %s", err, data)
				}
				for i := range b.Records {
					r.Apply(&b.Records[i])
				}
			}
			return r.Summaries()
		}
		if v1, v2 := replay(false), replay(true); !reflect.DeepEqual(v1, v2) {
			t.Fatalf("v1.1 records:\n%+v\ngrouped:\n%+v", v1, v2)
		}
	})
}
