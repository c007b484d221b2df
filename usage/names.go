package usage

import "strings"

// The durable consumers of the usage stream (CONTRACT.md §6, §7).
const (
	// LedgerConsumer is the durable pull consumer the reconciler reads
	// the usage stream with.
	LedgerConsumer = "limitmesh-ledger"
	// ShadowConsumer is the durable pull consumer of the shadow
	// evaluator.
	ShadowConsumer = "limitmesh-shadow"
)

// UnmatchedToken is the subject token of the decisions no policy matched:
// policy names start with [a-z0-9], so it names no policy.
const UnmatchedToken = "_"

// StreamName is the usage stream of the installation with subject prefix
// prefix: "RL_USAGE" for "rl".
func StreamName(prefix string) string { return strings.ToUpper(prefix) + "_USAGE" }

// Subjects is the subject filter of the usage stream: "rl.usage.>" for
// "rl".
func Subjects(prefix string) string { return prefix + ".usage.>" }

// Subject is the subject a node publishes policy's records to:
// "rl.usage.<policy>", or "rl.usage._" for policy "" (no policy matched).
func Subject(prefix, policy string) string {
	if policy == "" {
		policy = UnmatchedToken
	}
	return prefix + ".usage." + policy
}

// PolicyOfSubject returns the policy of a usage subject of prefix ("" for
// "<prefix>.usage._") and whether subject is one.
func PolicyOfSubject(prefix, subject string) (string, bool) {
	rest, ok := strings.CutPrefix(subject, prefix+".usage.")
	if !ok || rest == "" || strings.Contains(rest, ".") {
		return "", false
	}
	if rest == UnmatchedToken {
		return "", true
	}
	return rest, true
}

// LedgerBucket is the KV bucket of the usage ledger: "rl_ledger" for "rl".
func LedgerBucket(prefix string) string { return prefix + "_ledger" }
