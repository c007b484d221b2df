package keyrec

import (
	"math"
	"testing"
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
)

func TestRetentionTTL(t *testing.T) {
	const (
		s   = int64(time.Second)
		now = 1_000_000 * s
		day = 86400 * s
	)
	floor := 3 * time.Second
	on := Retention{Floor: floor, Horizon: 366 * 24 * time.Hour}
	margin := RetentionMargin
	cases := []struct {
		name   string
		r      Retention
		restAt int64
		want   time.Duration
	}{
		{"off", Retention{}, now + day, 0},
		{"off, unknown rest", Retention{}, 0, 0},
		{"unknown rest: the floor", on, 0, floor},
		{"always at rest", on, math.MinInt64, floor},
		{"at rest before the write", on, now - s, floor},
		{"at rest at the write", on, now, floor},
		{"rests within the floor less the margin", on, now + s/2, floor},
		{"rests just past the floor", on, now + 2*s, 2*time.Second + margin},
		{"a day's refill", on, now + day, 24*time.Hour + margin},
		{"a month's quota", on, now + 31*day, 31*24*time.Hour + margin},
		{"at the horizon", on, now + 366*day - int64(margin), 366 * 24 * time.Hour},
		{"beyond the horizon", on, now + 366*day, kvstate.NoExpiry},
		{"never at rest", on, math.MaxInt64, kvstate.NoExpiry},
		{"no horizon, far", Retention{Floor: floor}, now + 400*day, 400*24*time.Hour + margin},
		{"no horizon, beyond MaxTTL", Retention{Floor: floor}, now + int64(kvstate.MaxTTL) + day, kvstate.NoExpiry},
		{"floor above the rest", Retention{Floor: 48 * time.Hour}, now + day, 48 * time.Hour},
		{"near the end of time", on, math.MaxInt64 - 1, kvstate.NoExpiry},
	}
	for _, c := range cases {
		if got := c.r.TTL(c.restAt, now); got != c.want {
			t.Errorf("%s: TTL(%d, now) = %v, want %v", c.name, c.restAt-now, got, c.want)
		}
	}
}

// TestRetentionKeepUntil: KeepUntil is never before the floor after the
// write nor before the rest plus the margin, and TTLAt of it never comes
// out shorter than what is left of it.
func TestRetentionKeepUntil(t *testing.T) {
	const now = int64(5e18)
	r := Retention{Floor: time.Hour, Horizon: 366 * 24 * time.Hour}
	for _, rest := range []int64{0, 1, now - 1, now, now + 1, now + int64(time.Hour), now + int64(40*24*time.Hour), math.MaxInt64} {
		until := r.KeepUntil(rest, now)
		if until < now+int64(time.Hour) {
			t.Errorf("rest %d: kept until %d, before the floor", rest, until)
		}
		if rest > now && until < rest {
			t.Errorf("rest %d: kept until %d, before the rest", rest, until)
		}
		// Later: what is left of until, as a TTL written then.
		for _, later := range []int64{now, now + int64(time.Minute), now + int64(2*time.Hour)} {
			ttl := r.TTLAt(until, later)
			if ttl != kvstate.NoExpiry && (ttl < time.Hour || (until > later && later+int64(ttl) < until)) {
				t.Errorf("rest %d: TTLAt(%d, +%d) = %v", rest, until, later-now, ttl)
			}
		}
	}
	if got := r.KeepUntil(math.MaxInt64, now); got != Forever {
		t.Fatalf("never at rest: kept until %d, want Forever", got)
	}
}

func TestRetentionTTLOf(t *testing.T) {
	r := sampleRecord()
	r.RestAt = 100 * int64(time.Second)
	ret := Retention{Floor: time.Second}
	if got := ret.TTLOf(Append(nil, &r), 10*int64(time.Second)); got != 90*time.Second+RetentionMargin {
		t.Fatalf("TTLOf a format 3 record: %v", got)
	}
	if got := ret.TTLOf(legacy(&r, recordFormat2), 10*int64(time.Second)); got != time.Second {
		t.Fatalf("TTLOf a format 2 record: %v, want the floor", got)
	}
	if got := ret.TTLOf([]byte("junk"), 0); got != time.Second {
		t.Fatalf("TTLOf junk: %v, want the floor", got)
	}
}
