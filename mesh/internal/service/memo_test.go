package service

import (
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/internal/storetest"
	"github.com/limitmesh/limitmesh/policies"
)

// TestMemoRules: an entry is used only under the snapshot it was made
// with; bodies with a request_id, long bodies and unmatched bodies are not
// remembered; a full memo stays at its bound.
func TestMemoRules(t *testing.T) {
	p := tbPolicy(t, "p", 1, "1/s", 1, "")
	s1 := policies.NewSnapshot(nil).With(p)
	s2 := s1.With(tbPolicy(t, "q", 2, "1/s", 1, ""))
	var m reqMemo
	body := []byte(`{"descriptor":{"tenant":"a"}}`)
	if m.get(body, s1) != nil {
		t.Fatal("empty memo: a hit")
	}
	m.put(body, s1, request{}, p, "k", 3, "")
	if e := m.get(body, s1); e == nil || e.key != "k" || e.part != 3 {
		t.Fatalf("get after put: %+v", e)
	}
	if m.get(body, s2) != nil {
		t.Fatal("an entry of another snapshot was used")
	}
	m.put([]byte(`{"descriptor":{"tenant":"b"}}`), s2, request{}, p, "k2", 0, "")
	if m.get(body, s1) != nil || len(m.m) != 1 {
		t.Fatalf("a put under a new snapshot kept the old entries (%d)", len(m.m))
	}

	m.put([]byte(`{"descriptor":{"tenant":"c"},"request_id":"x"}`), s2, request{id: "x"}, p, "k3", 0, "")
	m.put([]byte(`{"descriptor":{"tenant":"d"}}`), s2, request{}, nil, "k4", 0, "") // no policy
	long := []byte(`{"descriptor":{"tenant":"` + strings.Repeat("e", memoMaxBody) + `"}}`)
	m.put(long, s2, request{}, p, "k5", 0, "")
	if len(m.m) != 1 || m.get(long, s2) != nil {
		t.Fatalf("%d entries: a request_id, unmatched or long body was remembered", len(m.m))
	}

	for i := range memoMaxEntries + 100 {
		m.put([]byte(`{"descriptor":{"tenant":"`+strconv.Itoa(i)+`"}}`), s2, request{}, p, "k", 0, "")
	}
	if len(m.m) != memoMaxEntries {
		t.Fatalf("%d entries, bound %d", len(m.m), memoMaxEntries)
	}
}

// TestMemoFollowsPolicyChange: a body decided (and remembered) under one
// version of a policy is decided under the next version once it is
// installed, with its new key dimensions.
func TestMemoFollowsPolicyChange(t *testing.T) {
	p1 := tbPolicy(t, "p", 4, "1/h", 2, "")
	n := offlineService(t, memStore{storetest.NewMem()}, time.Second, p1)
	body := `{"descriptor":{"tenant":"a","plan":"x"}}`
	for range 2 {
		if rep := n.decideOffline(t, body); !strings.HasPrefix(string(rep.body), `{"allowed":true,"policy":"p","revision":4,`) {
			t.Fatalf("under revision 4: %s %s", rep.code, rep.body)
		}
	}
	if rep := n.decideOffline(t, body); !strings.HasPrefix(string(rep.body), `{"allowed":false,"policy":"p","revision":4,`) {
		t.Fatalf("third under revision 4 (burst 2): %s", rep.body)
	}

	// Revision 5 keys on the plan too: a key of its own, full.
	p2 := tbPolicy(t, "p", 5, "1/h", 2, `,"key":["tenant","plan"]`)
	n.set.Put(p2, 0)
	if rep := n.decideOffline(t, body); !strings.HasPrefix(string(rep.body), `{"allowed":true,"policy":"p","revision":5,"remaining":1,`) {
		t.Fatalf("under revision 5: %s %s", rep.code, rep.body)
	}
	// A body lacking the plan is now a 400 (it was not under revision 4).
	if rep := n.decideOffline(t, `{"descriptor":{"tenant":"a"}}`); rep.code != "400" {
		t.Fatalf("without the plan under revision 5: %s %s", rep.code, rep.body)
	}
}

// TestMemoHintAfterRemoval: a remembered body whose key entry was removed
// from the key table (swept, or its partition dropped) is decided on the
// table's entry, never on the removed one: one state per key.
func TestMemoHintAfterRemoval(t *testing.T) {
	p := tbPolicy(t, "p", 4, "1/h", 3, "")
	n := offlineService(t, memStore{storetest.NewMem()}, time.Second, p)
	body := `{"descriptor":{"tenant":"a"}}`
	n.decideOffline(t, body)
	m := n.memo.get([]byte(body), n.set.Snapshot())
	if m == nil || m.ent.Load() == nil {
		t.Fatal("the body's key entry was not remembered")
	}
	old := m.ent.Load()
	// Sweep every idle key: the state is in the store, the entry gone.
	n.cfg.Keys.Sweep(time.Now().Add(time.Hour).UnixNano(), 0)
	if !old.Gone() {
		t.Fatal("the swept entry is not marked gone")
	}

	// The second spend starts from the stored state (a fresh entry would
	// leave 2): 1 left, plus what 1/h refilled meanwhile (a micro-unit per
	// 3.6 ms on a busy machine).
	rep := n.decideOffline(t, body)
	var got struct {
		Allowed   bool
		Remaining float64
	}
	if err := json.Unmarshal(rep.body, &got); err != nil || !got.Allowed || got.Remaining < 1 || got.Remaining >= 1.5 ||
		!strings.HasPrefix(string(rep.body), `{"allowed":true,"policy":"p","revision":4,"remaining":1`) {
		t.Fatalf("after the removal: %s %s", rep.code, rep.body)
	}
	if now := m.ent.Load(); now == nil || now == old || now.Gone() {
		t.Fatalf("hint %p after the removal of %p: want a live entry of its own", now, old)
	}
}
