package usage

import (
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/limitmesh/limitmesh/internal/wire"
	"pgregory.net/rapid"
)

// genRecords draws the decisions of one batch of policy: a few keys, some
// with descriptors their key carries, some not; revisions, costs and
// results vary; some are journalled by one of two origins (in increasing
// position per origin, as the publisher takes them), some have request
// ids or ids of their own, some allowed ones end a reservation (and may
// cost 0).
func genRecords(t *rapid.T, policy string) []Record {
	n := rapid.IntRange(1, 200).Draw(t, "n")
	nkeys := rapid.IntRange(1, 8).Draw(t, "keys")
	t0 := rapid.Int64Range(5000, 1<<52).Draw(t, "t0")
	origins := []string{"n1.b1", "n2.b9"}
	pos := []JournalPos{{JSeq: 10}, {JSeq: 500, Idx: 3}}
	var out []Record
	for i := 0; i < n; i++ {
		k := rapid.IntRange(0, nkeys-1).Draw(t, "key")
		r := Record{
			TimeUs:   t0 + rapid.Int64Range(-5000, 5000).Draw(t, "dt"),
			Revision: uint64(rapid.IntRange(1, 2).Draw(t, "rev")),
			Cost:     []int64{1_000_000, 1_000_000, 2_500_000, 1, 1_000_000_000_000_000}[rapid.IntRange(0, 4).Draw(t, "cost")],
			Allowed:  rapid.Bool().Draw(t, "allowed"),
		}
		val := "v" + strconv.Itoa(k)
		if k%3 == 2 {
			val = "a.b_" + strconv.Itoa(k) // escaped in the key
		}
		switch {
		case policy == "":
			r.Descriptor = desc(t, "tenant", val)
		case k%4 == 3: // a dimension the key does not hold
			r.Key = "p." + policy + ".tenant=" + string(escapeForTest(val))
			r.Descriptor = desc(t, "tenant", val, "user", "u"+strconv.Itoa(rapid.IntRange(0, 2).Draw(t, "user")))
		default:
			r.Key = "p." + policy + ".tenant=" + string(escapeForTest(val))
			r.Descriptor = desc(t, "tenant", val)
		}
		switch rapid.IntRange(0, 5).Draw(t, "id") {
		case 0, 1:
			o := rapid.IntRange(0, 1).Draw(t, "origin")
			if rapid.IntRange(0, 3).Draw(t, "jump") == 0 {
				pos[o].JSeq += uint64(rapid.IntRange(1, 3).Draw(t, "jseq"))
				pos[o].Idx = 0
			}
			node, boot, _ := strings.Cut(origins[o], ".")
			r.ID = JournalID(node, boot, pos[o].JSeq, pos[o].Idx)
			pos[o].Idx += uint32(rapid.IntRange(1, 2).Draw(t, "idx"))
		case 2:
			r.ID = "custom-" + strconv.Itoa(i)
		}
		if rapid.IntRange(0, 4).Draw(t, "rid") == 0 {
			r.RequestID = "req \"" + strconv.Itoa(i) + "\" ü"
		}
		if r.Allowed && rapid.IntRange(0, 3).Draw(t, "reservation") == 0 {
			r.Reservation = "res-" + strconv.Itoa(i) + " \\ é"
			if rapid.Bool().Draw(t, "released") {
				r.Cost = 0
			}
		}
		out = append(out, r)
	}
	return out
}

// escapeForTest escapes a value as KEYS.md says.
func escapeForTest(v string) []byte {
	var out []byte
	for i := 0; i < len(v); i++ {
		c := v[i]
		if c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' {
			out = append(out, c)
		} else {
			out = append(out, '_', "0123456789abcdef"[c>>4], "0123456789abcdef"[c&15])
		}
	}
	return out
}

// withDerivedIDs returns records with the ids a grouped message of batch
// gives the records that have none.
func withDerivedIDs(records []Record, batch string) []Record {
	out := append([]Record(nil), records...)
	for i := range out {
		if out[i].ID == "" {
			out[i].ID = batch + "." + strconv.Itoa(i)
		}
	}
	return out
}

// Every v1.1 field of every decision comes back from a grouped message,
// exactly (CONTRACT.md §6a), and its groups' totals are its decisions'.
func TestGroupedRoundTrip(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		policy := rapid.SampledFrom([]string{"acme", "", "j5"}).Draw(t, "policy")
		records := genRecords(t, policy)
		const batch = "n1.b1.acme.7"
		data := EncodeGrouped("n1", policy, batch, records)
		if !json.Valid(data) {
			t.Fatalf("not JSON: %s", data)
		}
		b, err := DecodeBatch(data)
		if err != nil {
			t.Fatalf("%v\n%s", err, data)
		}
		want := withDerivedIDs(records, batch)
		if b.Node != "n1" || b.Policy != policy || !reflect.DeepEqual(b.Records, want) {
			t.Fatalf("round trip of %s\n got %+v\nwant %+v", data, b.Records, want)
		}
		// The v1.1 view is the same bytes as the records encoded one by one.
		if v1, v2 := appendBatch(nil, &Batch{Node: "n1", Policy: policy, Records: want}), appendBatch(nil, &b); string(v1) != string(v2) {
			t.Fatalf("v1.1 views differ:\n%s\n%s", v1, v2)
		}
		var sumA, sumD int64
		for _, g := range b.Groups {
			sumA += g.Allowed
			sumD += g.Denied
		}
		var a, d int64
		for _, r := range records {
			if r.Allowed {
				a++
			} else {
				d++
			}
		}
		if sumA != a || sumD != d {
			t.Fatalf("groups hold %d allowed, %d denied; the records %d, %d", sumA, sumD, a, d)
		}
	})
}

// A grouped message that contradicts itself is refused, naming the field.
func TestGroupedRejects(t *testing.T) {
	good := `{"node":"n1","policy":"p","batch":"n1.b.p.1","t_us":100,"span_us":10,"n":3,` +
		`"keys":["tenant=a","tenant=b"],"revisions":[1,1],"allowed":[1,1],"allowed_units":[1,0],"denied":[1,0],"denied_units":[2,0],` +
		`"costs":[[1,2],0],"results":["Ad","a"],` +
		`"order":[0,1,0],"dt_us":[0,10,-5],"origins":["n1.b"],"journal":[0,7,0,1],"request_ids":[[1,"r"]],"reservations":[[1,"res-1"]]}`
	b, err := DecodeBatch([]byte(good))
	if err != nil {
		t.Fatalf("the good message: %v", err)
	}
	if r := b.Records[1]; r.Cost != 0 || r.Reservation != "res-1" || !r.Allowed || b.Records[0].Reservation != "" || b.Records[2].Reservation != "" {
		t.Fatalf("the good message's records: %+v", b.Records)
	}
	cases := []struct{ name, from, to, want string }{
		{"totals disagree", `"denied_units":[2,0]`, `"denied_units":[3,0]`, "totals disagree"},
		{"count disagrees", `"allowed":[1,1]`, `"allowed":[1,2]`, "totals disagree"},
		{"offset before the batch", `"dt_us":[0,10,-5]`, `"dt_us":[0,10,-11]`, "outside the batch"},
		{"offset after the batch", `"dt_us":[0,10,-5]`, `"dt_us":[0,11,-5]`, "outside the batch"},
		{"order out of range", `"order":[0,1,0]`, `"order":[0,2,0]`, "names group 2"},
		{"n disagrees", `"n":3`, `"n":4`, "n is 4"},
		{"results too short", `"results":["Ad","a"]`, `"results":["Ad",""]`, "letters"},
		{"bad letter", `"results":["Ad","a"]`, `"results":["Ax","a"]`, "not one of"},
		{"costs too short", `"costs":[[1,2],0]`, `"costs":[[1],0]`, "costs for"},
		{"costs empty", `"costs":[[1,2],0]`, `"costs":[[],0]`, "empty array"},
		{"negative cost", `"costs":[[1,2],0]`, `"costs":[[1,2],-1]`, "not a cost"},
		{"cost 0 without a reservation", `"reservations":[[1,"res-1"]]`, `"reservations":[[2,"res-1"]]`, "decision 1 is 0 and the record ends no reservation"},
		{"cost 0 and no reservations", `,"reservations":[[1,"res-1"]]`, ``, "decision 1 is 0"},
		{"a cost of 0 in a list", `"allowed_units":[1,0],"denied":[1,0],"denied_units":[2,0],"costs":[[1,2],0]`,
			`"allowed_units":[0,0],"denied":[1,0],"denied_units":[2,0],"costs":[[0,2],0]`, "decision 0 is 0 and the record ends no reservation"},
		{"reservation index", `"reservations":[[1,"res-1"]]`, `"reservations":[[3,"res-1"]]`, "reservations: index 3 is out of order or range"},
		{"reservations out of order", `"reservations":[[1,"res-1"]]`, `"reservations":[[1,"res-1"],[0,"res-0"]]`, "index 0 is out of order"},
		{"reservation twice", `"reservations":[[1,"res-1"]]`, `"reservations":[[1,"res-1"],[1,"res-2"]]`, "index 1 is out of order"},
		{"empty reservation", `"reservations":[[1,"res-1"]]`, `"reservations":[[1,""]]`, "has one that is empty"},
		{"long reservation", `"reservations":[[1,"res-1"]]`, `"reservations":[[1,"` + strings.Repeat("r", 129) + `"]]`, "129 bytes (at most 128)"},
		{"control reservation", `"reservations":[[1,"res-1"]]`, `"reservations":[[1,"res\u0007"]]`, "control character"},
		{"reservation not a string", `"reservations":[[1,"res-1"]]`, `"reservations":[[1,7]]`, "reservations"},
		{"reservations given twice", `"reservations":[[1,"res-1"]]`, `"reservations":[[1,"res-1"]],"reservations":[[1,"res-1"]]`, "given twice"},
		{"column too short", `"revisions":[1,1]`, `"revisions":[1]`, "entries for 2 keys"},
		{"column missing", `"revisions":[1,1],`, ``, "revisions: missing"},
		{"journal short", `"journal":[0,7,0,1]`, `"journal":[]`, "fewer decisions"},
		{"journal long", `"journal":[0,7,0,1]`, `"journal":[0,7,0,2]`, "more decisions"},
		{"journal origin", `"journal":[0,7,0,1]`, `"journal":[1,7,0,1]`, "out of range"},
		{"journal without origins", `"origins":["n1.b"],`, ``, "go together"},
		{"records and keys", `"n":3,`, `"n":3,"records":[],`, "given with"},
		{"request id index", `"request_ids":[[1,"r"]]`, `"request_ids":[[3,"r"]]`, "out of order or range"},
		{"descriptor not carried", `"keys":["tenant=a","tenant=b"]`, `"keys":["tenant=a","_overflow"]`, "does not carry it"},
		{"key of policy ''", `"policy":"p"`, `"policy":""`, `must be ""`},
		{"bad key", `"keys":["tenant=a","tenant=b"]`, `"keys":["tenant=a","a..b"]`, "not a valid KV key"},
		{"missing span", `"span_us":10,`, ``, "span_us: missing"},
		{"units not canonical", `"allowed_units":[1,0]`, `"allowed_units":[1.0,0]`, "not a decimal"},
		{"no decision", `"order":[0,1,0]`, `"order":[0,0,0]`, "no decision"},
		{"full key not blank", `"n":3,`, `"n":3,"full_keys":[[0,"x"]],`, "is not"},
		{"descriptor index", `"n":3,`, `"n":3,"descriptors":[[2,{"a":"b"}]],`, "out of order or range"},
	}
	for _, c := range cases {
		msg := strings.Replace(good, c.from, c.to, 1)
		if msg == good {
			t.Fatalf("%s: %q not in the message", c.name, c.from)
		}
		_, err := DecodeBatch([]byte(msg))
		if err == nil || !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: got %v, want an ErrInvalid naming %q", c.name, err, c.want)
		}
	}
}

// The publisher's encoding of a typical batch: grouped, a decision costs
// a small part of its v1.1 record.
func TestGroupedSize(t *testing.T) {
	var records []Record
	for i := 0; i < 10000; i++ {
		k := strconv.Itoa((i * i) % 1500) // about 6.7 decisions per key
		records = append(records, Record{
			ID: JournalID("n1", "0123456789abcdef", uint64(100+i/50), uint32(i%50)), TimeUs: 1764752400123456 + int64(i*25), Revision: 3,
			Key: "p.bench-strict-1043464d.key=k" + k, Descriptor: desc(t, "key", "k"+k), Cost: 1_000_000, Allowed: i%4 != 0,
		})
	}
	v1 := appendBatch(nil, &Batch{Node: "n1", Policy: "bench-strict-1043464d", Records: records})
	v2 := EncodeGrouped("n1", "bench-strict-1043464d", "n1.0123456789abcdef.bench-strict-1043464d.17", records)
	t.Logf("v1.1 %.1f bytes per decision, grouped %.1f", float64(len(v1))/10000, float64(len(v2))/10000)
	if len(v2)*5 > len(v1) {
		t.Fatalf("grouped %d bytes, v1.1 %d: not a fifth", len(v2), len(v1))
	}
}

// The ledger counts the same decisions the same whether they come as v1.1
// records or grouped by key: every stored byte (totals, watermarks) is
// the same, through republished journal positions, batches over two days
// and redelivery after a crash.
func TestLedgerGroupedMatchesRecords(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		policy := rapid.SampledFrom([]string{"acme", ""}).Draw(t, "policy")
		origins := []string{"n1.b1", "n2.b2"}
		next := []JournalPos{{JSeq: 5}, {JSeq: 9}} // per origin: the next new position
		var v1, v2 []stored
		nmsg := rapid.IntRange(1, 6).Draw(t, "messages")
		tUs := day0 - 3000
		for m := 0; m < nmsg; m++ {
			var records []Record
			n := rapid.IntRange(1, 40).Draw(t, "records")
			o := rapid.IntRange(0, 1).Draw(t, "origin")
			// A run of journalled positions of origin o, starting at or
			// before its next new one (published again by another node).
			back := uint32(rapid.IntRange(0, 3).Draw(t, "back"))
			pos := next[o]
			if pos.Idx >= back {
				pos.Idx -= back
			}
			for i := 0; i < n; i++ {
				tUs += rapid.Int64Range(0, 400).Draw(t, "dt")
				k := rapid.IntRange(0, 3).Draw(t, "key")
				r := Record{TimeUs: tUs, Revision: 1, Cost: int64(rapid.IntRange(0, 3).Draw(t, "cost")) * 500_000,
					Allowed: rapid.Bool().Draw(t, "allowed"), Descriptor: desc(t, "tenant", "t"+strconv.Itoa(k))}
				switch {
				case r.Cost == 0 && !r.Allowed:
					r.Cost = 500_000
				case r.Cost == 0 || r.Allowed && rapid.IntRange(0, 3).Draw(t, "settled") == 0:
					r.Reservation = "r." + strconv.Itoa(m) + "." + strconv.Itoa(i) // a reservation's end (a release when it costs 0)
				}
				if policy != "" {
					r.Key = "p." + policy + ".tenant=t" + strconv.Itoa(k)
				}
				if r.Allowed && rapid.Bool().Draw(t, "journalled") {
					node, boot, _ := strings.Cut(origins[o], ".")
					r.ID = JournalID(node, boot, pos.JSeq, pos.Idx)
					pos.Idx++
					if next[o].Less(pos) {
						next[o] = pos
					}
				} else {
					r.ID = "n3.b3." + strconv.Itoa(m) + "." + strconv.Itoa(i)
				}
				records = append(records, r)
			}
			seq := uint64(m + 1)
			v1 = append(v1, stored{seq, Batch{Node: "n1", Policy: policy, Records: records}})
			b, err := DecodeBatch(EncodeGrouped("n1", policy, "n1.b1.x."+strconv.Itoa(m), records))
			if err != nil {
				t.Fatal(err)
			}
			v2 = append(v2, stored{seq, b})
		}
		crash := rapid.IntRange(-1, 4).Draw(t, "crash")
		split := rapid.IntRange(0, nmsg).Draw(t, "split")
		run := func(msgs []stored) *memLedger {
			l := newMemLedger()
			if runGroup(t, l, nil, msgs[:split], crash) == nil {
				runGroup(t, l, nil, msgs[:split], -1) // delivered again after the crash
			}
			runGroup(t, l, nil, msgs[split:], -1)
			return l
		}
		l1, l2 := run(v1), run(v2)
		if fmt.Sprint(l1.vals) != fmt.Sprint(l2.vals) {
			for k, v := range l1.vals {
				if string(l2.vals[k]) != string(v) {
					t.Fatalf("%s: v1.1 %s, grouped %s", k, v, l2.vals[k])
				}
			}
			t.Fatalf("the ledgers differ: %d entries against %d", len(l1.vals), len(l2.vals))
		}
	})
}

// The example of docs/contract.md §6a decodes to the records it describes.
func TestGroupedContractExample(t *testing.T) {
	msg := `{"node": "n1", "policy": "acme-search", "batch": "n1.3f2a9c01d2e4b5a6.acme-search.17",
 "t_us": 1764752400123456, "span_us": 230, "n": 4,
 "keys": ["operation=search.plan=v7.tenant=acme", "operation=search.plan=v7.tenant=birch"],
 "revisions": [12, 12], "allowed": [2, 1], "allowed_units": [6, 2.5], "denied": [1, 0], "denied_units": [3, 0],
 "costs": [3, [2.5]], "results": ["AaD", "a"],
 "descriptors": [[1, {"tenant": "birch", "operation": "search", "plan": "v7", "user": "u1"}]],
 "order": [0, 1, 0, 0], "dt_us": [0, 200, -50, 80],
 "origins": ["n1.3f2a9c01d2e4b5a6"], "journal": [0, 8812, 4, 2],
 "request_ids": [[1, "7f1c2e"]]}`
	b, err := DecodeBatch([]byte(msg))
	if err != nil {
		t.Fatal(err)
	}
	got := string(appendBatch(nil, &Batch{Node: b.Node, Policy: b.Policy, Records: b.Records}))
	want := `{"node":"n1","policy":"acme-search","records":[` +
		`{"id":"n1.3f2a9c01d2e4b5a6.j8812.4","t_us":1764752400123456,"revision":12,"key":"p.acme-search.operation=search.plan=v7.tenant=acme","descriptor":{"operation":"search","plan":"v7","tenant":"acme"},"cost":3,"result":"allowed"},` +
		`{"id":"n1.3f2a9c01d2e4b5a6.acme-search.17.1","t_us":1764752400123656,"revision":12,"key":"p.acme-search.operation=search.plan=v7.tenant=birch","descriptor":{"operation":"search","plan":"v7","tenant":"birch","user":"u1"},"cost":2.5,"result":"allowed","request_id":"7f1c2e"},` +
		`{"id":"n1.3f2a9c01d2e4b5a6.acme-search.17.2","t_us":1764752400123606,"revision":12,"key":"p.acme-search.operation=search.plan=v7.tenant=acme","descriptor":{"operation":"search","plan":"v7","tenant":"acme"},"cost":3,"result":"allowed"},` +
		`{"id":"n1.3f2a9c01d2e4b5a6.j8812.5","t_us":1764752400123686,"revision":12,"key":"p.acme-search.operation=search.plan=v7.tenant=acme","descriptor":{"operation":"search","plan":"v7","tenant":"acme"},"cost":3,"result":"denied"}]}`
	if got != want {
		t.Fatalf("got\n%s\nwant\n%s", got, want)
	}
}

// benchGrouped is a bench-shaped grouped message: 10,000 decisions over
// 1,500 keys, three in four journalled.
func benchGrouped(b testing.TB) []byte {
	var records []Record
	for i := 0; i < 10000; i++ {
		k := strconv.Itoa((i * i) % 1500)
		r := Record{TimeUs: 1764752400123456 + int64(i*25), Revision: 3,
			Key: "p.bench-strict-1043464d.key=k" + k, Descriptor: desc(b, "key", "k"+k), Cost: 1_000_000, Allowed: i%4 != 0}
		if r.Allowed {
			r.ID = JournalID("n1", "0123456789abcdef", uint64(100+i/50), uint32(i%50))
		}
		records = append(records, r)
	}
	return EncodeGrouped("n1", "bench-strict-1043464d", "n1.0123456789abcdef.bench-strict-1043464d.17", records)
}

func BenchmarkDecodeGrouped(b *testing.B) {
	data := benchGrouped(b)
	b.SetBytes(int64(len(data)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := DecodeBatch(data); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N*10000)/b.Elapsed().Seconds(), "records/s")
}

func BenchmarkEncodeGrouped(b *testing.B) {
	data := benchGrouped(b)
	batch, err := DecodeBatch(data)
	if err != nil {
		b.Fatal(err)
	}
	es := make([]entry, len(batch.Records))
	for i, r := range batch.Records {
		es[i].r = r
		if _, pos, ok := ParseJournalID(r.ID); ok {
			es[i].r.ID = ""
			es[i].node, es[i].boot, es[i].pos = "n1", "0123456789abcdef", pos
		}
	}
	var g groupEncoder
	var buf []byte
	b.ReportAllocs()
	for b.Loop() {
		buf, _ = g.encode(buf[:0], "n1", "bench-strict-1043464d", "n1.0123456789abcdef.bench-strict-1043464d.17", es, len(es), maxGroupedBytes)
	}
	b.ReportMetric(float64(b.N*10000)/b.Elapsed().Seconds(), "records/s")
}

func BenchmarkDecodeGroupedLedger(b *testing.B) {
	data := benchGrouped(b)
	b.SetBytes(int64(len(data)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := decodeLedger(data); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N*10000)/b.Elapsed().Seconds(), "records/s")
}

// The integer arrays' one-loop path and the general path agree on every
// input: the same numbers, or both an error.
func FuzzInts(f *testing.F) {
	for _, s := range []string{`[0,1,-2,33]`, `[ 1 ,2]`, `[-0]`, `[01]`, `[1,]`, `[]`, `[ ]`, `[1234567890123456789,2]`, `[1e3]`, `[-]`, `[1,-5`} {
		f.Add(s, true)
	}
	f.Fuzz(func(t *testing.T, s string, signed bool) {
		fast := decoder{sc: wire.Scanner{Text: s}}
		a, errA := fast.ints(top, nil, signed)
		slow := decoder{sc: wire.Scanner{Text: s}}
		b, errB := slow.intsRest(top, nil, signed)
		if (errA == nil) != (errB == nil) || errA == nil && (!reflect.DeepEqual(a, b) || fast.sc.Pos != slow.sc.Pos) {
			t.Fatalf("%q: one loop %v %v (at %d), general %v %v (at %d)", s, a, errA, fast.sc.Pos, b, errB, slow.sc.Pos)
		}
	})
}
