package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/limitmesh/limitmesh/cli/internal/clitext"
)

// clientFlags are the flags every command that talks to a running node takes.
type clientFlags struct {
	natsURL string
	creds   string
	prefix  string
	timeout time.Duration
}

func (c *clientFlags) register(fs interface {
	StringVar(*string, string, string, string)
	DurationVar(*time.Duration, string, time.Duration, string)
}) {
	fs.StringVar(&c.natsURL, "nats-url", nats.DefaultURL, "NATS URL of the limitmesh deployment")
	fs.StringVar(&c.creds, "creds", "", credsUsage)
	fs.StringVar(&c.prefix, "prefix", "rl", "subject prefix of the limitmesh installation")
	fs.DurationVar(&c.timeout, "timeout", 2*time.Second, "how long to wait for NATS")
}

func (c *clientFlags) connect() (*nats.Conn, error) {
	if !prefixRE.MatchString(c.prefix) {
		return nil, fmt.Errorf("--prefix %q: must match %s", c.prefix, prefixRE)
	}
	return c.dial("limitmesh-cli")
}

// connectJS connects and returns the connection (the caller closes it)
// with its JetStream context.
func (c *clientFlags) connectJS() (*nats.Conn, jetstream.JetStream, error) {
	nc, err := c.connect()
	if err != nil {
		return nil, nil, err
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, nil, err
	}
	return nc, js, nil
}

// decideRequest is the wire request of CONTRACT.md §2.
type decideRequest struct {
	Descriptor map[string]string `json:"descriptor"`
	Cost       json.RawMessage   `json:"cost,omitempty"`
	RequestID  string            `json:"request_id,omitempty"`
	DryRun     bool              `json:"dry_run,omitempty"`
}

func runDecide(ctx context.Context, args []string, s stdio) error {
	var (
		cf        clientFlags
		dims      multiFlag
		cost      string
		requestID string
		dryRun    bool
		raw       string
	)
	fs := newFlags("decide", s)
	cf.register(fs)
	fs.Var(&dims, "d", "a descriptor entry name=value (repeatable)")
	fs.StringVar(&cost, "cost", "", "cost of the request (decimal; default 1)")
	fs.StringVar(&requestID, "request-id", "", "request id: a retry with the same id spends once")
	fs.BoolVar(&dryRun, "dry-run", false, "the reply a real request would get, spending nothing")
	fs.StringVar(&raw, "json", "", "the whole request body as JSON (instead of -d/--cost)")
	fs.Usage = func() {
		fmt.Fprintln(s.err, "usage: limitmesh decide -d tenant=acme -d operation=search [--cost 3] [--dry-run]")
		fmt.Fprintln(s.err, "       limitmesh decide --json '{\"descriptor\":{\"tenant\":\"acme\"},\"cost\":3}'")
		fs.PrintDefaults()
	}
	if err := parseFlags(fs, args, s); err != nil {
		return err
	}
	if fs.NArg() == 1 && raw == "" && len(dims) == 0 {
		raw = fs.Arg(0)
	} else if fs.NArg() > 0 {
		fs.Usage()
		return errUsage
	}

	body, err := buildDecideBody(raw, dims, cost, requestID, dryRun)
	if err != nil {
		return err
	}
	nc, err := cf.connect()
	if err != nil {
		return err
	}
	defer nc.Close()
	rctx, cancel := context.WithTimeout(ctx, cf.timeout)
	defer cancel()
	msg, err := nc.RequestWithContext(rctx, cf.prefix+".v1.decide", body)
	switch {
	case errors.Is(err, nats.ErrNoResponders):
		return fmt.Errorf("no limitmesh node answers on %s.v1.decide (is `limitmesh serve` running?)", cf.prefix)
	case err != nil:
		return fmt.Errorf("request: %v", err)
	}
	fmt.Fprintln(s.out, strings.TrimSpace(string(msg.Data)))
	if code := msg.Header.Get("Nats-Service-Error-Code"); code != "" {
		return fmt.Errorf("the node answered %s: %s", code, msg.Header.Get("Nats-Service-Error"))
	}
	return nil
}

// buildDecideBody returns the request body: raw as given (checked to be
// JSON), or one built from descriptor entries and a cost.
func buildDecideBody(raw string, dims []string, cost, requestID string, dryRun bool) ([]byte, error) {
	if raw != "" {
		if len(dims) > 0 || cost != "" {
			return nil, errors.New("--json cannot be combined with -d or --cost")
		}
		if !json.Valid([]byte(raw)) {
			return nil, errors.New("--json: not valid JSON")
		}
		return []byte(raw), nil
	}
	if len(dims) == 0 {
		return nil, errors.New("give the descriptor with -d name=value (or the whole body with --json)")
	}
	req := decideRequest{Descriptor: map[string]string{}, RequestID: requestID, DryRun: dryRun}
	for _, d := range dims {
		name, value, ok := strings.Cut(d, "=")
		if !ok || name == "" {
			return nil, fmt.Errorf("-d %q: want name=value", d)
		}
		req.Descriptor[name] = value
	}
	if cost != "" {
		req.Cost = clitext.NumberJSON(cost)
	}
	return json.Marshal(req)
}
