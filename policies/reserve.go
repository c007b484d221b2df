package policies

import (
	"time"

	"github.com/limitmesh/limitmesh/kvstate"
)

// Reservations (CONTRACT §10): a request reserves units for a ttl, then
// settles, releases or renews them.
const (
	// DefaultReservationTTL is a reservation's ttl when the request names
	// none.
	DefaultReservationTTL = 30 * time.Second
	// MaxReservationTTL is the longest ttl a reserve or renew may ask for,
	// and the window of a concurrency limit that names none.
	MaxReservationTTL = time.Hour
)

// ReservedOnly reports whether p has a concurrency limit: its units come
// back only by settle, release or expiry, so it is reserved, never
// decided (a plain decide would hold a slot nobody can give back).
func (p *Policy) ReservedOnly() bool {
	for _, l := range p.Limits {
		if l.Algorithm == kvstate.Concurrency {
			return true
		}
	}
	return false
}

// ReservationTTL returns the ttl a reservation of p asking for ttl gets:
// ttl capped by the window of each of p's concurrency limits (the longest
// their holds may last).
func (p *Policy) ReservationTTL(ttl time.Duration) time.Duration {
	for _, l := range p.Limits {
		if l.Algorithm == kvstate.Concurrency && time.Duration(l.Window) < ttl {
			ttl = time.Duration(l.Window)
		}
	}
	return ttl
}
