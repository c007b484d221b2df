package envoy

import (
	"testing"

	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// rawRequest encodes a RateLimitRequest by hand, so that its strings may
// hold invalid UTF-8 (proto.Marshal refuses them).
func rawRequest(domain string, hits uint64, descs ...[]byte) []byte {
	var b []byte
	b = protowire.AppendTag(b, 1, protowire.BytesType)
	b = protowire.AppendString(b, domain)
	for _, d := range descs {
		b = protowire.AppendTag(b, 2, protowire.BytesType)
		b = protowire.AppendBytes(b, d)
	}
	b = protowire.AppendTag(b, 3, protowire.VarintType)
	return protowire.AppendVarint(b, hits)
}

// rawDescriptor encodes a descriptor of key, value entries.
func rawDescriptor(kv ...string) []byte {
	var d []byte
	for i := 0; i+1 < len(kv); i += 2 {
		var e []byte
		e = protowire.AppendTag(e, 1, protowire.BytesType)
		e = protowire.AppendString(e, kv[i])
		e = protowire.AppendTag(e, 2, protowire.BytesType)
		e = protowire.AppendString(e, kv[i+1])
		d = protowire.AppendTag(d, 1, protowire.BytesType)
		d = protowire.AppendBytes(d, e)
	}
	return d
}

// TestCodecInvalidUTF8: a request with invalid UTF-8 in a value, which
// the proto codec refuses, is decoded leniently, and Map then refuses that
// descriptor alone; malformed wire data is still an error.
func TestCodecInvalidUTF8(t *testing.T) {
	c := newCodec()
	b := rawRequest("edge", 2, rawDescriptor("remote_address", "10.0.0.1"), rawDescriptor("user", "a\xffb"))
	if err := proto.Unmarshal(b, &rlsv3.RateLimitRequest{}); err == nil {
		t.Fatal("proto.Unmarshal accepted invalid UTF-8: the lenient path is not needed any more")
	}
	var req rlsv3.RateLimitRequest
	if err := c.Unmarshal(mem.BufferSlice{mem.SliceBuffer(b)}, &req); err != nil {
		t.Fatalf("Unmarshal: %v", err)
	}
	if req.Domain != "edge" || req.HitsAddend != 2 || len(req.Descriptors) != 2 || req.Descriptors[1].Entries[0].Value != "a\xffb" {
		t.Fatalf("decoded %v", &req)
	}
	if _, err := Map(req.Domain, req.Descriptors[0], req.HitsAddend); err != nil {
		t.Errorf("the valid descriptor: %v", err)
	}
	if _, err := Map(req.Domain, req.Descriptors[1], req.HitsAddend); err == nil {
		t.Error("the descriptor with invalid UTF-8 was not refused")
	}
	if err := c.Unmarshal(mem.BufferSlice{mem.SliceBuffer(b[:len(b)-3])}, &rlsv3.RateLimitRequest{}); err == nil {
		t.Error("a truncated request decoded")
	}
}

// FuzzDecodeRequestLenient: the lenient decoder never panics, and on every
// message proto.Unmarshal accepts it decodes the fields the service reads
// exactly as proto.Unmarshal does.
func FuzzDecodeRequestLenient(f *testing.F) {
	full, _ := proto.Marshal(&rlsv3.RateLimitRequest{Domain: "edge", HitsAddend: 3, Descriptors: []*ratelimitv3.RateLimitDescriptor{
		{Entries: []*ratelimitv3.RateLimitDescriptor_Entry{{Key: "a", Value: "b"}, {Key: "c", Value: "d"}},
			HitsAddend: wrapperspb.UInt64(0), IsNegativeHits: true,
			Limit: &ratelimitv3.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 5}},
		{},
	}})
	f.Add(full)
	f.Add(rawRequest("d\xff", 1<<40, rawDescriptor("k\xfe", "v")))
	f.Add([]byte{0x0a, 0x80})
	f.Fuzz(func(t *testing.T, b []byte) {
		var got rlsv3.RateLimitRequest
		lerr := decodeRequestLenient(b, &got)
		var want rlsv3.RateLimitRequest
		if proto.Unmarshal(b, &want) != nil {
			return
		}
		if lerr != nil {
			t.Fatalf("proto.Unmarshal accepts %x, the lenient decoder does not: %v", b, lerr)
		}
		if got.Domain != want.Domain || got.HitsAddend != want.HitsAddend || len(got.Descriptors) != len(want.Descriptors) {
			t.Fatalf("got %v, want %v", &got, &want)
		}
		for i, w := range want.Descriptors {
			g := got.Descriptors[i]
			if g.IsNegativeHits != w.IsNegativeHits || (g.HitsAddend == nil) != (w.HitsAddend == nil) ||
				g.GetHitsAddend().GetValue() != w.GetHitsAddend().GetValue() || len(g.Entries) != len(w.Entries) {
				t.Fatalf("descriptor %d: got %v, want %v", i, g, w)
			}
			for j, e := range w.Entries {
				if g.Entries[j].Key != e.Key || g.Entries[j].Value != e.Value {
					t.Fatalf("descriptor %d entry %d: got %v, want %v", i, j, g.Entries[j], e)
				}
			}
		}
	})
}
