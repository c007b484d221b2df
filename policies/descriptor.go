package policies

import (
	"strconv"
	"unicode"
	"unicode/utf8"
)

// Descriptor limits (CONTRACT.md §2).
const (
	MaxDims          = 16  // most entries in a descriptor (and in a policy's match or key)
	MaxDimNameLen    = 32  // most bytes in a dimension name
	MaxDimValueLen   = 128 // most bytes in a dimension value
	AnyValue         = "*" // the match value meaning "present with any value"
	maxDescriptionLn = 1024
)

// Dim is one dimension of a descriptor or one entry of a policy's match:
// a name such as "tenant" and its value such as "acme".
type Dim struct{ Name, Value string }

// A Descriptor is a request's dimensions, sorted by name, with unique names
// matching [a-z][a-z0-9_]{0,31} and values of 1..128 bytes of printable
// UTF-8 (see [NewDescriptor]). Build one with NewDescriptor; the other
// functions of this package assume a Descriptor is valid.
type Descriptor []Dim

// NewDescriptor validates dims and sorts them by name in place (the result
// shares dims' backing array, so a valid descriptor costs no allocation).
// The rules: 1..16 entries, names [a-z][a-z0-9_]{0,31} and unique, values
// 1..128 bytes of valid UTF-8 with no control characters (Unicode category
// Cc: C0, DEL and C1; spaces and other printable characters are allowed).
// Errors are [*Error] naming the dimension, such as
// `descriptor.tenant: value has a control character`, and match
// [ErrInvalid].
func NewDescriptor(dims []Dim) (Descriptor, error) {
	if len(dims) == 0 {
		return nil, invalid("descriptor", "has no dimensions (needs 1..16)")
	}
	if len(dims) > MaxDims {
		return nil, invalid("descriptor", "has "+strconv.Itoa(len(dims))+" dimensions (at most 16)")
	}
	for i := range dims {
		if !validDimName(dims[i].Name) {
			return nil, invalid("descriptor", "dimension name "+strconv.Quote(dims[i].Name)+" is not [a-z][a-z0-9_]{0,31}")
		}
		if reason := valueProblem(dims[i].Value); reason != "" {
			return nil, invalid("descriptor."+dims[i].Name, reason)
		}
	}
	// Insertion sort: at most 16 entries, allocation-free, stable.
	for i := 1; i < len(dims); i++ {
		for j := i; j > 0 && dims[j].Name < dims[j-1].Name; j-- {
			dims[j], dims[j-1] = dims[j-1], dims[j]
		}
	}
	for i := 1; i < len(dims); i++ {
		if dims[i].Name == dims[i-1].Name {
			return nil, invalid("descriptor."+dims[i].Name, "duplicate dimension")
		}
	}
	return Descriptor(dims), nil
}

// Get returns the value of the dimension name and whether d has it.
func (d Descriptor) Get(name string) (string, bool) {
	for i := range d {
		if d[i].Name == name {
			return d[i].Value, true
		}
	}
	return "", false
}

// validDimName reports whether s matches [a-z][a-z0-9_]{0,31}.
func validDimName(s string) bool {
	if len(s) == 0 || len(s) > MaxDimNameLen || s[0] < 'a' || s[0] > 'z' {
		return false
	}
	for i := 1; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_') {
			return false
		}
	}
	return true
}

// valueProblem returns why s is not a valid dimension value, or "".
func valueProblem(s string) string {
	if len(s) == 0 {
		return "value is empty"
	}
	if len(s) > MaxDimValueLen {
		return "value is " + strconv.Itoa(len(s)) + " bytes (at most 128)"
	}
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c < 0x20 || c == 0x7f {
				return "value has a control character"
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			return "value is not valid UTF-8"
		}
		if unicode.IsControl(r) {
			return "value has a control character"
		}
		i += size
	}
	return ""
}
