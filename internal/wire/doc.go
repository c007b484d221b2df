// Package wire holds the text primitives of limitmesh's wire formats, each
// written once: JSON string escaping ([AppendString]), micro-unit decimals
// ([AppendUnits]) and a JSON scanner ([Scanner]) that the hand-written
// decoders (decide requests, usage batches, Nats-Request-Info) read with.
//
// It imports the standard library only, so that every package of the
// module may use it, the client SDK in mesh/client included (whose only
// dependency outside the module is nats.go).
package wire
