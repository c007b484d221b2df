package mesh

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/policyset"
	"github.com/limitmesh/limitmesh/usage"
	"github.com/nats-io/nats.go/jetstream"
)

// Usage records (CONTRACT §6, docs/protocol.md "Usage"). Every decision
// that is neither a dry run nor an error produces one. An admission of a
// strict or async policy is journalled with the record write that spends
// it (keyrec.Usage), published once that write commits with an id made of
// the journal message's origin, sequence and index, and published again,
// with the same id, by whoever adopts that journal: the ledger counts each
// id once. Everything else (denials, local and unmatched decisions, async
// admissions a lost write dropped, and admissions of a node without the
// journal) is published directly with an id of its own.

// Defaults for the usage settings of NodeConfig.
const (
	DefaultUsageInterval  = 250 * time.Millisecond
	DefaultUsageRetention = 24 * time.Hour
	DefaultUsageMaxBytes  = 1 << 30
)

// usageSink publishes usage through the node's publisher: it is the
// journal's journal.UsageSink and the direct path of the rest.
type usageSink struct {
	pub *usage.Publisher
}

// Add implements journal.UsageSink. The publisher queues each journalled
// record once: the journal offers a record again when it reads a journal
// again from its mark (its own, when it claims back a partition whose
// lease lapsed), and those it queued already are skipped.
func (u usageSink) Add(node, boot string, seq uint64, idx uint32, key string, record []byte, us *keyrec.Usage) {
	policy, _, _ := keyrec.PeekPolicy(record)
	u.pub.AddJournal(policy, node, boot, usage.JournalPos{JSeq: seq, Idx: idx}, u.record("", key, us))
}

// Sync implements journal.UsageSink.
func (u usageSink) Sync(done func(error)) {
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		done(u.pub.Sync(ctx))
	}()
}

// lost publishes the usage of async admissions a lost write dropped, with
// ids of the node's own (keys.Config.LostUsage).
func (u usageSink) lost(policy, key string, us []keyrec.Usage) {
	if u.pub == nil {
		return
	}
	for i := range us {
		u.pub.Add(policy, u.record("", key, &us[i]))
	}
}

// directOf publishes the usage of a record written without the journal
// (member.BucketStore.Usage).
func (u usageSink) directOf(key string, record []byte, us []keyrec.Usage) {
	policy, _, _ := keyrec.PeekPolicy(record)
	u.lost(policy, key, us)
}

// record is the usage record of admission us of key: an allowed decision,
// or a reservation's end (its settled cost, 0 for a release, and its id).
func (usageSink) record(id, key string, us *keyrec.Usage) usage.Record {
	return usage.Record{ID: id, TimeUs: us.At / 1000, Revision: us.Revision, Key: key,
		Descriptor: us.Desc, Cost: us.Cost, Allowed: true, RequestID: us.RequestID, Reservation: us.Reservation}
}

// quotaLimits returns the quota limits of policy name in force, for the
// reconciler.
func quotaLimits(set *policyset.Set) func(string) []usage.QuotaLimit {
	return func(name string) []usage.QuotaLimit {
		p := set.Current(name)
		if p == nil {
			return nil
		}
		var out []usage.QuotaLimit
		for _, l := range p.Limits {
			if l.Algorithm == kvstate.Quota {
				out = append(out, usage.QuotaLimit{Name: l.Name, Period: l.Period.String()})
			}
		}
		return out
	}
}

// quotaState returns what the limiter's own state of key has spent, per
// quota limit, in the period containing at: from the key's latest durable
// record (ReadStateRecord: the journals its partition's owner would
// adopt, else the state bucket), for the reconciler.
func quotaState(js jetstream.JetStream, prefix string, set *policyset.Set) func(context.Context, string, string, time.Time) (map[string]int64, bool, error) {
	return func(ctx context.Context, name, key string, at time.Time) (map[string]int64, bool, error) {
		val, err := ReadStateRecord(ctx, js, prefix, key)
		if errors.Is(err, kvstate.ErrNotFound) {
			return nil, false, nil
		}
		if err != nil {
			return nil, false, err
		}
		rec, err := keyrec.Decode(val)
		if err != nil {
			return nil, false, fmt.Errorf("the state of %s: %w", key, err)
		}
		p := set.Current(name)
		if p == nil || rec.Policy != name {
			return nil, false, nil
		}
		out := map[string]int64{}
		for i, l := range p.Limits {
			if l.Algorithm != kvstate.Quota || i >= len(rec.States) {
				continue
			}
			spent, ok := kvstate.QuotaSpent(l.Limit, rec.States[i], at.UnixNano())
			if !ok {
				return nil, false, nil
			}
			// An open reservation's units are spent in the state and
			// reach the ledger when it ends (with what it settles).
			period := kvstate.Advance(l.Limit, kvstate.State{}, at.UnixNano()).WindowStart
			for _, v := range rec.Reservations {
				if v.Outcome == keyrec.Open && kvstate.Advance(l.Limit, kvstate.State{}, v.At).WindowStart == period {
					spent -= v.Units
				}
			}
			out[l.Name] = max(spent, 0)
		}
		return out, true, nil
	}
}
