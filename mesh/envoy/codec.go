package envoy

import (
	"errors"
	"fmt"

	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// codec is the server's codec: gRPC's proto codec, except that a
// RateLimitRequest the proto codec refuses is decoded once more without
// its UTF-8 check (decodeRequestLenient). proto3 string fields must be
// valid UTF-8, and Go's protobuf refuses a message with invalid UTF-8 in
// any of them; C++ senders such as Envoy do not check, and a header value
// holding invalid bytes reaches the service as it is. Refusing the whole
// call would fail every descriptor of the request (and then Envoy's
// failure mode decides); decoded leniently, the descriptor with the
// invalid value is refused alone, like any other invalid value (Map).
type codec struct{ base encoding.CodecV2 }

func newCodec() codec { return codec{base: encoding.GetCodecV2(proto.Name)} }

func (c codec) Name() string { return proto.Name }

func (c codec) Marshal(v any) (mem.BufferSlice, error) { return c.base.Marshal(v) }

func (c codec) Unmarshal(data mem.BufferSlice, v any) error {
	err := c.base.Unmarshal(data, v)
	if err == nil {
		return nil
	}
	if req, ok := v.(*rlsv3.RateLimitRequest); ok {
		b := data.Materialize()
		req.Reset()
		if lerr := decodeRequestLenient(b, req); lerr == nil {
			return nil
		}
	}
	return err
}

// errWire is a malformed RateLimitRequest (not an invalid string: bad wire
// data).
var errWire = errors.New("envoy: malformed RateLimitRequest")

// decodeRequestLenient decodes a RateLimitRequest from b as proto.Unmarshal
// does, without checking that strings are valid UTF-8: the fields the
// service reads (domain, descriptors with their entries, hits_addend and
// is_negative_hits, hits_addend) are decoded, others (a descriptor's limit
// override, unknown fields) are skipped. For a message proto.Unmarshal
// accepts, it yields the same values of those fields
// (FuzzDecodeRequestLenient). It never panics.
func decodeRequestLenient(b []byte, req *rlsv3.RateLimitRequest) error {
	return eachField(b, func(num protowire.Number, typ protowire.Type, v []byte, n uint64) error {
		switch {
		case num == 1 && typ == protowire.BytesType:
			req.Domain = string(v)
		case num == 2 && typ == protowire.BytesType:
			d := &ratelimitv3.RateLimitDescriptor{}
			if err := decodeDescriptorLenient(v, d); err != nil {
				return err
			}
			req.Descriptors = append(req.Descriptors, d)
		case num == 3 && typ == protowire.VarintType:
			req.HitsAddend = uint32(n)
		}
		return nil
	})
}

func decodeDescriptorLenient(b []byte, d *ratelimitv3.RateLimitDescriptor) error {
	return eachField(b, func(num protowire.Number, typ protowire.Type, v []byte, n uint64) error {
		switch {
		case num == 1 && typ == protowire.BytesType:
			e := &ratelimitv3.RateLimitDescriptor_Entry{}
			err := eachField(v, func(num protowire.Number, typ protowire.Type, v []byte, _ uint64) error {
				switch {
				case num == 1 && typ == protowire.BytesType:
					e.Key = string(v)
				case num == 2 && typ == protowire.BytesType:
					e.Value = string(v)
				}
				return nil
			})
			if err != nil {
				return err
			}
			d.Entries = append(d.Entries, e)
		case num == 3 && typ == protowire.BytesType:
			// A repeated occurrence of a message field merges into it: the
			// last value set wins.
			if d.HitsAddend == nil {
				d.HitsAddend = &wrapperspb.UInt64Value{}
			}
			err := eachField(v, func(num protowire.Number, typ protowire.Type, _ []byte, n uint64) error {
				if num == 1 && typ == protowire.VarintType {
					d.HitsAddend.Value = n
				}
				return nil
			})
			if err != nil {
				return err
			}
		case num == 4 && typ == protowire.VarintType:
			d.IsNegativeHits = n != 0
		}
		return nil
	})
}

// eachField calls f with each field of the message b: its number, wire
// type, and value (bytes for a length-delimited field, the number for a
// varint); other wire types are skipped. Malformed data is errWire.
func eachField(b []byte, f func(protowire.Number, protowire.Type, []byte, uint64) error) error {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return fmt.Errorf("%w: %w", errWire, protowire.ParseError(n))
		}
		b = b[n:]
		var (
			v     []byte
			varin uint64
		)
		switch typ {
		case protowire.BytesType:
			v, n = protowire.ConsumeBytes(b)
		case protowire.VarintType:
			varin, n = protowire.ConsumeVarint(b)
		default:
			n = protowire.ConsumeFieldValue(num, typ, b)
		}
		if n < 0 {
			return fmt.Errorf("%w: %w", errWire, protowire.ParseError(n))
		}
		b = b[n:]
		if typ != protowire.BytesType && typ != protowire.VarintType {
			continue
		}
		if err := f(num, typ, v, varin); err != nil {
			return err
		}
	}
	return nil
}
