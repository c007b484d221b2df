package shadow

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/policies"
)

// candidateSet follows the candidates of a policy bucket: the valid
// policies with "shadow": true, each with its entry's revision. An invalid
// value leaves the last valid version of its policy in force (as for live
// policies, CONTRACT.md §3); a deleted or purged entry, or a valid one
// without "shadow": true, is no candidate.
type candidateSet struct {
	byName  map[string]*policies.Policy
	created map[string]time.Time // when each candidate's entry was put (the server's time)
}

// update applies one entry of the bucket and reports whether the set
// changed.
func (c *candidateSet) update(e jetstream.KeyValueEntry, log *slog.Logger) bool {
	name := e.Key()
	if policies.ValidateName(name) != nil {
		return false
	}
	old := c.byName[name]
	if e.Operation() != jetstream.KeyValuePut {
		c.drop(name)
		return old != nil
	}
	p, err := policies.Parse(name, e.Value())
	if err != nil {
		log.Warn("shadow: invalid policy ignored; its last valid version stays", "policy", name, "revision", e.Revision(), "err", err)
		return false
	}
	if !p.Shadow {
		c.drop(name)
		return old != nil
	}
	p.Revision = e.Revision()
	c.byName[name] = p
	if old == nil || old.Revision != p.Revision {
		c.created[name] = e.Created()
		return true
	}
	return false
}

func (c *candidateSet) drop(name string) {
	delete(c.byName, name)
	delete(c.created, name)
}

// since returns when the earliest of the candidates was put: the stream
// time an evaluation of them from nothing starts at.
func (c *candidateSet) since() time.Time {
	var t time.Time
	for _, at := range c.created {
		if t.IsZero() || at.Before(t) {
			t = at
		}
	}
	return t
}

// list returns the candidates by name.
func (c *candidateSet) list() []*policies.Policy {
	out := make([]*policies.Policy, 0, len(c.byName))
	for _, p := range c.byName {
		out = append(out, p)
	}
	slices.SortFunc(out, func(a, b *policies.Policy) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// candidateList is one version of the candidates, as watchCandidates sends
// it.
type candidateList struct {
	list []*policies.Policy
	// since is when the earliest of them was put (zero when there are
	// none): an evaluator without candidates until now starts evaluating
	// them at the first usage record stored at or after it.
	since time.Time
}

// watchCandidates watches the policy bucket until ctx ends, sending the
// candidate list on out once the bucket's current values are read and
// after every change (a reader that falls behind gets the latest list
// only). It waits for the bucket to exist.
func watchCandidates(ctx context.Context, js jetstream.JetStream, bucket string, out chan candidateList, log *slog.Logger) error {
	for {
		_, err := js.KeyValue(ctx, bucket)
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if !errors.Is(err, jetstream.ErrBucketNotFound) {
			log.Debug("shadow: open policy bucket", "bucket", bucket, "err", err)
		}
		if !sleepCtx(ctx, 250*time.Millisecond) {
			return ctx.Err()
		}
	}
	// Not kv.WatchAll, whose marker can come before a candidate's entry
	// while another policy is rewritten: the first list would lack it, its
	// summary would be deleted and its counts start again.
	w, err := kvstate.WatchAll(ctx, js, bucket)
	if err != nil {
		return fmt.Errorf("watch %s: %w", bucket, err)
	}
	defer w.Stop()
	set := candidateSet{byName: map[string]*policies.Policy{}, created: map[string]time.Time{}}
	initial := true
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case e, ok := <-w.Updates():
			if !ok {
				return fmt.Errorf("watch %s: closed", bucket)
			}
			changed := false
			if e == nil {
				initial, changed = false, true
			} else {
				changed = set.update(e, log)
			}
			if initial || !changed {
				continue
			}
			list := candidateList{list: set.list(), since: set.since()}
			select { // keep only the latest list
			case <-out:
			default:
			}
			out <- list
		}
	}
}

// sleepCtx waits d or until ctx ends; it reports whether d passed.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
