package client

import (
	"encoding/json"
	"errors"
	"strconv"
	"testing"
	"unicode/utf8"

	"github.com/nats-io/nats.go"
)

func TestDecodeReplyRejects(t *testing.T) {
	bad := []string{
		``, `null`, `[]`, `{}`, `{"policy":"p"}`, // no "allowed"
		`{"allowed":"yes"}`,
		`{"allowed":true,"remaining":-1}`,
		`{"allowed":true,"remaining":1e3}`,
		`{"allowed":false,"retry_after_ms":-2}`,
		`{"allowed":false,"retry_after_ms":1.5}`,
		`{"allowed":true,"reset_after_ms":-1}`,
		`{"allowed":true,"reset_after_ms":9223372036854775807}`,
		`{"allowed":true,"revision":-1}`,
		`{"allowed":true} trailing`,
	}
	for _, b := range bad {
		if r, err := decodeReply(nil, []byte(b)); !errors.Is(err, ErrBadReply) {
			t.Errorf("decodeReply(%q) = %+v, %v; want ErrBadReply", b, r, err)
		}
	}
}

func TestDecodeServiceError(t *testing.T) {
	tests := []struct {
		code, desc, body string
		want             ServiceError
	}{
		{"400", "bad", `{"error":"bad_request","message":"cost: not a decimal"}`, ServiceError{400, "bad_request", "cost: not a decimal"}},
		{"503", "timeout", ``, ServiceError{503, "", "timeout"}},
		{"500", "x", `not json`, ServiceError{500, "", "x"}},
		{"abc", "x", `{}`, ServiceError{0, "", "x"}},
		{"", "only text", `{"error":"internal"}`, ServiceError{0, "internal", "only text"}},
	}
	for _, tt := range tests {
		h := nats.Header{}
		if tt.code != "" {
			h.Set(headerErrorCode, tt.code)
		}
		h.Set(headerError, tt.desc)
		_, err := decodeReply(h, []byte(tt.body))
		var se *ServiceError
		if !errors.As(err, &se) || *se != tt.want {
			t.Errorf("code %q body %q: %v, want %+v", tt.code, tt.body, err, tt.want)
		}
	}
}

func TestParseMicro(t *testing.T) {
	tests := map[string]int64{
		"0": 0, "1": 1e6, "12.5": 12_500_000, "0.000001": 1, "0.0000019": 1, "-2.5": -2_500_000,
		"9223372036854": 9_223_372_036_854_000_000, "9223372036854.775807": 1<<63 - 1,
	}
	for s, want := range tests {
		if got, ok := parseMicro(s); !ok || got != want {
			t.Errorf("parseMicro(%q) = %d, %v; want %d", s, got, ok, want)
		}
	}
	for _, s := range []string{"", "-", ".", "1.", ".5", "1e3", "1.2.3", "+1", " 1", "9223372036855", "9223372036854.775808", "99999999999999999999"} {
		if got, ok := parseMicro(s); ok {
			t.Errorf("parseMicro(%q) = %d, ok; want failure", s, got)
		}
	}
}

func TestParseCost(t *testing.T) {
	good := map[string]int64{"1": 1e6, "2.5": 2_500_000, "0.000001": 1, "1000000000": 1e15, "007.10": 7_100_000}
	for s, want := range good {
		if got, err := ParseCost(s); err != nil || got != want {
			t.Errorf("ParseCost(%q) = %d, %v; want %d", s, got, err, want)
		}
	}
	for _, s := range []string{"", "0", "0.0", "-1", "1e3", "1.", ".5", "1.0000001", "1000000000.1", "10000000000000000000", " 1", "1_0"} {
		if got, err := ParseCost(s); !errors.Is(err, ErrInvalidRequest) {
			t.Errorf("ParseCost(%q) = %d, %v; want ErrInvalidRequest", s, got, err)
		}
	}
}

// FuzzDecodeReply: the reply decoder never panics, and what it accepts
// satisfies the Result invariants and agrees with encoding/json.
func FuzzDecodeReply(f *testing.F) {
	seeds := []string{
		`{"allowed":true,"policy":"acme-search","revision":12,"remaining":12.5,"retry_after_ms":0,"reset_after_ms":4000}`,
		`{"allowed":false,"policy":"p","revision":1,"remaining":0,"retry_after_ms":-1,"reset_after_ms":1}`,
		`{"allowed":true,"policy":"","revision":0,"remaining":0,"retry_after_ms":0,"reset_after_ms":0,"shadow_denied":true}`,
		`{"allowed":true,"remaining":"5"}`,
		`{"allowed":true,"remaining":0.0000001}`,
		`{"error":"bad_request","message":"x"}`,
		``, `{`, `null`, `{"allowed":null}`,
	}
	for _, s := range seeds {
		f.Add([]byte(s), "")
		f.Add([]byte(s), "400")
	}
	f.Add([]byte(`{"error":"too_large"}`), "413")
	f.Add([]byte(`{}`), "x")
	f.Fuzz(func(t *testing.T, data []byte, code string) {
		var h nats.Header
		if code != "" {
			h = nats.Header{headerErrorCode: []string{code}}
		}
		r, err := decodeReply(h, data)
		if err != nil {
			var se *ServiceError
			if r != nil || (!errors.Is(err, ErrBadReply) && !errors.As(err, &se)) {
				t.Fatalf("decodeReply: %+v, %v", r, err)
			}
			return
		}
		if code != "" {
			t.Fatalf("error code %q decoded as a result %+v", code, r)
		}
		if r.RetryAfter < 0 || r.ResetAfter < 0 || (r.Never && r.RetryAfter != 0) || r.Source != SourceService {
			t.Fatalf("invariants broken: %+v", r)
		}
		if m, ok := r.Remaining.Micro(); !ok || m < 0 {
			t.Fatalf("remaining %q does not parse", r.Remaining)
		}
		var ref map[string]any
		if err := json.Unmarshal(data, &ref); err != nil {
			t.Fatalf("accepted %q that encoding/json rejects: %v", data, err)
		}
		if ref["allowed"] != r.Allowed {
			t.Fatalf("allowed %v, encoding/json says %v", r.Allowed, ref["allowed"])
		}
	})
}

// FuzzParseCost: accepted costs are in range and round-trip through their
// canonical decimal form.
func FuzzParseCost(f *testing.F) {
	for _, s := range []string{"1", "2.5", "0.000001", "1000000000", "1e3", "-1", "0", "1.0000001", "00.50"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		m, err := ParseCost(s)
		if err != nil {
			if !errors.Is(err, ErrInvalidRequest) {
				t.Fatalf("ParseCost(%q): %v", s, err)
			}
			return
		}
		if m <= 0 || m > MaxCost*1_000_000 {
			t.Fatalf("ParseCost(%q) = %d out of range", s, m)
		}
		if back, err := ParseCost(string(microDecimal(m))); err != nil || back != m {
			t.Fatalf("ParseCost(%q) = %d, but %q gives %d, %v", s, m, microDecimal(m), back, err)
		}
		if p, ok := parseMicro(s); !ok || p != m {
			t.Fatalf("ParseCost(%q) = %d, parseMicro = %d, %v", s, m, p, ok)
		}
	})
}

// FuzzAppendRequest: the hand-written request encoder always produces JSON
// that encoding/json decodes to the same request (strings that are valid
// UTF-8 round-trip exactly).
func FuzzAppendRequest(f *testing.F) {
	f.Add("tenant", "acme", "v7 plan", "7f1c2e", int64(3), "", false)
	f.Add("a\"b", "\x00\n\t\\", "\u2028\xff", "", int64(1), "2.5", true)
	f.Fuzz(func(t *testing.T, k1, v1, v2, id string, cost int64, decimal string, dry bool) {
		d := map[string]string{k1: v1, "second": v2}
		o := decideOptions{cost: decimal, requestID: id, dryRun: dry}
		b := appendRequest(nil, d, cost, &o)
		var got seenRequest
		if err := json.Unmarshal(b, &got); err != nil {
			t.Fatalf("appendRequest wrote invalid JSON %q: %v", b, err)
		}
		for _, s := range []string{k1, v1, v2, id, decimal} {
			if !utf8.ValidString(s) {
				return
			}
		}
		if decimal != "" {
			var s string
			if err := json.Unmarshal(got.Cost, &s); err != nil || s != decimal {
				t.Fatalf("cost %s, want %q", got.Cost, decimal)
			}
		} else if string(got.Cost) != strconv.FormatInt(cost, 10) {
			t.Fatalf("cost %s, want %d", got.Cost, cost)
		}
		if got.RequestID != id || got.DryRun != dry || len(got.Descriptor) != len(d) {
			t.Fatalf("round trip of %q: %+v", b, got)
		}
		for k, v := range d {
			if got.Descriptor[k] != v {
				t.Fatalf("descriptor[%q] = %q, want %q (%q)", k, got.Descriptor[k], v, b)
			}
		}
	})
}

// TestReplyPartitionHint: the hint comes from the reply's "partition"
// field, from the header older nodes set when the field is absent, and is
// empty when neither is there.
func TestReplyPartitionHint(t *testing.T) {
	body := `{"allowed":true,"policy":"p","revision":1,"remaining":3,"retry_after_ms":0,"reset_after_ms":0`
	for _, tt := range []struct {
		body   string
		header string
		want   string
	}{
		{body + `,"partition":12}`, "", "12"},
		{body + `,"partition":12}`, "7", "12"},
		{body + `}`, "7", "7"},
		{body + `}`, "", ""},
	} {
		h := nats.Header{}
		if tt.header != "" {
			h.Set(PartitionHeader, tt.header)
		}
		r, hint, err := decodeReplyHint(h, []byte(tt.body))
		if err != nil || !r.Allowed || hint != tt.want {
			t.Errorf("%s (header %q): hint %q, %v; want %q", tt.body, tt.header, hint, err, tt.want)
		}
	}
}
