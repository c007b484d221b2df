package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/limitmesh/limitmesh/kvstate"
	"github.com/limitmesh/limitmesh/mesh"
	"github.com/limitmesh/limitmesh/policies"
	"github.com/limitmesh/limitmesh/shadow"
)

// runShadow is `limitmesh shadow report|promote|backtest` (CONTRACT.md §7).
func runShadow(ctx context.Context, args []string, s stdio) error {
	sub := map[string]func(context.Context, []string, stdio) error{
		"report":   shadowReport,
		"promote":  shadowPromote,
		"backtest": shadowBacktest,
	}
	return subcommand(ctx, args, s, sub,
		"usage: limitmesh shadow report [NAME] [--json]",
		"       limitmesh shadow promote NAME [--revision N]",
		"       limitmesh shadow backtest FILE [--name NAME] [--since 24h] [--json]",
	)
}

// shadowArgs moves flags after positional arguments to the front, like
// interspersed, knowing the shadow subcommands' boolean flags.
func shadowArgs(args []string) []string {
	var flags, pos []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		switch {
		case a == "--":
			pos = append(pos, args[i+1:]...)
			i = len(args)
		case strings.HasPrefix(a, "-") && a != "-":
			flags = append(flags, a)
			switch strings.TrimLeft(a, "-") {
			case "json", "h", "help":
				continue
			}
			if !strings.Contains(a, "=") && i+1 < len(args) {
				flags = append(flags, args[i+1])
				i++
			}
		default:
			pos = append(pos, a)
		}
	}
	return append(flags, pos...)
}

// shadowBucket opens the summary bucket of a running installation.
func shadowBucket(ctx context.Context, js jetstream.JetStream, prefix string) (jetstream.KeyValue, error) {
	name := shadow.Bucket(prefix)
	kv, err := js.KeyValue(ctx, name)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		return nil, fmt.Errorf("bucket %s does not exist: no shadow evaluator has run yet (start a node: limitmesh serve)", name)
	} else if err != nil {
		return nil, fmt.Errorf("open bucket %s: %v", name, err)
	}
	return kv, nil
}

// storedSummary is one entry of the summary bucket.
type storedSummary struct {
	raw []byte
	s   shadow.Summary
}

// readSummaries returns the stored summaries by name (only name's when it
// is not "").
func readSummaries(ctx context.Context, js jetstream.JetStream, kv jetstream.KeyValue, name string) ([]storedSummary, error) {
	var names []string
	if name != "" {
		names = []string{name}
	} else {
		keys, err := kvstate.Keys(ctx, js, kv.Bucket(), "")
		if err != nil {
			return nil, err
		}
		for _, k := range keys {
			if policies.ValidateName(k) == nil {
				names = append(names, k)
			}
		}
	}
	var out []storedSummary
	for _, n := range names {
		e, err := kv.Get(ctx, n)
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			continue
		} else if err != nil {
			return nil, err
		}
		var s shadow.Summary
		if err := json.Unmarshal(e.Value(), &s); err != nil {
			return nil, fmt.Errorf("summary %s: %v", n, err)
		}
		out = append(out, storedSummary{raw: e.Value(), s: s})
	}
	for i := 1; i < len(out); i++ { // by name
		for j := i; j > 0 && out[j].s.Policy < out[j-1].s.Policy; j-- {
			out[j], out[j-1] = out[j-1], out[j]
		}
	}
	return out, nil
}

func shadowReport(ctx context.Context, args []string, s stdio) error {
	var (
		cf     clientFlags
		asJSON bool
	)
	fs := newFlags("shadow report", s)
	cf.register(fs)
	fs.BoolVar(&asJSON, "json", false, "one line per candidate: the summary's JSON as stored")
	if err := parseFlags(fs, shadowArgs(args), s); err != nil {
		return err
	}
	if fs.NArg() > 1 {
		fmt.Fprintln(s.err, "usage: limitmesh shadow report [NAME] [--json]")
		return errUsage
	}
	name := fs.Arg(0)
	nc, err := cf.connect()
	if err != nil {
		return err
	}
	defer nc.Close()
	ctx, cancel := context.WithTimeout(ctx, cf.timeout)
	defer cancel()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	kv, err := shadowBucket(ctx, js, cf.prefix)
	if err != nil {
		return err
	}
	sums, err := readSummaries(ctx, js, kv, name)
	if err != nil {
		return err
	}
	if name != "" && len(sums) == 0 {
		return fmt.Errorf("no summary for %q: is it a candidate (\"shadow\": true in %s_policies)?", name, cf.prefix)
	}
	if asJSON {
		for _, x := range sums {
			fmt.Fprintln(s.out, strings.TrimSpace(string(x.raw)))
		}
		return nil
	}
	if len(sums) == 0 {
		fmt.Fprintln(s.out, "no candidates (a policy with \"shadow\": true is evaluated from the usage stream)")
		return nil
	}
	list := make([]shadow.Summary, len(sums))
	for i, x := range sums {
		list[i] = x.s
	}
	writeSummaries(s.out, list, name != "")
	return nil
}

// writeSummaries prints summaries as a table, and every top denied key
// when detail is set (else the first).
func writeSummaries(w io.Writer, sums []shadow.Summary, detail bool) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "CANDIDATE\tREVISION\tSINCE\tEVALUATED\tWOULD DENY\tUNITS\tLIVE DENIED\tBOTH\tONLY CANDIDATE\tONLY LIVE\tTOP DENIED KEY")
	for _, x := range sums {
		top := "-"
		if len(x.TopDenied) > 0 {
			top = fmt.Sprintf("%s (%d)", x.TopDenied[0].Key, x.TopDenied[0].WouldDeny)
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\t%d\t%d (%s)\t%s\t%d (%s)\t%d\t%d\t%d\t%s\n", x.Policy, x.Revision, sinceText(x.SinceUs),
			x.Evaluated, x.WouldDeny, percent(x.WouldDeny, x.Evaluated), x.WouldDenyUnits, x.LiveDenied,
			percent(x.LiveDenied, x.Evaluated), x.BothDenied, x.OnlyCandidateDenied, x.OnlyLiveDenied, top)
	}
	tw.Flush()
	if !detail {
		return
	}
	for _, x := range sums {
		if x.Skipped > 0 || x.Overflow > 0 {
			fmt.Fprintf(w, "\n%s: %d records skipped (descriptor lacks a key dimension), %d decided against the overflow state (key cap)\n",
				x.Policy, x.Skipped, x.Overflow)
		}
		if len(x.TopDenied) == 0 {
			continue
		}
		fmt.Fprintf(w, "\ntop denied keys of %s:\n", x.Policy)
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "  KEY\tWOULD DENY")
		for _, k := range x.TopDenied {
			fmt.Fprintf(tw, "  %s\t%d\n", k.Key, k.WouldDeny)
		}
		tw.Flush()
	}
}

func sinceText(us int64) string {
	if us == 0 {
		return "-"
	}
	return time.UnixMicro(us).UTC().Format(time.RFC3339)
}

func percent(a, b uint64) string {
	if b == 0 {
		return "-"
	}
	return strconv.FormatFloat(100*float64(a)/float64(b), 'f', 1, 64) + "%"
}

func shadowPromote(ctx context.Context, args []string, s stdio) error {
	var (
		cf       clientFlags
		revision uint64
	)
	fs := newFlags("shadow promote", s)
	cf.register(fs)
	fs.Uint64Var(&revision, "revision", 0, "the candidate revision you reviewed (default: the revision of its summary); promote refuses any other")
	if err := parseFlags(fs, shadowArgs(args), s); err != nil {
		return err
	}
	if fs.NArg() != 1 {
		fmt.Fprintln(s.err, "usage: limitmesh shadow promote NAME [--revision N]")
		return errUsage
	}
	name := fs.Arg(0)
	ctx, cancel := context.WithTimeout(ctx, cf.timeout)
	defer cancel()
	nc, js, err := cf.connectJS()
	if err != nil {
		return err
	}
	defer nc.Close()
	bucket := cf.prefix + "_policies"
	kv, err := js.KeyValue(ctx, bucket)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		return fmt.Errorf("bucket %s does not exist: start a node first (limitmesh serve)", bucket)
	} else if err != nil {
		return fmt.Errorf("open bucket %s: %v", bucket, err)
	}
	e, err := kv.Get(ctx, name)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return fmt.Errorf("no policy %q", name)
	} else if err != nil {
		return err
	}
	doc, err := shadow.WithoutShadow(name, e.Value())
	if errors.Is(err, shadow.ErrNotCandidate) {
		return fmt.Errorf("%s (revision %d) is not a candidate: it has no \"shadow\": true", name, e.Revision())
	} else if err != nil {
		return err
	}
	reviewed, from := revision, "--revision"
	if reviewed == 0 {
		reviewed, from = summaryRevision(ctx, js, cf.prefix, name), "its summary in "+shadow.Bucket(cf.prefix)
	}
	if reviewed != 0 && reviewed != e.Revision() {
		return fmt.Errorf("%s changed since the report: the policy is at revision %d, %s is of revision %d; nothing written "+
			"(review it with `limitmesh shadow report %s`, then promote with --revision %d)", name, e.Revision(), from, reviewed, name, e.Revision())
	}
	if _, err := mesh.ParsePolicy(name, doc); err != nil {
		return fmt.Errorf("not promoted: the live policy would be invalid: %v", err)
	}
	rev, err := kv.Update(ctx, name, doc, e.Revision())
	if errors.Is(err, jetstream.ErrKeyExists) || errors.Is(err, jetstream.ErrKeyRevisionMismatch) {
		return fmt.Errorf("%s changed while promoting (it was at revision %d); nothing written", name, e.Revision())
	} else if err != nil {
		return err
	}
	fmt.Fprintf(s.out, "promoted %s: candidate revision %d is live as revision %d\n", name, e.Revision(), rev)
	return nil
}

// summaryRevision returns the candidate revision of name's summary, or 0
// when there is none (no summary yet, or no summary bucket).
func summaryRevision(ctx context.Context, js jetstream.JetStream, prefix, name string) uint64 {
	kv, err := js.KeyValue(ctx, shadow.Bucket(prefix))
	if err != nil {
		return 0
	}
	e, err := kv.Get(ctx, name)
	if err != nil {
		return 0
	}
	var x shadow.Summary
	if json.Unmarshal(e.Value(), &x) != nil {
		return 0
	}
	return x.Revision
}

func shadowBacktest(ctx context.Context, args []string, s stdio) error {
	var (
		cf     clientFlags
		name   string
		since  time.Duration
		asJSON bool
	)
	fs := newFlags("shadow backtest", s)
	cf.register(fs)
	fs.StringVar(&name, "name", "", "policy name (default: the file name without its extension)")
	fs.DurationVar(&since, "since", 24*time.Hour, "replay the usage stored in this last period (0: all the stream holds)")
	fs.BoolVar(&asJSON, "json", false, "print one line: the summary's JSON with the replay's figures")
	if err := parseFlags(fs, shadowArgs(args), s); err != nil {
		return err
	}
	if fs.NArg() != 1 {
		fmt.Fprintln(s.err, "usage: limitmesh shadow backtest FILE [--name NAME] [--since 24h] [--json]")
		return errUsage
	}
	if since < 0 {
		fmt.Fprintf(s.err, "limitmesh shadow backtest: --since %v: must not be negative\n", since)
		return errUsage
	}
	path := fs.Arg(0)
	if name == "" {
		name = strings.TrimSuffix(filepath.Base(path), filepath.Ext(path))
		if path == "-" {
			name = "stdin"
		}
	}
	doc, err := readDoc(path, s.in)
	if err != nil {
		return err
	}
	p, err := policies.Parse(name, doc)
	if err != nil {
		return fmt.Errorf("invalid policy: %v", err)
	}
	nc, js, err := cf.connectJS()
	if err != nil {
		return err
	}
	defer nc.Close()
	res, err := shadow.Backtest(ctx, js, p, shadow.BacktestConfig{Prefix: cf.prefix, Since: since})
	if err != nil {
		return err
	}
	if asJSON {
		b, _ := json.Marshal(res.Summary)
		extra, _ := json.Marshal(struct {
			Records       uint64  `json:"records"`
			Messages      uint64  `json:"messages"`
			Invalid       uint64  `json:"invalid_messages"`
			Seconds       float64 `json:"seconds"`
			RecordsPerSec float64 `json:"records_per_sec"`
		}{res.Records, res.Messages, res.Invalid, res.Elapsed.Seconds(), res.RecordsPerSec()})
		fmt.Fprintf(s.out, "%s,%s\n", b[:len(b)-1], extra[1:])
		return nil
	}
	window := "everything " + usageStream(cf.prefix) + " holds"
	if since > 0 {
		window = "the last " + since.String() + " of " + usageStream(cf.prefix)
	}
	fmt.Fprintf(s.out, "backtest of %s over %s: %d records in %d messages", name, window, res.Records, res.Messages)
	if res.Invalid > 0 {
		fmt.Fprintf(s.out, " (%d invalid messages skipped)", res.Invalid)
	}
	fmt.Fprintf(s.out, ", replayed in %.2fs: %.0f records/s\n\n", res.Elapsed.Seconds(), res.RecordsPerSec())
	writeSummaries(s.out, []shadow.Summary{res.Summary}, true)
	return nil
}

func usageStream(prefix string) string { return strings.ToUpper(prefix) + "_USAGE" }
