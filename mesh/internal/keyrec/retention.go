package keyrec

import (
	"math"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
)

// Retention is how long the state bucket and the state journal keep what
// a key record needs (CONTRACT §3, "State retention"; docs/protocol.md): a
// record is kept at least Floor after it is written (the state TTL) and
// at least until it comes to rest (Record.RestAt) plus RetentionMargin, so
// no state is dropped while it can still change a decision, and the state
// TTL only bounds how long a state already at rest is kept. Each write
// carries its own time to live (JetStream's per-message TTL), computed at
// the write by its writer's clock.
//
// The zero Retention is off: TTL and TTLAt return 0 (no per-message TTL;
// the stream's own limits apply).
type Retention struct {
	// Floor is the least time a record is kept after its write (the
	// state TTL, at least a second); 0: retention is off.
	Floor time.Duration
	// Horizon is the age limit of the streams written to (0: none): a
	// message that must be kept longer is written with kvstate.NoExpiry,
	// since the age limit would remove it before its own TTL.
	Horizon time.Duration
}

// RetentionMargin is added to the time a record takes to come to rest: it
// covers clocks of nodes and servers that differ by up to this much (a
// TTL runs on the server's clock, RestAt is the writer's) and the time
// from a write's computation to its storing.
const RetentionMargin = 2 * time.Second

// Forever is the keep-until instant of a record that must never expire
// (one that never comes to rest within the int64 range).
const Forever = math.MaxInt64

// On reports whether r sets per-message TTLs.
func (r Retention) On() bool { return r.Floor > 0 }

// KeepUntil returns the instant (Unix ns) until which a record written at
// now that comes to rest at restAt (Record.RestAt; 0: unknown) must be
// kept: now + Floor, or restAt + RetentionMargin when that is later, or
// Forever. A record of unknown rest (format 1 or 2, written before rest
// times were) is kept Floor, as it was then. It saturates rather than
// overflows.
func (r Retention) KeepUntil(restAt, now int64) int64 {
	until := satAdd(now, int64(r.Floor))
	if restAt == 0 || restAt <= now {
		return until
	}
	if restAt == math.MaxInt64 {
		return Forever
	}
	return max(until, satAdd(restAt, int64(RetentionMargin)))
}

// TTLAt returns the time to live, written at now, of a message that must
// be kept until until (Unix ns; KeepUntil): at least Floor, and
// kvstate.NoExpiry when until is Forever or further than Horizon (or than
// kvstate.MaxTTL) from now. It returns 0 when r is off.
func (r Retention) TTLAt(until, now int64) time.Duration {
	if !r.On() {
		return 0
	}
	if until == Forever {
		return kvstate.NoExpiry
	}
	d := r.Floor
	if until > now {
		d = max(d, time.Duration(until-now))
	}
	if (r.Horizon > 0 && d > r.Horizon) || d > kvstate.MaxTTL {
		return kvstate.NoExpiry
	}
	return d
}

// TTL returns the time to live of a record written at now that comes to
// rest at restAt: TTLAt(KeepUntil(restAt, now), now).
func (r Retention) TTL(restAt, now int64) time.Duration {
	return r.TTLAt(r.KeepUntil(restAt, now), now)
}

// TTLOf returns the time to live of the encoded record b written at now
// (TTL of its RestAt; of an unknown rest when b is not a record).
func (r Retention) TTLOf(b []byte, now int64) time.Duration {
	at, _ := PeekRestAt(b)
	return r.TTL(at, now)
}

// satAdd returns a+b for b >= 0, saturated at math.MaxInt64.
func satAdd(a, b int64) int64 {
	if a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
}
