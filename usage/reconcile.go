package usage

import (
	"context"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Quota reconciliation (CONTRACT.md §6): once the stream is consumed, a
// key's allowed_units for a period equal what its quota limit spent in that
// period. While the ledger is caught up, every ReconcileInterval, the
// session compares each key that had allowed records applied, once no
// record of it was applied for Settle (so records still in flight do not
// show as differences), for the period containing the key's latest record:
// a day quota with the day entry, a month quota with the month entry, a
// week quota (Monday 00:00 UTC) with the sum of its days; hour quotas are
// not compared. Each comparison is counted in
// limitmesh_reconcile_checks_total{policy}, each difference in
// limitmesh_reconcile_corrections_total{policy} and logged at debug level;
// a key is compared again when new records of it are applied.

// reconcileCheck is one key to compare.
type reconcileCheck struct {
	pk     policyKey
	lastUs int64
	limits []QuotaLimit
}

// quotaDays returns the ledger periods whose allowed units make up the
// spend of a quota of period containing tUs (nil for periods the ledger
// cannot compare).
func quotaPeriods(period string, tUs int64) []string {
	t := time.UnixMicro(tUs).UTC()
	switch period {
	case "day":
		return []string{t.Format(dayFormat)}
	case "month":
		return []string{t.Format(monthFormat)}
	case "week":
		monday := time.Date(t.Year(), t.Month(), t.Day(), 0, 0, 0, 0, time.UTC).AddDate(0, 0, -((int(t.Weekday()) + 6) % 7))
		days := make([]string, 7)
		for i := range days {
			days[i] = monday.AddDate(0, 0, i).Format(dayFormat)
		}
		return days
	}
	return nil
}

func (s *session) reconcile(ctx context.Context) error {
	r := s.r
	if r.cfg.QuotaLimits == nil || r.cfg.QuotaState == nil {
		return nil
	}
	now := time.Now()
	var checks []reconcileCheck
	r.mu.Lock()
	for pk, tk := range r.tracked {
		switch {
		case tk.checkedUs >= tk.lastUs:
			if now.Sub(tk.appliedAt) > time.Hour {
				delete(r.tracked, pk)
			}
		case now.Sub(tk.appliedAt) >= r.cfg.Settle:
			checks = append(checks, reconcileCheck{pk: pk, lastUs: tk.lastUs})
		}
	}
	r.mu.Unlock()
	if len(checks) == 0 {
		return nil
	}
	needed := map[string]entryID{}
	for i := range checks {
		c := &checks[i]
		c.limits = r.cfg.QuotaLimits(c.pk.policy)
		for _, q := range c.limits {
			for _, per := range quotaPeriods(q.Period, c.lastUs) {
				id := entryID{c.pk.policy, per, c.pk.key}
				if s.core.entries[id] == nil {
					needed[TotalsKey(id.policy, id.period, id.key)] = id
				}
			}
		}
	}
	if err := s.loadKeys(ctx, needed, nil); err != nil {
		return err
	}
	for _, c := range checks {
		if ctx.Err() != nil {
			return nil
		}
		done := true
		if len(c.limits) > 0 {
			done = s.compare(ctx, c)
		}
		if done {
			r.mu.Lock()
			if tk := r.tracked[c.pk]; tk != nil {
				tk.checkedUs = max(tk.checkedUs, c.lastUs)
			}
			r.mu.Unlock()
		}
	}
	return nil
}

// compare compares one key's quota limits with the ledger; it reports
// false when the state could not be read (the key is compared again
// later).
func (s *session) compare(ctx context.Context, c reconcileCheck) bool {
	r := s.r
	qctx, cancel := context.WithTimeout(ctx, r.cfg.OpTimeout)
	units, ok, err := r.cfg.QuotaState(qctx, c.pk.policy, c.pk.key, time.UnixMicro(c.lastUs))
	cancel()
	if err != nil {
		r.log.Debug("quota state unavailable", "policy", c.pk.policy, "key", c.pk.key, "err", err)
		return false
	}
	if !ok {
		return true
	}
	for _, q := range c.limits {
		pers := quotaPeriods(q.Period, c.lastUs)
		spent, has := units[q.Name]
		if pers == nil || !has {
			continue
		}
		var ledger int64
		exact := true
		for _, per := range pers {
			e := s.core.entries[entryID{c.pk.policy, per, c.pk.key}]
			if e == nil {
				continue
			}
			v, ok := MicroUnits(&e.t.AllowedUnits)
			exact = exact && ok
			ledger += v + e.pendA
		}
		r.m.checks.WithLabelValues(c.pk.policy).Inc()
		// The policy's correction count exists (0) once it was compared.
		corrections := r.m.corrections.WithLabelValues(c.pk.policy)
		if !exact || ledger != spent {
			corrections.Inc()
			r.log.Debug("ledger and quota state differ", "policy", c.pk.policy, "key", c.pk.key,
				"limit", q.Name, "period", q.Period, "ledger_units", FormatMicro(ledger), "state_units", FormatMicro(spent))
		}
	}
	return true
}

// prune deletes the watermarks of origins whose latest record is older
// than the stream's retention (none of their records can be in the stream
// any more). Failures are logged and left for the next round.
func (s *session) prune(ctx context.Context) {
	r := s.r
	pctx, cancel := context.WithTimeout(ctx, r.cfg.OpTimeout)
	defer cancel()
	var keys []string
	for _, filter := range []string{marksPrefix + ">", marksHashed + ">"} {
		ks, err := r.store.Keys(pctx, filter)
		if err != nil {
			r.log.Debug("prune: list watermarks", "err", err)
			return
		}
		keys = append(keys, ks...)
	}
	horizon := time.Now().Add(-s.retention).UnixMicro()
	for _, k := range keys {
		data, rev, err := r.store.Get(pctx, k)
		if err != nil {
			continue
		}
		m, err := parseMarks(data)
		if err != nil || m.SeenUs >= horizon {
			continue
		}
		if o := s.core.origins[m.Origin]; o != nil && o.dirty {
			continue
		}
		if err := r.kv.Delete(pctx, k, jetstream.LastRevision(rev)); err != nil {
			r.log.Debug("prune: delete watermark", "key", k, "err", err)
			continue
		}
		delete(s.core.origins, m.Origin)
		r.log.Debug("pruned watermarks", "origin", m.Origin)
	}
}
