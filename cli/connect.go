package cli

import (
	"fmt"
	"os"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/limitmesh/limitmesh/cli/internal/clitext"
)

// credsUsage is the help of the --creds flag every command that connects to
// NATS takes.
const credsUsage = "NATS user credentials (a .creds file) of a secured deployment, e.g. DIR/admin.creds or DIR/tenants/<tenant>.creds of `limitmesh auth init`"

// connectNATS connects to the NATS deployment at url as a client named
// name, with the user credentials in the creds file creds ("": none) and
// any further options. It is the one place commands dial NATS, so every
// command takes --creds the same way.
func connectNATS(url, name, creds string, timeout time.Duration, opts ...nats.Option) (*nats.Conn, error) {
	all := []nats.Option{nats.Name(name), nats.Timeout(timeout)}
	if creds != "" {
		// nats.go reads the file at each (re)connect; say now if it cannot.
		if _, err := os.Stat(creds); err != nil {
			return nil, fmt.Errorf("--creds: %v", err)
		}
		all = append(all, nats.UserCredentials(creds))
	}
	nc, err := nats.Connect(url, append(all, opts...)...)
	if err != nil {
		return nil, fmt.Errorf("cannot connect to NATS at %s: %v", clitext.RedactURL(url), err)
	}
	return nc, nil
}

// dial connects with c's URL, credentials and timeout as a client named
// name.
func (c *clientFlags) dial(name string, opts ...nats.Option) (*nats.Conn, error) {
	return connectNATS(c.natsURL, name, c.creds, c.timeout, opts...)
}
