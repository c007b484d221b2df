package clitext

import (
	"net/url"
	"strings"
)

// RedactURL returns u, one URL or a comma-separated list of them (as
// nats.Connect takes), with the user information of each (a user and
// password, or a token) replaced by "***", so that it can be printed:
// scheme, host, port and path stay as they are, byte for byte.
//
// A URL's user information is what precedes the last '@' of its
// authority, which starts after the scheme's "://" (at the start when
// there is no scheme, which nats.Connect allows) and ends at the first '/', '?' or
// '#'. A URL that net/url cannot parse (a password holding an unescaped
// '/' or '#', say) is hidden up to its last '@' wherever it is, since
// where its authority ends cannot be told.
func RedactURL(u string) string {
	if !strings.Contains(u, "@") {
		return u
	}
	parts := strings.Split(u, ",")
	for i, p := range parts {
		parts[i] = redactOne(p)
	}
	return strings.Join(parts, ",")
}

// redactOne is [RedactURL] for one URL.
func redactOne(u string) string {
	start, full := 0, strings.TrimSpace(u)
	if i := strings.Index(u, "://"); i >= 0 && !strings.ContainsAny(u[:i], "/?#@") {
		start = i + len("://")
	} else {
		full = "nats://" + full
	}
	rest := u[start:]
	at := -1
	if _, err := url.Parse(full); err != nil {
		at = strings.LastIndexByte(rest, '@')
	} else {
		end := strings.IndexAny(rest, "/?#")
		if end < 0 {
			end = len(rest)
		}
		at = strings.LastIndexByte(rest[:end], '@')
	}
	if at < 0 {
		return u
	}
	return u[:start] + "***" + rest[at:]
}
