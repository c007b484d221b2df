// Package bench is the load harness of `limitmesh bench`: it drives a
// node (or a cluster) with decide requests, reservations or leased grants
// and measures it against raw NATS request-reply in the same run. A run is
// a [Config] (the load, the policy, the [Mode]), made by [Run] (over NATS)
// or [RunRLS] (over Envoy's rate limit API), which return the figures as a
// [Report] or an [RLSReport]: the --json line of the command, whose flags,
// human-readable output and verdict (exit code) are package cli's. The
// parts of cli a run needs (an embedded supercluster, the Envoy bridge)
// come in through the Config; nothing but cli imports this package.
//
// The run. bench installs a policy of its own, bench-<mode>-<run>, matching
// only the dimension bench_run=<run> (a random id), keyed by
// [bench_run, key], with one token_bucket limit (--rate, --burst) in --mode,
// and waits until a node decides with it. Then two phases run over the same
// load connections, with the same concurrency and the same key sequence:
// the echo phase against a trivial responder bench starts on a connection
// of its own (queue group, reply of the size of a real decision reply, the
// request body of a real decision), and the decide phase against
// <prefix>.v1.decide. The echo phase is the baseline: what the same client
// gets from NATS alone; ratio = decisions/s / echo/s. At the end the policy
// is deleted. --mode reserve and --mode concurrency run the same way with
// reservations (a reserve and its settle, an acquire and its release) in
// place of decisions, and check for leaks at the end (reserve.go).
//
// Rounds. The phases do not run one after the other but in --rounds
// alternating slices, echo first: echo, decide, echo, decide, ..., each
// phase's --echo-duration or --duration split into --rounds equal parts.
// On a shared VM the machine's speed drifts over seconds (the echo
// baseline alone varied by ±20% between runs), and two phases that sample
// the same stretch of time in alternation see the same drift, so their
// ratio is steadier than that of two phases measured back to back. A phase
// keeps its workers across its slices (their connections' reply slots, key
// pickers, histograms and counters), so its key sequence continues where
// the previous slice left it and its figures are those of one phase with
// the gaps cut out: a slice ends as a phase did (stop, then wait for the
// requests in flight), and a phase's time is the sum of its slices'.
// --rounds 1 is the two phases back to back.
//
// Load. --concurrency requests are in flight at any time, spread over
// --conns connections: each of --concurrency workers sends one request and
// waits for its reply before the next. A worker's replies come to a reply
// subject of its own under one wildcard inbox subscription per connection,
// so a request costs one publish and one delivery, with no per-request
// map entry, channel or timer. On the 2-core development machine, echo at
// 64 in flight over 4 in-process connections ran at 167k/s this way against
// 120k/s with nc.Request and 107k/s with nc.RequestWithContext from the same
// 64 goroutines (the same run order, a quiet moment; the decide phase, bound
// by the node, did not change measurably).
//
// Latency is measured from just before the publish to the delivery of the
// reply, per successful request (errors are counted, not timed), into a
// log-linear histogram with under 1% relative error; percentiles are the
// upper edge of the bucket holding the rank.
//
// Overshoot. For every key bench adds up the cost admitted and notes the
// send time of the first admitted request and the receive time of the last
// one, both as time since one base instant taken before the first slice
// on the wall clock (nodes decide on theirs; a monotonic span differs from
// a wall-clock one while the wall clock is slewed), so a key's span is
// right when it crosses slices. The node decides each of them at an
// instant of its own clock between that send and that receive, so on a
// clock that runs at the bench's rate (the same machine; across machines,
// up to the clocks' rate
// difference) the node's interval [t1, t2] lies inside the bench's, and the
// contract admitted(t1, t2) <= burst + rate*(t2-t1) (CONTRACT.md §3; the
// key is fresh, so it starts full; echo requests never reach the node)
// implies admitted <= burst + rate*span with the bench's span. The echo
// slices inside a span are idle time for the key, in which its bucket
// refills; the contract counts them like any other time, so they belong
// in the span. The check is therefore sound (a correct node never shows
// overshoot) but lenient by rate times the first request's and the last
// reply's latency. overshoot = sum over keys of max(0, admitted -
// (burst + rate*span)), in units, computed exactly in micro-units (the
// allowance rounded up by less than one micro-unit); no other slack.
package bench
