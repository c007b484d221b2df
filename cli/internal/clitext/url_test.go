package clitext

import (
	"strings"
	"testing"
)

func TestRedactURL(t *testing.T) {
	cases := []struct{ in, want string }{
		{"", ""},
		{"nats://127.0.0.1:4222", "nats://127.0.0.1:4222"},
		{"nats://alice:s3cret@nats.example:4222", "nats://***@nats.example:4222"},
		{"nats://s3cret@nats.example:4222", "nats://***@nats.example:4222"},
		{"tls://alice:s3cret@[::1]:4443/x", "tls://***@[::1]:4443/x"},
		{"nats://alice:s3cret%40x@host", "nats://***@host"},
		// nats.Connect takes a list and URLs without a scheme.
		{"nats://alice:s3cret@h1:4222,nats://bob:s3cret@h2:4222,nats://h3:4222",
			"nats://***@h1:4222,nats://***@h2:4222,nats://h3:4222"},
		{"alice:s3cret@host:4222", "***@host:4222"},
		{"alice:s3cret@host:4222/x?r=nats://y", "***@host:4222/x?r=nats://y"},
		// An '@' after the authority is not user information.
		{"http://host:9090/metrics?to=ops@example.com", "http://host:9090/metrics?to=ops@example.com"},
		{"http://alice:s3cret@host:9090/metrics#a@b", "http://***@host:9090/metrics#a@b"},
		// Text net/url cannot parse is hidden up to its last '@'.
		{"nats://alice:s3/cret@host:4222", "nats://***@host:4222"},
		{"nats://alice:s3cret@x@host:4222", "nats://***@host:4222"},
	}
	for _, c := range cases {
		got := RedactURL(c.in)
		if got != c.want {
			t.Errorf("RedactURL(%q) = %q, want %q", c.in, got, c.want)
		}
		if strings.Contains(got, "s3") {
			t.Errorf("RedactURL(%q) = %q shows the password", c.in, got)
		}
	}
}
