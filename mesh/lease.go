package mesh

import (
	"context"
	"time"

	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/nats-io/nats.go/jetstream"
)

// Grant is a grant of a leased key (CONTRACT §8) as the key's record holds
// it: Units debited from the key's limits for Holder (a node id) in the
// owner's Epoch, Spent as its holder last reported, spendable until
// Expires (the owner's clock; the owner counts it until a skew margin
// later, LeaseSkewMargin).
type Grant struct {
	ID      uint64
	Epoch   uint64
	Holder  string
	Units   int64 // micro-units
	Spent   int64 // micro-units
	At      time.Time
	Expires time.Time
}

// ReadGrants returns the grants in the latest durable record of a limit key
// (ReadStateRecord), outstanding or expired but not yet dropped, and the
// key's grant sequence (the id of the last grant made). For diagnostics
// and tests.
func ReadGrants(ctx context.Context, js jetstream.JetStream, prefix, key string) ([]Grant, uint64, error) {
	b, err := ReadStateRecord(ctx, js, prefix, key)
	if err != nil {
		return nil, 0, err
	}
	rec, err := keyrec.Decode(b)
	if err != nil {
		return nil, 0, err // matches ErrCorruptRecord
	}
	gs := make([]Grant, len(rec.Grants))
	for i, g := range rec.Grants {
		gs[i] = Grant{ID: g.ID, Epoch: g.Epoch, Holder: g.Holder, Units: g.Units, Spent: g.Spent,
			At: time.Unix(0, g.At), Expires: time.Unix(0, g.Expires)}
	}
	return gs, rec.GrantSeq, nil
}
