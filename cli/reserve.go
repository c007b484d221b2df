package cli

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"strings"

	"github.com/nats-io/nats.go"

	"github.com/limitmesh/limitmesh/cli/internal/clitext"
)

// The reservation commands (CONTRACT.md §10): reserve, settle, release and
// renew. Like decide, they send the request as JSON and print the node's
// reply as it came; values (costs, ttls) go to the node as given, so that
// its validation explains what is wrong with them.

func runReserve(ctx context.Context, args []string, s stdio) error {
	var (
		cf        clientFlags
		dims      multiFlag
		cost      string
		requestID string
		dryRun    bool
		ttl       string
		raw       string
	)
	fs := newFlags("reserve", s)
	cf.register(fs)
	fs.Var(&dims, "d", "a descriptor entry name=value (repeatable)")
	fs.StringVar(&cost, "cost", "", "units to hold (decimal; default 1)")
	fs.StringVar(&requestID, "request-id", "", "request id: a retry with the same id gets the same reservation")
	fs.BoolVar(&dryRun, "dry-run", false, "the reply a real reserve would get, holding nothing")
	fs.StringVar(&ttl, "ttl", "", "how long the reservation holds unless settled, released or renewed (Go duration, at most 1h; default 30s)")
	fs.StringVar(&raw, "json", "", "the whole request body as JSON (instead of -d/--cost/--ttl)")
	fs.Usage = func() {
		fmt.Fprintln(s.err, "usage: limitmesh reserve -d tenant=acme -d operation=export [--cost 100] [--ttl 1m] [--request-id ID] [--dry-run]")
		fmt.Fprintln(s.err, "       limitmesh reserve --json '{\"descriptor\":{\"tenant\":\"acme\"},\"cost\":100,\"ttl\":\"1m\"}'")
		fmt.Fprintln(s.err, "Prints the node's reply; when allowed it names the reservation to settle, release or renew.")
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
	if raw != "" && ttl != "" {
		return errors.New("--json cannot be combined with --ttl (put \"ttl\" in the JSON)")
	}
	body, err := buildDecideBody(raw, dims, cost, requestID, dryRun)
	if err != nil {
		return err
	}
	if ttl != "" {
		q, _ := json.Marshal(ttl)
		body = append(append(append(body[:len(body)-1], `,"ttl":`...), q...), '}')
	}
	return reservationRequest(ctx, &cf, "reserve", "", body, s)
}

func runSettle(ctx context.Context, args []string, s stdio) error {
	var cf clientFlags
	var cost string
	fs := newFlags("settle", s)
	cf.register(fs)
	fs.StringVar(&cost, "cost", "", "units that stay spent (decimal, 0 up to the reserved cost; default: all of them); the rest is given back")
	fs.Usage = func() {
		fmt.Fprintln(s.err, "usage: limitmesh settle ID [--cost C]")
		fs.PrintDefaults()
	}
	id, err := reservationArgs(fs, args, s)
	if err != nil {
		return err
	}
	req := struct {
		Reservation string          `json:"reservation"`
		Cost        json.RawMessage `json:"cost,omitempty"`
	}{Reservation: id}
	if cost != "" {
		req.Cost = clitext.NumberJSON(cost)
	}
	body, _ := json.Marshal(req)
	return reservationRequest(ctx, &cf, "settle", id, body, s)
}

func runRelease(ctx context.Context, args []string, s stdio) error {
	var cf clientFlags
	fs := newFlags("release", s)
	cf.register(fs)
	fs.Usage = func() {
		fmt.Fprintln(s.err, "usage: limitmesh release ID")
		fmt.Fprintln(s.err, "Ends the reservation giving all its units back (a settle of 0).")
		fs.PrintDefaults()
	}
	id, err := reservationArgs(fs, args, s)
	if err != nil {
		return err
	}
	body, _ := json.Marshal(struct {
		Reservation string `json:"reservation"`
	}{id})
	return reservationRequest(ctx, &cf, "release", id, body, s)
}

func runRenew(ctx context.Context, args []string, s stdio) error {
	var cf clientFlags
	var ttl string
	fs := newFlags("renew", s)
	cf.register(fs)
	fs.StringVar(&ttl, "ttl", "", "the reservation expires this long from now (Go duration, at most 1h; default 30s)")
	fs.Usage = func() {
		fmt.Fprintln(s.err, "usage: limitmesh renew ID [--ttl D]")
		fs.PrintDefaults()
	}
	id, err := reservationArgs(fs, args, s)
	if err != nil {
		return err
	}
	body, _ := json.Marshal(struct {
		Reservation string `json:"reservation"`
		TTL         string `json:"ttl,omitempty"`
	}{id, ttl})
	return reservationRequest(ctx, &cf, "renew", id, body, s)
}

// reservationArgs parses the flags of settle, release or renew (before or
// after the id) and returns the one argument, the reservation id.
func reservationArgs(fs *flag.FlagSet, args []string, s stdio) (string, error) {
	if err := parseFlags(fs, interspersed(args), s); err != nil {
		return "", err
	}
	if fs.NArg() != 1 || fs.Arg(0) == "" {
		fs.Usage()
		return "", errUsage
	}
	return fs.Arg(0), nil
}

// reservationRequest sends body to the endpoint's subject and prints the
// reply. A 404 (the reservation id is unknown or expired) is one line on
// stderr and nothing on stdout; other error answers print the error body,
// as decide does. Both are exit code 1.
func reservationRequest(ctx context.Context, cf *clientFlags, endpoint, id string, body []byte, s stdio) error {
	nc, err := cf.connect()
	if err != nil {
		return err
	}
	defer nc.Close()
	rctx, cancel := context.WithTimeout(ctx, cf.timeout)
	defer cancel()
	subject := cf.prefix + ".v1." + endpoint
	msg, err := nc.RequestWithContext(rctx, subject, body)
	switch {
	case errors.Is(err, nats.ErrNoResponders):
		return fmt.Errorf("no limitmesh node answers on %s (is `limitmesh serve` running, at version 1.2 or later?)", subject)
	case err != nil:
		return fmt.Errorf("request: %v", err)
	}
	code := msg.Header.Get("Nats-Service-Error-Code")
	if code == "404" {
		return fmt.Errorf("reservation %q not found: it is unknown or expired", id)
	}
	fmt.Fprintln(s.out, strings.TrimSpace(string(msg.Data)))
	if code != "" {
		return fmt.Errorf("the node answered %s: %s", code, msg.Header.Get("Nats-Service-Error"))
	}
	return nil
}
