package bench

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
)

// keyDist is the distribution bench draws limit keys from: n keys numbered
// 0..n-1, key k drawn with probability proportional to 1/(k+1)^s (Zipf with
// exponent s; key 0 is the hottest). s = 0 is uniform. It is immutable and
// shared by every worker; each worker draws through its own [keyPicker].
type keyDist struct {
	n int
	s float64
	// cdf is the cumulative distribution for 0 < s <= 1, which
	// math/rand/v2's Zipf does not support; nil otherwise.
	cdf []float64
}

// maxTableKeys bounds the table a keyDist with 0 < s <= 1 builds
// (8 bytes per key).
const maxTableKeys = 1 << 24

// errKeyDist reports keys or an exponent bench cannot draw from.
var errKeyDist = errors.New("invalid key distribution")

// newKeyDist returns the distribution over n keys with exponent s: n >= 1,
// s >= 0 (0 uniform; s > 1 draws without a table; 0 < s <= 1 needs a table,
// so n is then at most 16,777,216).
func newKeyDist(n int, s float64) (*keyDist, error) {
	switch {
	case n < 1:
		return nil, fmt.Errorf("%w: %d keys: want at least 1", errKeyDist, n)
	case s < 0 || math.IsNaN(s) || math.IsInf(s, 0):
		return nil, fmt.Errorf("%w: exponent %v: want 0 (uniform) or more", errKeyDist, s)
	}
	d := &keyDist{n: n, s: s}
	if s > 0 && s <= 1 && n > 1 {
		if n > maxTableKeys {
			return nil, fmt.Errorf("%w: an exponent in (0, 1] supports at most %d keys", errKeyDist, maxTableKeys)
		}
		d.cdf = make([]float64, n)
		var sum float64
		for k := range n {
			sum += math.Pow(float64(k+1), -s)
			d.cdf[k] = sum
		}
		for k := range d.cdf {
			d.cdf[k] /= sum
		}
	}
	return d, nil
}

// keyPicker draws keys from a keyDist with its own seeded generator. It is
// not safe for concurrent use: give each worker its own.
type keyPicker struct {
	d    *keyDist
	r    *rand.Rand
	zipf *rand.Zipf
}

// picker returns a deterministic picker: the same seed and stream give the
// same sequence of keys. Workers of one run share the seed and use their
// index as the stream.
func (d *keyDist) picker(seed, stream uint64) *keyPicker {
	p := &keyPicker{d: d, r: rand.New(rand.NewPCG(seed, stream))}
	if d.s > 1 && d.n > 1 {
		// P(k) proportional to (1+k)^-s for k in 0..n-1.
		p.zipf = rand.NewZipf(p.r, d.s, 1, uint64(d.n-1))
	}
	return p
}

// next returns a key in 0..n-1.
func (p *keyPicker) next() int {
	switch {
	case p.d.n == 1:
		return 0
	case p.zipf != nil:
		return int(p.zipf.Uint64())
	case p.d.cdf != nil:
		u := p.r.Float64()
		k := sort.SearchFloat64s(p.d.cdf, u)
		// SearchFloat64s gives the first k with cdf[k] >= u; u < 1 and
		// cdf[n-1] == 1 up to rounding, so clamp.
		return min(k, p.d.n-1)
	default:
		return p.r.IntN(p.d.n)
	}
}
