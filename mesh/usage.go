package mesh

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/limitmesh/limitmesh/internal/elector"
	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh/internal/keyrec"
	"github.com/limitmesh/limitmesh/mesh/internal/policyset"
	"github.com/limitmesh/limitmesh/shadow"
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

// startUsage starts the usage roles' parts: the usage stream, this node's
// publisher, the ledger and the shadow evaluator (each one active across
// the nodes with its role, under a lease). It returns the publisher.
func (b *base) startUsage(ctx, bgctx context.Context, s jsSetup, boot string) (*usage.Publisher, error) {
	if err := s.retry(ctx, "stream "+usage.StreamName(b.cfg.Prefix), func(ctx context.Context) error {
		_, err := usage.EnsureStream(ctx, s.js, usage.StreamConfig{Prefix: b.cfg.Prefix, Replicas: b.cfg.Replicas,
			Retention: b.cfg.UsageRetention, MaxBytes: b.cfg.UsageMaxBytes})
		return err
	}); err != nil {
		return nil, fmt.Errorf("mesh: usage stream: %w", err)
	}
	pub, err := usage.NewPublisher(s.js, usage.PublisherConfig{Prefix: b.cfg.Prefix, Node: b.cfg.NodeID, Boot: boot,
		Interval: b.cfg.UsageInterval, Registerer: b.reg, Logger: b.log})
	if err != nil {
		return nil, fmt.Errorf("mesh: usage publisher: %w", err)
	}
	if err := b.startLedger(ctx, bgctx, s); err != nil {
		return pub, err
	}
	if b.cfg.Roles.Has(RoleShadow) {
		if err := b.startShadow(bgctx, s.js); err != nil {
			return pub, err
		}
	}
	return pub, nil
}

// startLedger creates the ledger bucket if it is missing and, on a node
// with RoleLedger, starts the usage ledger's reconciler under its lease:
// every such node runs an elector, one reconciler is active at a time.
func (b *base) startLedger(ctx, bgctx context.Context, s jsSetup) error {
	if err := s.retry(ctx, "bucket "+usage.LedgerBucket(b.cfg.Prefix), func(ctx context.Context) error {
		_, err := usage.EnsureLedger(ctx, s.js, b.cfg.Prefix, b.cfg.Replicas)
		return err
	}); err != nil {
		return fmt.Errorf("mesh: usage ledger: %w", err)
	}
	if !b.cfg.Roles.Has(RoleLedger) {
		return nil
	}
	rec, err := usage.NewReconciler(ctx, s.js, usage.ReconcilerConfig{Prefix: b.cfg.Prefix, Node: b.cfg.NodeID,
		Replicas: b.cfg.Replicas, QuotaLimits: quotaLimits(b.policies),
		QuotaState: quotaState(s.js, b.cfg.Prefix, b.policies), Registerer: b.reg, Logger: b.log})
	if err != nil {
		return fmt.Errorf("mesh: usage ledger: %w", err)
	}
	el := elector.New(rec.KV(), usage.LedgerLeaderKey, b.cfg.NodeID, b.cfg.LeaseTime, b.log)
	b.bg.Go(func() { _ = el.Run(bgctx, rec.Run) })
	return nil
}

// startShadow starts the shadow evaluator of a node with RoleShadow: every
// such node runs one, and its elector keeps one of them active at a time.
func (b *base) startShadow(bgctx context.Context, js jetstream.JetStream) error {
	ev, err := shadow.NewEvaluator(js, shadow.Config{Prefix: b.cfg.Prefix, NodeID: b.cfg.NodeID,
		Replicas: b.cfg.Replicas, Lease: b.cfg.LeaseTime, Registerer: b.reg, Logger: b.log})
	if err != nil {
		return fmt.Errorf("mesh: shadow evaluator: %w", err)
	}
	b.bg.Go(func() { _ = ev.Run(bgctx) })
	return nil
}
