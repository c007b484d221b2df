package clitext

import (
	"encoding/json"
	"regexp"
)

// plainNumber is a JSON number without an exponent.
var plainNumber = regexp.MustCompile(`^-?(0|[1-9][0-9]*)(\.[0-9]+)?$`)

// NumberJSON returns s, a number as a user wrote it in a flag, as a JSON
// value: a JSON number when s is one without an exponent, else a JSON
// string, so that the node's validation (not the command's) explains what
// is wrong with it. The result is always valid JSON.
func NumberJSON(s string) json.RawMessage {
	if plainNumber.MatchString(s) {
		return json.RawMessage(s)
	}
	b, _ := json.Marshal(s)
	return b
}
