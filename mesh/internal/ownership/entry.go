package ownership

import (
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strconv"

	"github.com/limitmesh/limitmesh/internal/wire"
)

// NodeIDRE is the form of a node id: [A-Za-z0-9_-]{1,64}.
var NodeIDRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)

// ErrCorrupt is returned, wrapped, for a shards bucket entry no node wrote.
var ErrCorrupt = errors.New("mesh: corrupt shards entry")

// partValue is the JSON value of a part.<n> entry.
type partValue struct {
	Node string `json:"node"`
	// Epoch is 0 in a claiming write (the epoch is that entry's own
	// revision) and the claim's revision in renewals.
	Epoch uint64 `json:"epoch,omitempty"`
	// From, in a claiming write, lists the nodes whose state journals the
	// claimer adopts the partition's records from (the state journal), oldest
	// first. Renewals, written once the adoption is done, carry none: a
	// node claiming over an entry that was never renewed adopts from these
	// too, so a claimer that failed before finishing loses nothing.
	From []string `json:"from,omitempty"`
}

// maxAdoptSources bounds partValue.From (a chain of claimers that each
// failed to finish adopting; the oldest are dropped beyond it).
const maxAdoptSources = 8

// decodePartValue decodes a part.<n> value. It never panics.
func decodePartValue(b []byte) (partValue, error) {
	var v partValue
	if err := json.Unmarshal(b, &v); err != nil {
		return v, fmt.Errorf("%w: shard entry: %v", ErrCorrupt, err)
	}
	if !NodeIDRE.MatchString(v.Node) {
		return v, fmt.Errorf("%w: shard entry: node %q", ErrCorrupt, v.Node)
	}
	if len(v.From) == 0 {
		v.From = nil
	}
	if len(v.From) > maxAdoptSources {
		return v, fmt.Errorf("%w: shard entry: %d adoption sources", ErrCorrupt, len(v.From))
	}
	for _, f := range v.From {
		if !NodeIDRE.MatchString(f) {
			return v, fmt.Errorf("%w: shard entry: adoption source %q", ErrCorrupt, f)
		}
	}
	return v, nil
}

func appendPartValue(dst []byte, v partValue) []byte {
	dst = append(dst, `{"node":`...)
	dst = wire.AppendString(dst, v.Node)
	if v.Epoch != 0 {
		dst = append(dst, `,"epoch":`...)
		dst = strconv.AppendUint(dst, v.Epoch, 10)
	}
	if len(v.From) > 0 {
		dst = append(dst, `,"from":[`...)
		for i, f := range v.From {
			if i > 0 {
				dst = append(dst, ',')
			}
			dst = wire.AppendString(dst, f)
		}
		dst = append(dst, ']')
	}
	return append(dst, '}')
}

// Sources returns the journals a claim over the shards entry e would adopt
// partition records from, oldest first (the rule of adoptSources): the
// sources of an unfinished claim, then the node the entry names. None for
// a deleted entry; an entry no node wrote names nobody.
func Sources(e Entry) []string {
	if e.Deleted {
		return nil
	}
	v, err := decodePartValue(e.Value)
	if err != nil {
		return nil
	}
	o := partObs{exists: true, node: v.Node, rev: e.Rev}
	if v.Epoch == 0 {
		o.from = v.From
	}
	return adoptSources(o)
}
