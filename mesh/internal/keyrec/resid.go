package keyrec

import (
	"strconv"
	"strings"
)

// Reservation ids (CONTRACT §10: opaque, at most 128 bytes). An id names
// its key, so any node can route a settle, release or renew to the key's
// owner, and carries the reservation's sequence and nonce:
//
//	r<seq>.<nonce: 12 lowercase hex digits>.<limit key>
//
// The nonce (48 random bits, kept in the record) makes ids that cannot be
// guessed from a key and a clock: an id is the capability to settle.

// MaxReservationID is the longest reservation id.
const MaxReservationID = 128

// NonceBits is how many bits of a reservation's nonce its id carries.
const NonceBits = 48

// MaxReservedKey is the longest limit key a reservation id can name:
// reservations of longer keys are refused.
const MaxReservedKey = MaxReservationID - len("r18446744073709551615.") - 12 - 1

// ReservationID returns the id of reservation seq (with nonce) of key.
func ReservationID(key string, seq, nonce uint64) string {
	b := make([]byte, 0, 36+len(key))
	b = append(b, 'r')
	b = strconv.AppendUint(b, seq, 10)
	b = append(b, '.')
	const hex = "0123456789abcdef"
	for i := NonceBits - 4; i >= 0; i -= 4 {
		b = append(b, hex[(nonce>>i)&0xf])
	}
	b = append(b, '.')
	b = append(b, key...)
	return string(b)
}

// ParseReservationID splits an id made by ReservationID; false when id is
// not one (then it names no reservation: not found).
func ParseReservationID(id string) (key string, seq, nonce uint64, ok bool) {
	if len(id) > MaxReservationID || !strings.HasPrefix(id, "r") {
		return "", 0, 0, false
	}
	rest := id[1:]
	i := strings.IndexByte(rest, '.')
	if i <= 0 || i > 20 || (i > 1 && rest[0] == '0') {
		return "", 0, 0, false
	}
	seq, err := strconv.ParseUint(rest[:i], 10, 64)
	if err != nil || seq == 0 {
		return "", 0, 0, false
	}
	rest = rest[i+1:]
	if len(rest) < 14 || rest[12] != '.' {
		return "", 0, 0, false
	}
	for j := 0; j < 12; j++ {
		c := rest[j]
		var v uint64
		switch {
		case c >= '0' && c <= '9':
			v = uint64(c - '0')
		case c >= 'a' && c <= 'f':
			v = uint64(c-'a') + 10
		default:
			return "", 0, 0, false
		}
		nonce = nonce<<4 | v
	}
	key = rest[13:]
	if !strings.HasPrefix(key, "p.") || len(key) < 3 {
		return "", 0, 0, false
	}
	for j := 0; j < len(key); j++ {
		c := key[j]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '/' || c == '_' || c == '=' || c == '.') {
			return "", 0, 0, false
		}
	}
	return key, seq, nonce, true
}

// PolicyOfKey returns the policy name a limit key belongs to
// ("p.<policy>" or "p.<policy>.…").
func PolicyOfKey(key string) string {
	rest, ok := strings.CutPrefix(key, "p.")
	if !ok {
		return ""
	}
	if i := strings.IndexByte(rest, '.'); i >= 0 {
		return rest[:i]
	}
	return rest
}
