// Package shadow evaluates candidate policies off the decision path
// (CONTRACT.md §7). A candidate is a policy with "shadow": true: live
// decisions ignore it, and this package replays the usage stream through
// it to say what it would have denied, had it been live.
//
// The pure core is [Replay]: it takes usage records in stream order and
// decides each one against every candidate whose match covers the
// record's descriptor, with limiter state of its own per (candidate, limit
// key) from kvstate.DecideAll at the record's time. It counts, per
// candidate revision, what [Summary] holds. Nothing in it reads a clock or
// does I/O, so a backtest over a stored history and the live evaluation
// over the same records count exactly the same.
//
// Around it: [Evaluator] (one active across the nodes, elected with
// internal/elector) consumes the usage stream with the durable consumer
// usage.ShadowConsumer, learns the candidates from the policy bucket,
// spreads them over a few workers (each a Replay holding some of them),
// writes the summaries to the KV bucket <prefix>_shadow at least once a
// second and checkpoints its state with the stream sequence it covers (in
// the object store <prefix>_shadow_state), so that a failover neither
// loses nor double counts a record; [Backtest]
// replays what the stream still holds through one policy document; and
// [NewDashboard] serves the HTML dashboard and its server-sent events.
//
// Memory is bounded per candidate: at most MaxKeys limit keys hold state
// (default [DefaultMaxKeys]); beyond that, keys at rest are dropped, and
// records of new keys are decided against one shared overflow state and
// counted (Summary.Overflow).
//
// This package never imports mesh; it imports usage, policies and kvstate.
package shadow
