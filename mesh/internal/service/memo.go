package service

import (
	"sync"
	"sync/atomic"

	"github.com/limitmesh/limitmesh/mesh/internal/keys"
	"github.com/limitmesh/limitmesh/policies"
)

// The request memo. Gateways send the same few decide bodies over and over
// (one per tenant and operation, usually cost 1 and no request_id), and
// what the handler derives from a body alone is a pure function of the
// body and the policy snapshot: the decoded request, the policy that
// matches it, the limit key and its partition. The memo keeps that for
// recent bodies, so a repeated body skips decoding, matching and building
// the key (about 0.8 µs of the node's 2 µs per decision in place, and the
// allocations of the key and the descriptor).
//
// It is exact: an entry is used only under the snapshot it was made with
// (a policy change, which installs a new snapshot, empties the memo); only
// bodies that decoded and matched a policy are remembered, without a
// request_id (a retry's body is rarely seen twice) and at most
// memoMaxBody bytes long. It is bounded: at most memoMaxEntries entries;
// a put into a full memo first evicts one entry (the first a map walk
// gives, which is arbitrary).

const (
	memoMaxEntries = 1 << 14
	memoMaxBody    = 256
)

// memoEntry is what a decide body yields under one snapshot.
type memoEntry struct {
	req  request
	p    *policies.Policy
	key  string
	part int                        // -1: no router
	ent  atomic.Pointer[keys.Entry] // the key's entry here, once submitted (keys.Table.Submit)
	// tenant is the descriptor's own tenant ("" when it has none): the
	// entry serves a tenant caller only when it is the caller's.
	tenant string
}

// reqMemo maps decide bodies to their entries. Its methods are safe for
// concurrent use; the zero value is an empty memo.
type reqMemo struct {
	mu   sync.Mutex
	snap *policies.Snapshot
	m    map[string]*memoEntry
}

// get returns the entry of body under snap, or nil.
func (m *reqMemo) get(body []byte, snap *policies.Snapshot) *memoEntry {
	if len(body) > memoMaxBody {
		return nil
	}
	m.mu.Lock()
	if m.snap != snap {
		m.mu.Unlock()
		return nil
	}
	e := m.m[string(body)]
	m.mu.Unlock()
	return e
}

// put remembers what body yields under snap (req matched p, whose key is
// key in partition part) and returns the new entry, or nil when body does
// not qualify.
func (m *reqMemo) put(body []byte, snap *policies.Snapshot, req request, p *policies.Policy, key string, part int, tenant string) *memoEntry {
	if len(body) > memoMaxBody || req.id != "" || p == nil {
		return nil
	}
	e := &memoEntry{req: req, p: p, key: key, part: part, tenant: tenant}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.snap != snap || m.m == nil {
		m.snap = snap
		m.m = make(map[string]*memoEntry)
	}
	if _, ok := m.m[string(body)]; !ok && len(m.m) >= memoMaxEntries {
		for k := range m.m {
			delete(m.m, k)
			break
		}
	}
	m.m[string(body)] = e
	return e
}
