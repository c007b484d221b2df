package usage

import (
	"crypto/rand"
	"encoding/hex"
	"strconv"
	"strings"
)

// Record ids (CONTRACT.md §6: unique per decision and stable).
//
// An origin is "<node>.<boot>": the node's id and a token unique per start
// of its process ([NewBoot]). Two forms of id exist:
//
//	<node>.<boot>.<n>             an ordinary record: n is a per-publisher
//	                              counter (decimal), assigned by Publisher.Add
//	<node>.<boot>.j<jseq>.<idx>   a journalled record: jseq is the sequence of
//	                              the state journal message that holds the
//	                              decision, idx its index in that message
//
// A journalled record may be published again (by its node after a restart,
// or by the next owner of its partition) with the same id; one publisher
// always publishes one origin's journalled records of one policy in
// increasing (jseq, idx) order, which is what lets the ledger count each
// once (see docs/protocol.md, "Usage stream and ledger"). Node ids are
// [A-Za-z0-9_-]{1,64} (mesh) and boots [A-Za-z0-9_-]{1,64} not of the form
// j<digits>, so both forms parse back unambiguously.

// NewBoot returns a fresh boot token: 16 lowercase hex digits from
// crypto/rand (never of the form j<digits>).
func NewBoot() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// validToken reports whether s is a node id or boot token:
// [A-Za-z0-9_-]{1,64}.
func validToken(s string) bool {
	if s == "" || len(s) > 64 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}

// isJournalToken reports whether s is "j" followed by 1 or more digits.
func isJournalToken(s string) bool {
	if len(s) < 2 || s[0] != 'j' {
		return false
	}
	for i := 1; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}

// Origin returns "<node>.<boot>".
func Origin(node, boot string) string { return node + "." + boot }

// JournalID returns the id of the record of the decision at index idx of
// state journal message jseq, journalled by origin node.boot:
// "<node>.<boot>.j<jseq>.<idx>".
func JournalID(node, boot string, jseq uint64, idx uint32) string {
	return string(AppendJournalID(make([]byte, 0, len(node)+len(boot)+24), node, boot, jseq, idx))
}

// AppendJournalID appends [JournalID](node, boot, jseq, idx) to dst.
func AppendJournalID(dst []byte, node, boot string, jseq uint64, idx uint32) []byte {
	dst = append(dst, node...)
	dst = append(dst, '.')
	dst = append(dst, boot...)
	dst = append(dst, ".j"...)
	dst = strconv.AppendUint(dst, jseq, 10)
	dst = append(dst, '.')
	return strconv.AppendUint(dst, uint64(idx), 10)
}

// JournalPos is the position of a journalled record: the journal message's
// sequence and the record's index in it, ordered by (JSeq, Idx).
type JournalPos struct {
	JSeq uint64
	Idx  uint32
}

// Less reports whether p comes before q.
func (p JournalPos) Less(q JournalPos) bool {
	return p.JSeq < q.JSeq || p.JSeq == q.JSeq && p.Idx < q.Idx
}

// ParseJournalID splits a journalled record's id into its origin
// ("<node>.<boot>", everything before the last two tokens) and position.
// ok is false for any other id (ordinary ids among them), and for numbers
// not written as JournalID writes them (a leading zero): one position has
// one id, so the ledger's watermarks never take one record for another.
func ParseJournalID(id string) (origin string, pos JournalPos, ok bool) {
	i := strings.LastIndexByte(id, '.')
	if i <= 0 || !canonicalUint(id[i+1:]) {
		return "", JournalPos{}, false
	}
	idx, err := strconv.ParseUint(id[i+1:], 10, 32)
	if err != nil {
		return "", JournalPos{}, false
	}
	j := strings.LastIndexByte(id[:i], '.')
	if j <= 0 || !isJournalToken(id[j+1:i]) || !canonicalUint(id[j+2:i]) {
		return "", JournalPos{}, false
	}
	jseq, err := strconv.ParseUint(id[j+2:i], 10, 64)
	if err != nil {
		return "", JournalPos{}, false
	}
	return id[:j], JournalPos{JSeq: jseq, Idx: uint32(idx)}, true
}

// canonicalUint reports whether s is a decimal number as strconv writes
// one: no leading zero (except "0" itself). The digits are checked by the
// caller's parse.
func canonicalUint(s string) bool { return len(s) < 2 || s[0] != '0' }
