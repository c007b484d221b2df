package shadow

import (
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// entry is a policy bucket entry as a watcher delivers it.
type entry struct {
	key string
	val string
	rev uint64
	op  jetstream.KeyValueOp
}

func (e entry) Bucket() string                  { return "rl_policies" }
func (e entry) Key() string                     { return e.key }
func (e entry) Value() []byte                   { return []byte(e.val) }
func (e entry) Revision() uint64                { return e.rev }
func (e entry) Created() time.Time              { return time.Unix(int64(e.rev), 0) } // put at second rev
func (e entry) Delta() uint64                   { return 0 }
func (e entry) Operation() jetstream.KeyValueOp { return e.op }

// TestCandidateSet: only valid shadow policies are candidates, at their
// entry's revision; an invalid value keeps the last valid version; a
// policy made live, deleted or purged stops being one; keys that are not
// policy names are ignored. since is when the earliest candidate's current
// revision was put.
func TestCandidateSet(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	set := candidateSet{byName: map[string]*policyT{}, created: map[string]time.Time{}}
	live := `{"match": {"tenant": "acme"}, "limits": [{"algorithm": "gcra", "rate": "1/s", "burst": 2}]}`
	cand := `{"match": {"tenant": "acme"}, "limits": [{"algorithm": "gcra", "rate": "1/s", "burst": 2}], "shadow": true}`
	steps := []struct {
		e       entry
		changed bool
		want    map[string]uint64 // candidate -> revision
	}{
		{entry{"a", live, 1, jetstream.KeyValuePut}, false, map[string]uint64{}},
		{entry{"b", cand, 2, jetstream.KeyValuePut}, true, map[string]uint64{"b": 2}},
		{entry{"b", `{"limits": []}`, 3, jetstream.KeyValuePut}, false, map[string]uint64{"b": 2}},
		{entry{"a", cand, 4, jetstream.KeyValuePut}, true, map[string]uint64{"a": 4, "b": 2}},
		{entry{"Bad.Name", cand, 5, jetstream.KeyValuePut}, false, map[string]uint64{"a": 4, "b": 2}},
		{entry{"b", cand, 6, jetstream.KeyValuePut}, true, map[string]uint64{"a": 4, "b": 6}},
		{entry{"a", live, 7, jetstream.KeyValuePut}, true, map[string]uint64{"b": 6}},
		{entry{"b", "", 8, jetstream.KeyValueDelete}, true, map[string]uint64{}},
		{entry{"c", "", 9, jetstream.KeyValuePurge}, false, map[string]uint64{}},
	}
	for i, st := range steps {
		if got := set.update(st.e, log); got != st.changed {
			t.Errorf("step %d: changed = %v, want %v", i, got, st.changed)
		}
		list := set.list()
		if len(list) != len(st.want) {
			t.Fatalf("step %d: %d candidates, want %v", i, len(list), st.want)
		}
		var since time.Time
		for _, p := range list {
			if rev, ok := st.want[p.Name]; !ok || rev != p.Revision || !p.Shadow {
				t.Fatalf("step %d: candidate %s@%d, want %v", i, p.Name, p.Revision, st.want)
			}
			if at := time.Unix(int64(p.Revision), 0); since.IsZero() || at.Before(since) {
				since = at
			}
		}
		if got := set.since(); !got.Equal(since) {
			t.Errorf("step %d: since %v, want %v", i, got, since)
		}
	}
}
