package auth

import (
	"fmt"
	"strings"

	"github.com/limitmesh/limitmesh/internal/wire"
)

// RequestInfoHeader is the header in which the NATS server states who sent
// a request that crossed a service import: the JSON of server.ClientInfo,
// whose field "acc" is the calling account (its public key in operator
// mode). The server replaces any value the sender set. Inside one account
// no import is crossed and the header is whatever the sender wrote.
const RequestInfoHeader = "Nats-Request-Info"

// maxInfoDepth bounds the nesting of a Nats-Request-Info value, the object
// itself included (the server's has depth 2: the object and its arrays).
const maxInfoDepth = 16

// RequestInfoAccount returns the "acc" field of a Nats-Request-Info value:
// a substring of info, so it allocates nothing. info must be one JSON
// object, valid throughout, with exactly one field named "acc" (in any
// letter case, as encoding/json matches names), whose value is a string of
// 1..128 printable ASCII characters without escapes; object keys must not
// hold escapes. Anything else is an error wrapping [ErrBadRequestInfo].
// Whatever it accepts, encoding/json decodes to the same account.
func RequestInfoAccount(info string) (string, error) {
	s := wire.Scanner{Text: info}
	if !s.Consume('{') {
		return "", infoError(&s, "not a JSON object")
	}
	var acc string
	found := false
	for first := true; ; first = false {
		more, err := s.More('}', first)
		if err != nil {
			return "", infoError(&s, "missing ',' or '}'")
		}
		if !more {
			break
		}
		key, flags, err := s.String()
		if err != nil || flags&wire.Escaped != 0 {
			return "", infoError(&s, "bad object key")
		}
		if s.Expect(':') != nil {
			return "", infoError(&s, "missing ':'")
		}
		if len(key) == 3 && strings.EqualFold(key, "acc") {
			if found {
				return "", infoError(&s, `"acc" given twice`)
			}
			found = true
			v, ok := s.PlainString()
			if !ok || len(v) < 1 || len(v) > 128 {
				return "", infoError(&s, `"acc" is not a plain string`)
			}
			acc = v
		} else if _, err := s.Skip(maxInfoDepth - 1); err != nil {
			// Invalid UTF-8 in another field is taken, as encoding/json
			// takes it.
			return "", infoError(&s, "bad value")
		}
	}
	if s.End() != nil {
		return "", infoError(&s, "data after the object")
	}
	if !found {
		return "", fmt.Errorf(`%w: no "acc" field`, ErrBadRequestInfo)
	}
	return acc, nil
}

func infoError(s *wire.Scanner, what string) error {
	return fmt.Errorf("%w: %s at byte %d", ErrBadRequestInfo, what, s.Pos)
}
