package shadow

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"

	"github.com/limitmesh/limitmesh/policies"
)

// WithoutShadow returns the policy document doc of the candidate name
// without its top-level "shadow" member: the document that makes the
// candidate live (`limitmesh shadow promote`). Every other byte is kept as
// it is (the member and the comma that separated it go; the whitespace
// around them mostly stays). doc must be a valid policy document with
// "shadow": true, else the error matches [ErrNotCandidate] (false or
// absent) or [ErrInvalidDocument] (not a valid policy document); the
// result is checked to parse to the same policy, live.
func WithoutShadow(name string, doc []byte) ([]byte, error) {
	p, err := policies.Parse(name, doc)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalidDocument, err)
	}
	if !p.Shadow {
		return nil, fmt.Errorf("%w: %s has no \"shadow\": true", ErrNotCandidate, name)
	}
	start, end, err := shadowMember(doc)
	if err != nil {
		return nil, err
	}
	out := make([]byte, 0, len(doc))
	out = append(out, doc[:start]...)
	out = append(out, doc[end:]...)

	q, err := policies.Parse(name, out)
	if err != nil {
		return nil, fmt.Errorf("%w: without shadow: %v", ErrInvalidDocument, err)
	}
	p.Shadow = false
	a, _ := p.MarshalJSON()
	b, _ := q.MarshalJSON()
	if !bytes.Equal(a, b) || q.Shadow {
		return nil, fmt.Errorf("%w: removing \"shadow\" changed the policy", ErrInvalidDocument)
	}
	return out, nil
}

// shadowMember returns the byte range to cut to remove the top-level
// "shadow" member of the JSON object doc: from the comma before it to the
// end of its value, or, when it is the first member and others follow,
// from its key to the next key.
func shadowMember(doc []byte) (start, end int, err error) {
	dec := json.NewDecoder(bytes.NewReader(doc))
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return 0, 0, fmt.Errorf("%w: not a JSON object", ErrInvalidDocument)
	}
	prevEnd := int(dec.InputOffset()) // just after '{' or the previous value
	for first := true; dec.More(); first = false {
		t, err := dec.Token()
		if err != nil {
			return 0, 0, fmt.Errorf("%w: %v", ErrInvalidDocument, err)
		}
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return 0, 0, fmt.Errorf("%w: %v", ErrInvalidDocument, err)
		}
		valEnd := int(dec.InputOffset())
		if t != "shadow" {
			prevEnd = valEnd
			continue
		}
		if !first {
			return prevEnd, valEnd, nil
		}
		keyStart := skipSpace(doc, prevEnd)
		next := skipSpace(doc, valEnd)
		if next < len(doc) && doc[next] == ',' {
			return keyStart, skipSpace(doc, next+1), nil
		}
		return keyStart, valEnd, nil
	}
	if _, err := dec.Token(); err != nil && err != io.EOF {
		return 0, 0, fmt.Errorf("%w: %v", ErrInvalidDocument, err)
	}
	return 0, 0, fmt.Errorf("%w: no \"shadow\" member", ErrNotCandidate)
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}
