package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/policies"
	lmusage "github.com/limitmesh/limitmesh/usage"
)

func runUsage(ctx context.Context, args []string, s stdio) error {
	sub := map[string]func(context.Context, []string, stdio) error{
		"report": usageReport,
		"tail":   usageTail,
		"export": usageExport,
	}
	return subcommand(ctx, args, s, sub,
		"usage: limitmesh usage report [--policy P] [--key K] [--period 2026-12|2026-12-03] [--json]",
		"       limitmesh usage tail [--policy P] [--json] [--count N]",
		"       limitmesh usage export [--policy P] [--since 24h] [--json]",
	)
}

// usageReport prints the ledger's totals (CONTRACT.md §6).
func usageReport(ctx context.Context, args []string, s stdio) error {
	var (
		cf                  clientFlags
		policy, key, period string
		asJSON              bool
	)
	fs := newFlags("usage report", s)
	cf.register(fs)
	fs.StringVar(&policy, "policy", "", `only this policy ("_": decisions no policy matched)`)
	fs.StringVar(&key, "key", "", "only this limit key (as in the state bucket, e.g. p.acme.tenant=acme)")
	fs.StringVar(&period, "period", "", "only this UTC month (2026-12) or day (2026-12-03)")
	fs.BoolVar(&asJSON, "json", false, "one line per entry: its JSON as stored in the ledger bucket")
	fs.Usage = func() {
		fmt.Fprintln(s.err, "usage: limitmesh usage report [--policy P] [--key K] [--period 2026-12|2026-12-03] [--json]")
		fs.PrintDefaults()
	}
	if err := parseFlags(fs, args, s); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		fs.Usage()
		return errUsage
	}
	if err := checkReportFilters(policy, key, period); err != nil {
		fmt.Fprintf(s.err, "limitmesh usage report: %v\n", err)
		return errUsage
	}
	nc, js, err := cf.connectJS()
	if err != nil {
		return err
	}
	defer nc.Close()
	rctx, cancel := context.WithTimeout(ctx, max(cf.timeout, 30*time.Second))
	defer cancel()
	bucket := lmusage.LedgerBucket(cf.prefix)
	kv, err := js.KeyValue(rctx, bucket)
	if err != nil {
		if errors.Is(err, jetstream.ErrBucketNotFound) {
			return fmt.Errorf("bucket %s does not exist: start a node first (limitmesh serve)", bucket)
		}
		return fmt.Errorf("open bucket %s: %v", bucket, err)
	}
	entries, err := readTotals(rctx, js, kv, lmusage.TotalsFilter(policy, period, key))
	if err != nil {
		return err
	}
	if asJSON {
		for _, e := range entries {
			fmt.Fprintln(s.out, strings.TrimSpace(string(e.raw)))
		}
		return nil
	}
	printTotals(s.out, entries)
	return nil
}

// checkReportFilters checks report's filters: each must be a single KV
// key token sequence that cannot act as a wildcard.
func checkReportFilters(policy, key, period string) error {
	if policy != "" && policy != lmusage.UnmatchedToken {
		if err := policies.ValidateName(policy); err != nil {
			return fmt.Errorf("--policy %q: not a policy name ([a-z0-9][a-z0-9_-]{0,63}) or _", policy)
		}
	}
	if key != "" && key != lmusage.UnmatchedToken && (!lmusage.ValidKVKey(key) || len(key) > lmusage.MaxKeyLen) {
		return fmt.Errorf("--key %q: not a limit key", key)
	}
	if period != "" {
		_, errM := time.Parse("2006-01", period)
		_, errD := time.Parse("2006-01-02", period)
		if errM != nil && errD != nil {
			return fmt.Errorf("--period %q: want a UTC month (2026-12) or day (2026-12-03)", period)
		}
	}
	return nil
}

// totalsEntry is one ledger entry read for a report.
type totalsEntry struct {
	key string
	raw []byte
	t   lmusage.Totals
}

// readTotals returns the ledger's totals entries matching filter, sorted
// by policy, period (a month before its days) and limit key. It lists the
// keys with kvstate.Keys and reads each: a watcher's initial values (and
// so kv.ListKeys) can leave out entries the reconciler rewrites meanwhile.
func readTotals(ctx context.Context, js jetstream.JetStream, kv jetstream.KeyValue, filter string) ([]totalsEntry, error) {
	keys, err := kvstate.Keys(ctx, js, kv.Bucket(), filter)
	if err != nil {
		return nil, fmt.Errorf("read ledger: %v", err)
	}
	var out []totalsEntry
	for _, k := range keys {
		e, err := kv.Get(ctx, k)
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			continue // deleted
		} else if err != nil {
			return nil, fmt.Errorf("read ledger: %v", err)
		}
		t, err := lmusage.ParseTotals(e.Value())
		if err != nil {
			return nil, fmt.Errorf("ledger entry %s: %v", e.Key(), err)
		}
		out = append(out, totalsEntry{key: e.Key(), raw: e.Value(), t: t})
	}
	sort.Slice(out, func(i, j int) bool {
		a, b := &out[i].t, &out[j].t
		if a.Policy != b.Policy {
			return a.Policy < b.Policy
		}
		if a.Period != b.Period {
			return a.Period < b.Period
		}
		return a.Key < b.Key
	})
	return out, nil
}

func printTotals(w io.Writer, entries []totalsEntry) {
	if len(entries) == 0 {
		fmt.Fprintln(w, "no usage recorded (for these filters)")
		return
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "POLICY\tPERIOD\tKEY\tALLOWED\tALLOWED_UNITS\tDENIED\tDENIED_UNITS")
	for _, e := range entries {
		policy, key := e.t.Policy, e.t.Key
		if policy == "" {
			policy, key = "(none)", "-"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%d\t%s\n", policy, e.t.Period, key,
			e.t.Allowed, lmusage.FormatUnits(&e.t.AllowedUnits), e.t.Denied, lmusage.FormatUnits(&e.t.DeniedUnits))
	}
	tw.Flush()
}

// usageTail prints the usage records as the stream stores them.
func usageTail(ctx context.Context, args []string, s stdio) error {
	var (
		cf     clientFlags
		policy string
		asJSON bool
		count  int
	)
	fs := newFlags("usage tail", s)
	cf.register(fs)
	fs.StringVar(&policy, "policy", "", `only this policy's records ("_": decisions no policy matched)`)
	fs.BoolVar(&asJSON, "json", false, `one JSON object per record: {"node","policy"} and the record's fields as published`)
	fs.IntVar(&count, "count", 0, "stop after this many records (0: until interrupted)")
	fs.Usage = func() {
		fmt.Fprintln(s.err, "usage: limitmesh usage tail [--policy P] [--json] [--count N]")
		fs.PrintDefaults()
	}
	if err := parseFlags(fs, args, s); err != nil {
		return err
	}
	if fs.NArg() > 0 || count < 0 {
		fs.Usage()
		return errUsage
	}
	if err := checkReportFilters(policy, "", ""); err != nil {
		fmt.Fprintf(s.err, "limitmesh usage tail: %v\n", err)
		return errUsage
	}
	nc, js, err := cf.connectJS()
	if err != nil {
		return err
	}
	defer nc.Close()
	subject := usageSubject(cf.prefix, policy)
	octx, cancel := context.WithTimeout(ctx, cf.timeout)
	cons, err := js.OrderedConsumer(octx, lmusage.StreamName(cf.prefix), jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{subject},
		DeliverPolicy:  jetstream.DeliverNewPolicy,
	})
	cancel()
	if err != nil {
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			return fmt.Errorf("stream %s does not exist: start a node first (limitmesh serve)", lmusage.StreamName(cf.prefix))
		}
		return fmt.Errorf("tail %s: %v", lmusage.StreamName(cf.prefix), err)
	}
	msgs, err := cons.Messages()
	if err != nil {
		return fmt.Errorf("tail %s: %v", lmusage.StreamName(cf.prefix), err)
	}
	defer msgs.Stop()
	go func() {
		<-ctx.Done()
		msgs.Stop()
	}()
	printed := 0
	var line []byte
	for {
		m, err := msgs.Next()
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, jetstream.ErrMsgIteratorClosed) {
				return nil
			}
			return fmt.Errorf("tail: %v", err)
		}
		b, err := lmusage.DecodeBatch(m.Data())
		if err != nil {
			fmt.Fprintf(s.err, "invalid message on %s: %v\n", m.Subject(), err)
			continue
		}
		for i := range b.Records {
			if asJSON {
				line = appendTailJSON(line[:0], &b, i)
			} else {
				line = appendTailLine(line[:0], &b, i)
			}
			line = append(line, '\n')
			if _, err := s.out.Write(line); err != nil {
				return err
			}
			printed++
			if count > 0 && printed >= count {
				return nil
			}
		}
	}
}

// appendTailJSON writes record i of b as a JSON object: "node" and
// "policy" of its batch, then the record's own fields as published.
func appendTailJSON(dst []byte, b *lmusage.Batch, i int) []byte {
	node, _ := json.Marshal(b.Node)
	policy, _ := json.Marshal(b.Policy)
	dst = append(dst, `{"node":`...)
	dst = append(dst, node...)
	dst = append(dst, `,"policy":`...)
	dst = append(dst, policy...)
	dst = append(dst, ',')
	rec := lmusage.AppendRecord(nil, &b.Records[i])
	return append(dst, rec[1:]...)
}

// appendTailLine writes record i of b readably, for example
//
//	2026-12-03T10:00:00.123456Z n1 acme-search allowed 2.5 p.acme-search.tenant=acme tenant=acme id=n1.b.7 request_id=r1
//
// with reservation=<id> last for a reservation's end (CONTRACT.md §10)
// (descriptor values, request ids and reservations are quoted when they
// hold spaces, commas, quotes or '=').
func appendTailLine(dst []byte, b *lmusage.Batch, i int) []byte {
	r := &b.Records[i]
	dst = time.UnixMicro(r.TimeUs).UTC().AppendFormat(dst, "2006-01-02T15:04:05.000000Z")
	dst = append(dst, ' ')
	dst = append(dst, b.Node...)
	dst = append(dst, ' ')
	if b.Policy == "" {
		dst = append(dst, "(none)"...)
	} else {
		dst = append(dst, b.Policy...)
	}
	if r.Allowed {
		dst = append(dst, " allowed "...)
	} else {
		dst = append(dst, " denied "...)
	}
	dst = append(dst, lmusage.FormatMicro(r.Cost)...)
	dst = append(dst, ' ')
	if r.Key == "" {
		dst = append(dst, '-')
	} else {
		dst = append(dst, r.Key...)
	}
	dst = append(dst, ' ')
	for k, d := range r.Descriptor {
		if k > 0 {
			dst = append(dst, ',')
		}
		dst = append(dst, d.Name...)
		dst = append(dst, '=')
		dst = appendMaybeQuoted(dst, d.Value)
	}
	dst = append(dst, " id="...)
	dst = appendMaybeQuoted(dst, r.ID)
	if r.RequestID != "" {
		dst = append(dst, " request_id="...)
		dst = appendMaybeQuoted(dst, r.RequestID)
	}
	if r.Reservation != "" {
		dst = append(dst, " reservation="...)
		dst = appendMaybeQuoted(dst, r.Reservation)
	}
	return dst
}

func appendMaybeQuoted(dst []byte, s string) []byte {
	if strings.ContainsAny(s, " ,\"=\\") || strings.IndexFunc(s, func(r rune) bool { return !strconv.IsPrint(r) }) >= 0 {
		return strconv.AppendQuote(dst, s)
	}
	return append(dst, s...)
}

// usageSubject is the usage stream's subject of policy (the flag's value:
// "" every policy, "_" decisions no policy matched).
func usageSubject(prefix, policy string) string {
	switch policy {
	case "":
		return lmusage.Subjects(prefix)
	case lmusage.UnmatchedToken:
		return lmusage.Subject(prefix, "")
	}
	return lmusage.Subject(prefix, policy)
}
