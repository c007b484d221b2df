package usage

import (
	"encoding/json"
	"errors"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/limitmesh/limitmesh/policies"
)

func desc(t failer, kv ...string) policies.Descriptor {
	var dims []policies.Dim
	for i := 0; i < len(kv); i += 2 {
		dims = append(dims, policies.Dim{Name: kv[i], Value: kv[i+1]})
	}
	d, err := policies.NewDescriptor(dims)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// appendBatch appends b's records as one v1.1 usage message (CONTRACT.md
// §6), each record as AppendRecord writes it; b.Groups are not written.
func appendBatch(dst []byte, b *Batch) []byte {
	dst = append(dst, `{"node":`...)
	dst = appendJSON(dst, b.Node)
	dst = append(dst, `,"policy":`...)
	dst = appendJSON(dst, b.Policy)
	dst = append(dst, `,"records":[`...)
	for i := range b.Records {
		if i > 0 {
			dst = append(dst, ',')
		}
		dst = AppendRecord(dst, &b.Records[i])
	}
	return append(dst, "]}"...)
}

// appendJSON appends s as a JSON string (invalid UTF-8 as U+FFFD).
func appendJSON(dst []byte, s string) []byte {
	b, _ := json.Marshal(s) // a string always encodes
	return append(dst, b...)
}

// ordinaryID is the id of ordinary record n of origin node.boot:
// "<node>.<boot>.<n>" (see ids.go).
func ordinaryID(node, boot string, n uint64) string {
	return node + "." + boot + "." + strconv.FormatUint(n, 10)
}

// The contract's example message decodes to the record it shows.
func TestDecodeContractExample(t *testing.T) {
	const msg = `{"node": "n1", "policy": "acme-search",
 "records": [{"id": "n1.7.000123", "t_us": 1764752400123456, "revision": 12,
              "key": "p.acme-search.operation=search.plan=v7.tenant=acme",
              "descriptor": {"tenant": "acme", "operation": "search", "plan": "v7"},
              "cost": 3, "result": "allowed", "request_id": "7f1c2e"}]}`
	b, err := DecodeBatch([]byte(msg))
	if err != nil {
		t.Fatal(err)
	}
	want := Batch{Node: "n1", Policy: "acme-search", Records: []Record{{
		ID: "n1.7.000123", TimeUs: 1764752400123456, Revision: 12,
		Key:        "p.acme-search.operation=search.plan=v7.tenant=acme",
		Descriptor: desc(t, "operation", "search", "plan", "v7", "tenant", "acme"),
		Cost:       3_000_000, Allowed: true, RequestID: "7f1c2e",
	}}}
	if !reflect.DeepEqual(b, want) {
		t.Fatalf("got %+v\nwant %+v", b, want)
	}
}

// appendBatch (AppendRecord for each record) writes the contract's JSON byte for byte, and it is JSON.
func TestAppendBatchGolden(t *testing.T) {
	b := Batch{Node: "n1", Policy: "acme-search", Records: []Record{
		{ID: "n1.7.1", TimeUs: 1764752400123456, Revision: 12, Key: "p.acme-search.tenant=acme",
			Descriptor: desc(t, "tenant", "acme", "note", "a \"q\" \\ é/"), Cost: 2_500_000, Allowed: true, RequestID: "r1"},
		{ID: "n1.7.j9.0", TimeUs: 5, Revision: 12, Key: "p.acme-search.tenant=acme",
			Descriptor: desc(t, "tenant", "acme"), Cost: 1, Allowed: false},
		{ID: "n1.7.j9.1", TimeUs: 6, Revision: 12, Key: "p.acme-search.tenant=acme",
			Descriptor: desc(t, "tenant", "acme"), Cost: 0, Allowed: true, Reservation: "r.3.9f \"x\""},
		{ID: "n1.7.2", TimeUs: 7, Revision: 12, Key: "p.acme-search.tenant=acme",
			Descriptor: desc(t, "tenant", "acme"), Cost: 1_500_000, Allowed: true, RequestID: "r2", Reservation: "r.4.0a"},
	}}
	got := string(appendBatch(nil, &b))
	want := `{"node":"n1","policy":"acme-search","records":[` +
		`{"id":"n1.7.1","t_us":1764752400123456,"revision":12,"key":"p.acme-search.tenant=acme","descriptor":{"note":"a \"q\" \\ é/","tenant":"acme"},"cost":2.5,"result":"allowed","request_id":"r1"},` +
		`{"id":"n1.7.j9.0","t_us":5,"revision":12,"key":"p.acme-search.tenant=acme","descriptor":{"tenant":"acme"},"cost":0.000001,"result":"denied"},` +
		`{"id":"n1.7.j9.1","t_us":6,"revision":12,"key":"p.acme-search.tenant=acme","descriptor":{"tenant":"acme"},"cost":0,"result":"allowed","reservation":"r.3.9f \"x\""},` +
		`{"id":"n1.7.2","t_us":7,"revision":12,"key":"p.acme-search.tenant=acme","descriptor":{"tenant":"acme"},"cost":1.5,"result":"allowed","request_id":"r2","reservation":"r.4.0a"}]}`
	if got != want {
		t.Fatalf("got\n%s\nwant\n%s", got, want)
	}
	if !json.Valid([]byte(got)) {
		t.Fatal("not JSON")
	}
	back, err := DecodeBatch([]byte(got))
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back, b) {
		t.Fatalf("round trip: got %+v\nwant %+v", back, b)
	}
}

func TestDecodeRejects(t *testing.T) {
	rec := func(fields string) string {
		return `{"node":"n1","policy":"p","records":[{` + fields + `}]}`
	}
	const ok = `"id":"a","t_us":1,"revision":1,"key":"p.p","descriptor":{"t":"x"},"cost":1,"result":"allowed"`
	if _, err := DecodeBatch([]byte(rec(ok))); err != nil {
		t.Fatalf("base case rejected: %v", err)
	}
	cases := []struct{ name, in, path string }{
		{"not json", `hello`, ""},
		{"empty", ``, ""},
		{"array", `[]`, ""},
		{"trailing", rec(ok) + `{}`, ""},
		{"no node", `{"policy":"p","records":[]}`, "node"},
		{"empty node", `{"node":"","policy":"p","records":[]}`, "node"},
		{"no policy", `{"node":"n","records":[]}`, "policy"},
		{"bad policy", `{"node":"n","policy":"Bad","records":[]}`, "policy"},
		{"no records", `{"node":"n","policy":"p"}`, "records"},
		{"records not array", `{"node":"n","policy":"p","records":{}}`, "records"},
		{"node twice", `{"node":"n","node":"m","policy":"p","records":[]}`, "node"},
		{"missing id", rec(strings.Replace(ok, `"id":"a",`, ``, 1)), "records[0].id"},
		{"empty id", rec(strings.Replace(ok, `"id":"a"`, `"id":""`, 1)), "records[0].id"},
		{"long id", rec(strings.Replace(ok, `"id":"a"`, `"id":"`+strings.Repeat("a", 257)+`"`, 1)), "records[0].id"},
		{"control id", rec(strings.Replace(ok, `"id":"a"`, `"id":"a\u0001"`, 1)), "records[0].id"},
		{"negative t_us", rec(strings.Replace(ok, `"t_us":1`, `"t_us":-1`, 1)), "records[0].t_us"},
		{"fractional t_us", rec(strings.Replace(ok, `"t_us":1`, `"t_us":1.5`, 1)), "records[0].t_us"},
		{"string t_us", rec(strings.Replace(ok, `"t_us":1`, `"t_us":"1"`, 1)), "records[0].t_us"},
		{"huge t_us", rec(strings.Replace(ok, `"t_us":1`, `"t_us":9223372036854775808`, 1)), "records[0].t_us"},
		{"huge revision", rec(strings.Replace(ok, `"revision":1`, `"revision":18446744073709551616`, 1)), "records[0].revision"},
		{"empty key", rec(strings.Replace(ok, `"key":"p.p"`, `"key":""`, 1)), "records[0].key"},
		{"bad key", rec(strings.Replace(ok, `"key":"p.p"`, `"key":"p..p"`, 1)), "records[0].key"},
		{"space key", rec(strings.Replace(ok, `"key":"p.p"`, `"key":"p p"`, 1)), "records[0].key"},
		{"unmatched with key", `{"node":"n","policy":"","records":[{` + ok + `}]}`, "records[0].key"},
		{"empty descriptor", rec(strings.Replace(ok, `{"t":"x"}`, `{}`, 1)), "records[0].descriptor"},
		{"bad dim", rec(strings.Replace(ok, `{"t":"x"}`, `{"T":"x"}`, 1)), "records[0].descriptor"},
		{"dup dim", rec(strings.Replace(ok, `{"t":"x"}`, `{"t":"x","t":"y"}`, 1)), "records[0].descriptor.t"},
		{"empty value", rec(strings.Replace(ok, `{"t":"x"}`, `{"t":""}`, 1)), "records[0].descriptor.t"},
		{"number value", rec(strings.Replace(ok, `{"t":"x"}`, `{"t":1}`, 1)), "records[0].descriptor.t"},
		{"zero cost", rec(strings.Replace(ok, `"cost":1`, `"cost":0`, 1)), "records[0].cost"},
		{"zero cost in decimals", rec(strings.Replace(ok, `"cost":1`, `"cost":0.000`, 1)), "records[0].cost"},
		{"negative cost with a reservation", rec(strings.Replace(ok, `"cost":1`, `"cost":-1`, 1) + `,"reservation":"r"`), "records[0].cost"},
		{"empty reservation", rec(strings.Replace(ok, `"cost":1`, `"cost":0`, 1) + `,"reservation":""`), "records[0].reservation"},
		{"long reservation", rec(ok + `,"reservation":"` + strings.Repeat("r", 129) + `"`), "records[0].reservation"},
		{"control reservation", rec(ok + `,"reservation":"r\n"`), "records[0].reservation"},
		{"invalid utf8 reservation", rec(ok + ",\"reservation\":\"r\xc3\""), "records[0].reservation"},
		{"number reservation", rec(ok + `,"reservation":12`), "records[0].reservation"},
		{"null reservation", rec(ok + `,"reservation":null`), "records[0].reservation"},
		{"reservation twice", rec(ok + `,"reservation":"a","reservation":"a"`), "records[0].reservation"},
		{"negative cost", rec(strings.Replace(ok, `"cost":1`, `"cost":-1`, 1)), "records[0].cost"},
		{"7 decimals", rec(strings.Replace(ok, `"cost":1`, `"cost":0.0000001`, 1)), "records[0].cost"},
		{"exponent", rec(strings.Replace(ok, `"cost":1`, `"cost":1e3`, 1)), "records[0].cost"},
		{"too costly", rec(strings.Replace(ok, `"cost":1`, `"cost":1000000001`, 1)), "records[0].cost"},
		{"string cost", rec(strings.Replace(ok, `"cost":1`, `"cost":"1"`, 1)), "records[0].cost"},
		{"bad result", rec(strings.Replace(ok, `"allowed"`, `"maybe"`, 1)), "records[0].result"},
		{"long request_id", rec(ok + `,"request_id":"` + strings.Repeat("r", 129) + `"`), "records[0].request_id"},
		{"lone surrogate", rec(strings.Replace(ok, `"id":"a"`, `"id":"\ud800"`, 1)), "records[0].id"},
		{"invalid utf8", rec(strings.Replace(ok, `"id":"a"`, "\"id\":\"\xff\"", 1)), "records[0].id"},
		{"deep unknown", rec(ok + `,"x":` + strings.Repeat("[", 100) + strings.Repeat("]", 100)), "records[0].x"},
		{"bad unknown", rec(ok + `,"x":01`), "records[0].x"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := DecodeBatch([]byte(c.in))
			if err == nil {
				t.Fatalf("accepted %s", c.in)
			}
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("%v does not match ErrInvalid", err)
			}
			var de *decodeError
			if !errors.As(err, &de) || !strings.HasPrefix(de.path, c.path) {
				t.Fatalf("error %v: path %q, want prefix %q", err, de.path, c.path)
			}
		})
	}
}

// Unknown fields are skipped; the unmatched form is accepted.
func TestDecodeAccepts(t *testing.T) {
	in := `{"x":[1,{"y":null}],"node":"n","policy":"","records":[{"id":"n.b.1","t_us":0,"revision":0,"key":"",` +
		`"descriptor":{"a":"ü \u00e9 \ud83d\ude00"},"cost":0.5,"result":"denied","new":true}], "z": -1.5e3}`
	b, err := DecodeBatch([]byte(in))
	if err != nil {
		t.Fatal(err)
	}
	if len(b.Records) != 1 || b.Records[0].Descriptor[0].Value != "ü é 😀" || b.Records[0].Cost != 500_000 || b.Records[0].Allowed {
		t.Fatalf("got %+v", b)
	}
}

// A reservation's end (CONTRACT.md §10) may cost 0, in any form of zero,
// and carries its reservation id (128 bytes at most, of any printable
// UTF-8).
func TestDecodeReservationEnd(t *testing.T) {
	long := strings.Repeat("é", 64)
	for _, c := range []struct{ cost, res, wantRes string }{
		{`0`, `"r.1"`, "r.1"},
		{`0.0`, `"r.1"`, "r.1"},
		{`0.000000`, `"\u0072.1"`, "r.1"},
		{`2.5`, `"` + long + `"`, long},
	} {
		in := `{"node":"n","policy":"p","records":[{"id":"a","t_us":1,"revision":1,"key":"p.p","descriptor":{"t":"x"},` +
			`"reservation":` + c.res + `,"cost":` + c.cost + `,"result":"allowed"}]}`
		b, err := DecodeBatch([]byte(in))
		if err != nil {
			t.Fatalf("%s: %v", in, err)
		}
		r := b.Records[0]
		if r.Reservation != c.wantRes || (r.Cost == 0) != (c.cost != "2.5") {
			t.Fatalf("%s: got %+v", in, r)
		}
	}
}

func FuzzDecodeBatch(f *testing.F) {
	f.Add([]byte(`{"node":"n1","policy":"acme-search","records":[{"id":"n1.7.1","t_us":1764752400123456,"revision":12,"key":"p.acme-search.tenant=acme","descriptor":{"tenant":"acme"},"cost":2.5,"result":"allowed","request_id":"r1"}]}`))
	f.Add([]byte(`{"node":"n","policy":"","records":[{"id":"x","t_us":0,"revision":0,"key":"","descriptor":{"a":"\u0041\ud83d\ude00"},"cost":1,"result":"denied","q":[{}]}]}`))
	f.Add([]byte(`{"node":"n","policy":"p","records":[]}`))
	f.Add([]byte(`{"node":"\u0000","policy":"p","records":[{"cost":1e1}]}`))
	f.Add([]byte(`{"node":"n1","policy":"p","batch":"n1.b.p.1","t_us":100,"span_us":10,"n":3,` +
		`"keys":["tenant=a","tenant=b"],"revisions":[1,1],"allowed":[1,1],"allowed_units":[1,1],"denied":[1,0],"denied_units":[2,0],` +
		`"costs":[[1,2],1],"results":["Ad","a"],"full_keys":[],"descriptors":[[1,{"tenant":"b","x":"y"}]],` +
		`"order":[0,1,0],"dt_us":[0,10,-5],"origins":["n1.b"],"journal":[0,7,0,1],"request_ids":[[1,"r"]],"ids":[[1,"x"]]}`))
	f.Add([]byte(`{"node":"n","policy":"p","records":[{"id":"a","t_us":1,"revision":1,"key":"p.p","descriptor":{"t":"x"},"cost":0,"result":"allowed","reservation":"r.1.\u00e9"},` +
		`{"id":"b","t_us":1,"revision":1,"key":"p.p","descriptor":{"t":"x"},"cost":0.5,"result":"allowed","request_id":"q"}]}`))
	f.Add([]byte(`{"node":"n1","policy":"p","batch":"n1.b.p.2","t_us":100,"span_us":0,"n":3,"keys":["t=a"],"revisions":[1],` +
		`"allowed":[3],"allowed_units":[1.5],"denied":[0],"denied_units":[0],"costs":[[0,1.5,0]],"results":["aAa"],` +
		`"order":[0,0,0],"dt_us":[0,0,0],"origins":["n1.b"],"journal":[0,9,2,1],"request_ids":[[1,"q"]],"reservations":[[0,"r.1"],[1,"r.2"],[2,"r.3"]]}`))
	f.Add([]byte(`{"node":"n","policy":"","batch":"b","t_us":0,"span_us":0,"n":1,"keys":[""],"revisions":[0],"allowed":[0],"allowed_units":[0],"denied":[1],"denied_units":[0.5],"costs":[0.5],"results":["d"],"descriptors":[[0,{"a":"b"}]],"order":[0],"dt_us":[0]}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		b, err := DecodeBatch(data)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error %v does not match ErrInvalid", err)
			}
			return
		}
		if b.Groups != nil {
			// A grouped message encodes again, grouped, to the same
			// records (their ids kept as they are).
			again, err := DecodeBatch(EncodeGrouped(b.Node, b.Policy, "x", b.Records))
			if err != nil || !reflect.DeepEqual(again.Records, b.Records) {
				t.Fatalf("grouped round trip of %q: %v\n%+v\n%+v", data, err, again.Records, b.Records)
			}
			b = Batch{Node: b.Node, Policy: b.Policy, Records: b.Records}
		}
		// What decodes encodes to JSON that decodes to the same batch.
		enc := appendBatch(nil, &b)
		if !json.Valid(enc) {
			t.Fatalf("encoding is not JSON: %s", enc)
		}
		back, err := DecodeBatch(enc)
		if err != nil {
			t.Fatalf("re-decode of %s: %v", enc, err)
		}
		if !reflect.DeepEqual(back, b) {
			t.Fatalf("round trip:\n%+v\n%+v", back, b)
		}
		// encoding/json agrees on the top-level shape.
		var shape struct {
			Node    string            `json:"node"`
			Policy  string            `json:"policy"`
			Records []json.RawMessage `json:"records"`
		}
		if err := json.Unmarshal(data, &shape); err != nil {
			t.Fatalf("accepted what encoding/json rejects (%v): %q", err, data)
		}
		if shape.Node != b.Node || shape.Policy != b.Policy || shape.Records != nil && len(shape.Records) != len(b.Records) {
			t.Fatalf("encoding/json reads %+v, DecodeBatch %+v", shape, b)
		}
	})
}

func TestJournalIDs(t *testing.T) {
	id := JournalID("n1", "ab12", 42, 7)
	if id != "n1.ab12.j42.7" {
		t.Fatal(id)
	}
	origin, pos, ok := ParseJournalID(id)
	if !ok || origin != "n1.ab12" || pos != (JournalPos{42, 7}) {
		t.Fatalf("%q %v %v", origin, pos, ok)
	}
	for _, bad := range []string{ordinaryID("n1", "ab12", 3), "j1.2", "a.j.1", "a.jx.1", "a.j1.", "a.j1.-1", ".j1.2", "a.j1.4294967296", "a.j18446744073709551616.0"} {
		if _, _, ok := ParseJournalID(bad); ok {
			t.Errorf("ParseJournalID(%q) accepted", bad)
		}
	}
	if !(JournalPos{1, 9}).Less(JournalPos{2, 0}) || !(JournalPos{2, 0}).Less(JournalPos{2, 1}) || (JournalPos{2, 1}).Less(JournalPos{2, 1}) {
		t.Fatal("Less")
	}
	if b := NewBoot(); !validToken(b) || isJournalToken(b) {
		t.Fatal(b)
	}
}

func TestNames(t *testing.T) {
	if StreamName("rl") != "RL_USAGE" || Subject("rl", "acme") != "rl.usage.acme" || Subject("rl", "") != "rl.usage._" ||
		LedgerBucket("rl") != "rl_ledger" || Subjects("rl") != "rl.usage.>" {
		t.Fatal("names")
	}
	for subj, want := range map[string]string{"rl.usage.acme": "acme", "rl.usage._": ""} {
		if p, ok := PolicyOfSubject("rl", subj); !ok || p != want {
			t.Errorf("%s: %q %v", subj, p, ok)
		}
	}
	for _, subj := range []string{"rl.usage.", "rl.usage.a.b", "x.usage.a"} {
		if _, ok := PolicyOfSubject("rl", subj); ok {
			t.Errorf("%s accepted", subj)
		}
	}
}

// BenchmarkDecodeBatch decodes a message of 1000 typical records.
func BenchmarkDecodeBatch(b *testing.B) {
	batch := Batch{Node: "n1", Policy: "acme-search"}
	for i := 0; i < 1000; i++ {
		batch.Records = append(batch.Records, Record{
			ID: ordinaryID("n1", "0123456789abcdef", uint64(i)), TimeUs: 1764752400123456 + int64(i), Revision: 12,
			Key:        "p.acme-search.operation=search.plan=v7.tenant=acme",
			Descriptor: desc(b, "tenant", "acme", "operation", "search", "plan", "v7"),
			Cost:       2_500_000, Allowed: true,
		})
	}
	data := appendBatch(nil, &batch)
	b.SetBytes(int64(len(data)))
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := DecodeBatch(data); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N*1000)/b.Elapsed().Seconds(), "records/s")
}

// TestRequestIDControlCharacters: decide takes a request_id with control
// characters (any valid UTF-8), so both message forms carry it exactly;
// a batch holding one is not refused (it would take every decision of
// the batch out of the ledger).
func TestRequestIDControlCharacters(t *testing.T) {
	recs := []Record{{ID: "n.b.0", TimeUs: 1, Revision: 1, Key: "p.p.t=x", Descriptor: desc(t, "t", "x"),
		Cost: 1_000_000, Allowed: true, RequestID: "r\n\t\x01\u00e9"}}
	for name, msg := range map[string][]byte{
		"records": appendBatch(nil, &Batch{Node: "n", Policy: "p", Records: recs}),
		"grouped": EncodeGrouped("n", "p", "n.b", recs),
	} {
		b, err := DecodeBatch(msg)
		if err != nil || len(b.Records) != 1 || b.Records[0].RequestID != recs[0].RequestID {
			t.Fatalf("%s: %v %+v", name, err, b.Records)
		}
	}
}
