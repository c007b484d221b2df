package shadow

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/jstest"
	"github.com/limitmesh/limitmesh/internal/usagetest"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/limitmesh/limitmesh/policies"
	"github.com/limitmesh/limitmesh/usage"
)

// waitLimit bounds every wait of the tests against a server.
const waitLimit = 20 * time.Second

// startServer starts an embedded nats-server with JetStream on a random
// port, shut down at cleanup.
func startServer(t testing.TB) *server.Server {
	t.Helper()
	return jstest.Start(t).Server
}

// connectJS opens a connection (closed at cleanup) and its JetStream.
func connectJS(t testing.TB, s *server.Server) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc := jstest.Connect(t, s)
	return nc, jstest.JetStream(t, nc)
}

// installation creates what a node creates: the policy bucket and the
// usage stream of prefix.
func installation(t testing.TB, js jetstream.JetStream, prefix string) jetstream.KeyValue {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: prefix + "_policies", History: 16})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: usage.StreamName(prefix),
		Subjects: []string{usage.Subjects(prefix)}, Storage: jetstream.FileStorage}); err != nil {
		t.Fatal(err)
	}
	return kv
}

// putDoc puts a policy document and returns the entry's revision.
func putDoc(t testing.TB, kv jetstream.KeyValue, name, doc string) uint64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	rev, err := kv.Put(ctx, name, []byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	return rev
}

// publishBatches publishes recs in batches of at most size, split by the
// policy the test says decided them (policyOf), as nodes do: one message
// per batch with a Nats-Msg-Id (made of the first record's id). It
// returns the records in the order the stream holds them.
func publishBatches(t testing.TB, js jetstream.JetStream, prefix, node string, recs []usage.Record, size int, policyOf func(*usage.Record) string) []usage.Record {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	var stream []usage.Record
	for i := 0; i < len(recs); i += size {
		end := min(i+size, len(recs))
		// One batch per policy within the chunk, in record order.
		byPolicy := map[string][]usage.Record{}
		var order []string
		for _, r := range recs[i:end] {
			p := policyOf(&r)
			if p == "" {
				r.Key, r.Revision = "", 0
			}
			if _, ok := byPolicy[p]; !ok {
				order = append(order, p)
			}
			byPolicy[p] = append(byPolicy[p], r)
		}
		for _, p := range order {
			b := usagetest.AppendBatch(nil, &usage.Batch{Node: node, Policy: p, Records: byPolicy[p]})
			m := nats.NewMsg(usage.Subject(prefix, p))
			m.Data = b
			m.Header.Set(jetstream.MsgIDHeader, node+"/"+byPolicy[p][0].ID)
			ack, err := js.PublishMsg(ctx, m)
			if err != nil {
				t.Fatal(err)
			}
			if ack.Duplicate {
				t.Fatalf("batch %s published twice", m.Header.Get(jetstream.MsgIDHeader))
			}
			stream = append(stream, byPolicy[p]...)
		}
	}
	return stream
}

// genStream returns n records over a few tenants, operations and users,
// at times from t0 a few ms apart, with costs of 1 to 3 and live results
// (about one in five denied), from seed. About one in twenty is a
// reservation's end (CONTRACT.md §10: allowed), half of those released
// (cost 0).
func genStream(t testing.TB, n int, seed uint64) []usage.Record {
	t.Helper()
	rng := rand.New(rand.NewPCG(seed, 1))
	tenants := []string{"acme", "birch", "cedar", "dune"}
	ops := []string{"search", "write"}
	out := make([]usage.Record, n)
	at := t0
	for i := range out {
		at += int64(rng.IntN(8000))
		dims := []policies.Dim{
			{Name: "tenant", Value: tenants[rng.IntN(len(tenants))]},
			{Name: "operation", Value: ops[rng.IntN(len(ops))]},
		}
		if rng.IntN(10) > 0 {
			dims = append(dims, policies.Dim{Name: "user", Value: fmt.Sprintf("u%d", rng.IntN(40))})
		}
		if rng.IntN(10) > 0 {
			dims = append(dims, policies.Dim{Name: "plan", Value: []string{"free", "pro"}[rng.IntN(2)]})
		}
		d, err := policies.NewDescriptor(dims)
		if err != nil {
			t.Fatal(err)
		}
		out[i] = usage.Record{ID: fmt.Sprintf("n1.%d", i), TimeUs: at, Descriptor: d,
			Cost: int64(1+rng.IntN(3)) * unit, Allowed: rng.IntN(5) > 0}
		if rng.IntN(20) == 0 {
			out[i].Allowed, out[i].Reservation = true, fmt.Sprintf("r.%d", i)
			if rng.IntN(2) == 0 {
				out[i].Cost = 0
			}
		}
	}
	return out
}

// livePolicyOf is the live policy the tests pretend decided a record:
// acme's searches are "acme-search", everything else matched nothing.
func livePolicyOf(r *usage.Record) string {
	if v, _ := r.Descriptor.Get("tenant"); v != "acme" {
		return ""
	}
	if v, _ := r.Descriptor.Get("operation"); v == "search" {
		r.Key, r.Revision = "p.acme-search.tenant=acme", 1
		return "acme-search"
	}
	return ""
}
