// Package usage owns the usage stream of limitmesh (CONTRACT.md §6): the
// usage record and its JSON batch codec, the names of the stream, its
// subjects, consumers and the ledger bucket, the batched per-node
// [Publisher] and the [Reconciler] that keeps the exact ledger (one active
// at a time, under the elector of internal/elector).
//
// Units are as in kvstate: costs are int64 micro-units (1 unit =
// 1,000,000), record times are Unix microseconds (t_us), durations are
// time.Duration. Ledger totals are exact decimals (apd).
//
// Dependencies: this package imports kvstate and policies of the project and
// never mesh; the node (mesh) wires it: it calls [EnsureStream] at start,
// feeds one [Publisher] with a record per decision, and runs the
// [Reconciler] under an elector (internal/elector).
package usage
