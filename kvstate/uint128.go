package kvstate

import (
	"math"
	"math/bits"
)

// u128 is an unsigned 128-bit integer, the intermediate type of the exact
// credit arithmetic: products of two int64 magnitudes (rate x elapsed ns,
// burst x 1e9) fit without overflow, and every operation below saturates
// instead of wrapping, so no input can make the arithmetic wrap around.
type u128 struct{ hi, lo uint64 }

// u128max is the largest u128, the saturation value.
var u128max = u128{math.MaxUint64, math.MaxUint64}

// mul64 returns a*b exactly.
func mul64(a, b uint64) u128 {
	hi, lo := bits.Mul64(a, b)
	return u128{hi, lo}
}

// from64 returns v as a u128.
func from64(v uint64) u128 { return u128{0, v} }

// add returns x+y, saturated at u128max.
func (x u128) add(y u128) u128 {
	lo, c := bits.Add64(x.lo, y.lo, 0)
	hi, c := bits.Add64(x.hi, y.hi, c)
	if c != 0 {
		return u128max
	}
	return u128{hi, lo}
}

// sub returns x-y, or 0 when y > x.
func (x u128) sub(y u128) u128 {
	lo, b := bits.Sub64(x.lo, y.lo, 0)
	hi, b := bits.Sub64(x.hi, y.hi, b)
	if b != 0 {
		return u128{}
	}
	return u128{hi, lo}
}

// less reports whether x < y.
func (x u128) less(y u128) bool { return x.hi < y.hi || (x.hi == y.hi && x.lo < y.lo) }

// min returns the smaller of x and y.
func (x u128) min(y u128) u128 {
	if y.less(x) {
		return y
	}
	return x
}

// divmod returns x/d and x%d. d must not be 0.
func (x u128) divmod(d uint64) (q u128, r uint64) {
	if x.hi == 0 {
		return u128{0, x.lo / d}, x.lo % d
	}
	q.hi, r = x.hi/d, x.hi%d
	q.lo, r = bits.Div64(r, x.lo, d)
	return q, r
}

// divmodNano returns x/1e9 and x%1e9. It is divmod with a constant divisor,
// which the compiler turns into a multiplication in the common case where x
// fits in 64 bits.
func (x u128) divmodNano() (q u128, r uint64) {
	if x.hi == 0 {
		return u128{0, x.lo / nano}, x.lo % nano
	}
	return x.divmod(nano)
}

// divCeil returns ceil(x/d). d must not be 0.
func (x u128) divCeil(d uint64) u128 {
	q, r := x.divmod(d)
	if r != 0 {
		q = q.add(from64(1))
	}
	return q
}

// int64 returns x as an int64, saturated at math.MaxInt64.
func (x u128) int64() int64 {
	if x.hi != 0 || x.lo > math.MaxInt64 {
		return math.MaxInt64
	}
	return int64(x.lo)
}

// nano is the number of nano-micro-units in one micro-unit: credit is kept
// in units of 1e-9 micro-unit so that rate (micro-units/s) x elapsed (ns)
// is an exact integer.
const nano = 1_000_000_000

// span returns b-a as an unsigned magnitude when b > a, and 0 otherwise. It
// never overflows, whatever the int64 values.
func span(a, b int64) uint64 {
	if b <= a {
		return 0
	}
	return uint64(b) - uint64(a)
}

const (
	maxInt64 = math.MaxInt64
	minInt64 = math.MinInt64
)

// sat returns v as an int64, saturated at math.MaxInt64.
func sat(v uint64) int64 {
	if v > maxInt64 {
		return maxInt64
	}
	return int64(v)
}
