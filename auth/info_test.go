package auth

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"pgregory.net/rapid"
)

const accKey = "ADCF356KVJSUCRQAU25MQXCTD7CT72HCTXGTTPW2VPQKYUIGR5TWGUKE"

func TestRequestInfoAccount(t *testing.T) {
	ok := []struct{ in, want string }{
		{`{"acc":"` + accKey + `","rtt":465550}`, accKey},
		{` { "rtt" : 1.5e3 , "acc" : "A" } `, "A"},
		{`{"start":"2025-01-01T00:00:00Z","host":"127.0.0.1","id":10,"acc":"B","tags":["a","b"],"alts":[],"x":{"y":[1,-0.5,true,false,null]}}`, "B"},
		{`{"ACC":"C"}`, "C"},
		{`{"name":"\u00e9\n\"q\"","acc":"D"}`, "D"},
		{`{"x":"\\","y":"\/\b\f\r\t\uABcd","acc":"E"}`, "E"},
	}
	for _, c := range ok {
		got, err := RequestInfoAccount(c.in)
		if err != nil || got != c.want {
			t.Errorf("RequestInfoAccount(%s) = %q, %v; want %q", c.in, got, err, c.want)
		}
	}
	bad := []string{
		``, `null`, `[]`, `"acc"`, `{}`, `{"rtt":1}`,
		`{"acc":"A","acc":"B"}`, `{"acc":"A","Acc":"A"}`,
		`{"acc":""}`, `{"acc":1}`, `{"acc":null}`, `{"acc":"a\"b"}`, `{"acc":"\u0041"}`, `{"acc":"é"}`,
		`{"acc":"` + strings.Repeat("A", 129) + `"}`,
		`{"\u0061cc":"A"}`, `{"acc":"A",}`, `{"acc":"A"} x`, `{"acc":"A"`, `{"acc" "A"}`,
		`{"x":01,"acc":"A"}`, `{"x":1.,"acc":"A"}`, `{"x":"a` + "\x01" + `","acc":"A"}`, `{"x":tru,"acc":"A"}`,
		`{"x":"\x","acc":"A"}`, `{"x":"\u12","acc":"A"}`,
		`{"x":"\u12G4","acc":"A"}`, `{"x":"\`, `{"x":"\u123`, `{"x":"\"}`,
		`{"x":` + strings.Repeat("[", maxInfoDepth) + strings.Repeat("]", maxInfoDepth) + `,"acc":"A"}`,
	}
	for _, in := range bad {
		if got, err := RequestInfoAccount(in); !errors.Is(err, ErrBadRequestInfo) {
			t.Errorf("RequestInfoAccount(%q) = %q, %v; want ErrBadRequestInfo", in, got, err)
		}
	}
}

// TestRequestInfoAccountReadsServerInfo: whatever the server marshals
// (server.ClientInfo, with client-chosen names, tags and versions) gives
// back its account.
func TestRequestInfoAccountReadsServerInfo(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		start := time.Unix(rapid.Int64Range(0, 1<<34).Draw(t, "start"), 0)
		ci := server.ClientInfo{
			Start:   &start,
			Host:    "127.0.0.1",
			ID:      rapid.Uint64().Draw(t, "id"),
			Account: rapid.StringMatching(`A[A-Z2-7]{55}`).Draw(t, "acc"),
			User:    rapid.String().Draw(t, "user"),
			Name:    rapid.String().Draw(t, "name"),
			Lang:    rapid.String().Draw(t, "lang"),
			Version: rapid.String().Draw(t, "ver"),
			RTT:     time.Duration(rapid.Int64().Draw(t, "rtt")),
			Jwt:     rapid.String().Draw(t, "jwt"),
			NameTag: rapid.String().Draw(t, "name_tag"),
			Tags:    rapid.SliceOf(rapid.String()).Draw(t, "tags"),
			Kind:    "Client",
		}
		b, err := json.Marshal(ci)
		if err != nil {
			t.Fatal(err)
		}
		got, err := RequestInfoAccount(string(b))
		if err != nil || got != ci.Account {
			t.Fatalf("RequestInfoAccount(%s) = %q, %v; want %q", b, got, err, ci.Account)
		}
	})
}

// FuzzRequestInfoAccount: never a panic; an accepted value is valid JSON
// that encoding/json decodes (into server.ClientInfo, as the server's own
// reader does) to the same account.
func FuzzRequestInfoAccount(f *testing.F) {
	f.Add(`{"acc":"` + accKey + `","rtt":465550}`)
	f.Add(`{"start":"2025-01-01T00:00:00Z","id":10,"acc":"B","tags":["a"],"x":{"y":[1,-0.5e-3,true,null]}}`)
	f.Add(`{"acc":"A","ACC":"B"}`)
	f.Add(`{"name":"\u00e9","acc":"A"}`)
	f.Fuzz(func(t *testing.T, in string) {
		got, err := RequestInfoAccount(in)
		if err != nil {
			if !errors.Is(err, ErrBadRequestInfo) {
				t.Fatalf("error %v does not wrap ErrBadRequestInfo", err)
			}
			return
		}
		if !json.Valid([]byte(in)) {
			t.Fatalf("accepted invalid JSON %q", in)
		}
		var ref struct {
			Account string `json:"acc"`
		}
		if err := json.Unmarshal([]byte(in), &ref); err != nil || ref.Account != got {
			t.Fatalf("RequestInfoAccount(%q) = %q; encoding/json reads %q, %v", in, got, ref.Account, err)
		}
	})
}

func BenchmarkRequestInfoAccount(b *testing.B) {
	start := time.Unix(1700000000, 0)
	for _, c := range []struct {
		name string
		ci   server.ClientInfo
	}{
		{"account", server.ClientInfo{Account: accKey, RTT: 465550}},
		{"shared", server.ClientInfo{Start: &start, Host: "127.0.0.1", ID: 10, Account: accKey, RTT: 465550,
			User: "UCFN" + accKey[4:], Name: "gateway-7", Lang: "go", Version: "1.55.0", Server: "NDX5",
			Jwt: strings.Repeat("eyJ0eXAiOiJKV1QiLCJhbGciOiJlZDI1NTE5LW5rZXkifQ", 14), IssuerKey: accKey,
			NameTag: "acme", Kind: "Client", ClientType: "nats"}},
	} {
		hdr, _ := json.Marshal(c.ci)
		info := string(hdr)
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(info)))
			for b.Loop() {
				if _, err := RequestInfoAccount(info); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
