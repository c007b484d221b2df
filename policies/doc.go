// Package policies owns the policy model of limitmesh: the policy document
// (CONTRACT.md §3) and its strict parser, request descriptors and costs
// (CONTRACT.md §2), the canonical limit keys under which limiter state is
// stored (KEYS.md), matching a descriptor to its governing policy through an
// immutable [Snapshot], and the state transition when a policy changes
// (§28).
//
// Everything here is pure: no I/O, clocks, logging or globals beyond
// constant tables. Quantities are fixed point as in kvstate: micro-units
// (1 unit = 1,000,000) and nanoseconds; decimals written by humans become
// fixed point exactly once, while parsing, through github.com/cockroachdb/apd/v3.
//
// Every rejection is an [*Error] naming the offending field and matching
// [ErrInvalid]. Policies, descriptors and snapshots are values that are
// never modified once built, so they are safe to share between goroutines.
//
// This package imports kvstate only (of the project); the KV watcher that
// feeds snapshots lives with the node.
package policies
