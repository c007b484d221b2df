package integration

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// recordGrant is a grant of a leased key as its record holds it.
type recordGrant struct {
	ID, Epoch    uint64
	Holder       string
	Units, Spent int64 // micro-units
}

// decodeRecordGrants reads the grants section of a key record (the value
// of a rl_state key, or its journalled version) by the layout that
// docs/protocol.md ("The key record") gives, independently of the node's
// decoder: format 3, then policy, revision, version, rest_at, the states
// (skipped by their length), the dedupe entries (skipped), then the
// extension sections, of which tag 1 holds the grants. A record without
// a grants section holds none.
func decodeRecordGrants(b []byte) ([]recordGrant, error) {
	if len(b) == 0 || b[0] != 3 {
		return nil, errors.New("not a format 3 record")
	}
	b = b[1:]
	var err error
	uv := func() uint64 {
		v, n := binary.Uvarint(b)
		if n <= 0 {
			err = errors.New("truncated uvarint")
			return 0
		}
		b = b[n:]
		return v
	}
	sv := func() int64 { // zig-zag, as binary.Varint reads it
		u := uv()
		return int64(u>>1) ^ -int64(u&1)
	}
	skip := func(n uint64) []byte {
		if err != nil || n > uint64(len(b)) {
			err = errors.New("truncated bytes")
			return nil
		}
		s := b[:n]
		b = b[n:]
		return s
	}
	skip(uv()) // policy name
	uv()       // policy revision
	uv()       // version
	sv()       // rest_at
	skip(uv()) // states
	for i, n := uint64(0), uv(); i < n && err == nil; i++ {
		skip(16) // SHA-256(request_id)[:16]
		sv()     // at
		skip(1)  // flags
		sv()     // remaining
		sv()     // retry_after
		sv()     // reset_after
		uv()     // revision
	}
	var gs []recordGrant
	for err == nil && len(b) > 0 {
		tag := skip(1)
		body := skip(uv())
		if err != nil || tag[0] != 1 {
			continue
		}
		b, body = body, b // read the section, then go on after it
		uv()              // grant sequence
		for i, n := uint64(0), uv(); i < n && err == nil; i++ {
			var g recordGrant
			g.ID, g.Epoch = uv(), uv()
			g.Holder = string(skip(uv()))
			g.Units, g.Spent = sv(), sv()
			sv() // at
			sv() // expires
			gs = append(gs, g)
		}
		if err == nil && len(b) != 0 {
			err = fmt.Errorf("%d bytes after the grants", len(b))
		}
		b = body
	}
	return gs, err
}
