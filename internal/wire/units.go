package wire

import "strconv"

// unit is one unit in micro-units (kvstate.Unit).
const unit = 1_000_000

// AppendUnits appends v micro-units (1e-6 of a unit) as a decimal number of
// units and returns the extended slice: the integer part, then '.' and the
// fraction without trailing zeros when there is one ("2.5", "3",
// "0.000001", "-1.5"). The result is exact for every int64, and a JSON
// number.
func AppendUnits(b []byte, v int64) []byte {
	u := uint64(v)
	if v < 0 {
		b = append(b, '-')
		u = uint64(-(v + 1)) + 1 // no overflow at MinInt64
	}
	b = strconv.AppendUint(b, u/unit, 10)
	f := u % unit
	if f == 0 {
		return b
	}
	var digits [6]byte
	for i := 5; i >= 0; i-- {
		digits[i] = byte('0' + f%10)
		f /= 10
	}
	n := 6
	for digits[n-1] == '0' {
		n--
	}
	b = append(b, '.')
	return append(b, digits[:n]...)
}

// FormatUnits returns v micro-units as [AppendUnits] writes them.
func FormatUnits(v int64) string { return string(AppendUnits(nil, v)) }
