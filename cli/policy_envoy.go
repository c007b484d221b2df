package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"

	"github.com/limitmesh/limitmesh/cli/internal/rlconfig"
	"github.com/limitmesh/limitmesh/mesh"
	"github.com/limitmesh/limitmesh/mesh/envoy"
)

// policyImportEnvoy converts envoyproxy/ratelimit configuration files (or
// directories of them) to limitmesh policies and prints them, each checked
// with the node's parser (deploy/envoy/README.md has the mapping).
func policyImportEnvoy(_ context.Context, args []string, s stdio) error {
	var (
		asJSON   bool
		calendar bool
		algo     string
		dir      string
	)
	fs := newFlags("policy import-envoy", s)
	fs.BoolVar(&asJSON, "json", false, `print one line per policy, {"name":NAME,"policy":{...}}`)
	fs.StringVar(&algo, "algorithm", rlconfig.FixedWindow, "what a rate_limit becomes: fixed_window (envoyproxy/ratelimit's own counting), sliding_window or token_bucket")
	fs.BoolVar(&calendar, "calendar-month", false, "a month unit is a UTC calendar month (a quota limit), as in an envoyproxy/ratelimit running with calendar months; default 30 days")
	fs.StringVar(&dir, "dir", "", "write each policy to DIR/NAME.json (for nats kv put) instead of printing it")
	fs.Usage = func() {
		fmt.Fprintln(s.err, "usage: limitmesh policy import-envoy [--json] [--algorithm A] [--calendar-month] [--dir DIR] FILE|DIR...")
		fs.PrintDefaults()
	}
	paths, err := parseArgs(fs, args, s)
	if err != nil {
		return err
	}
	if len(paths) == 0 {
		fs.Usage()
		return errUsage
	}
	files, err := ratelimitFiles(paths)
	if err != nil {
		return err
	}
	var cfgs []*rlconfig.Config
	for _, f := range files {
		data, err := readDoc(f, s.in)
		if err != nil {
			return err
		}
		cfg, err := rlconfig.Parse(f, data)
		if err != nil {
			return err
		}
		cfgs = append(cfgs, cfg)
	}
	res, err := rlconfig.Convert(cfgs, rlconfig.Options{
		Algorithm:       algo,
		CalendarMonth:   calendar,
		Names:           envoyDimensionNames,
		DomainDimension: envoy.DomainDimension,
		Parse:           mesh.ParsePolicy,
	})
	if err != nil {
		return err
	}
	for _, n := range res.Notes {
		fmt.Fprintln(s.err, "note:", n)
	}
	for _, p := range res.Policies {
		switch {
		case dir != "":
			var b bytes.Buffer
			_ = json.Indent(&b, p.Doc, "", "  ") // Doc is valid JSON
			b.WriteByte('\n')
			path := filepath.Join(dir, p.Name+".json")
			if err := os.WriteFile(path, b.Bytes(), 0o644); err != nil {
				return err
			}
			fmt.Fprintln(s.out, path)
		case asJSON:
			line, _ := json.Marshal(struct {
				Name   string          `json:"name"`
				Policy json.RawMessage `json:"policy"`
			}{p.Name, p.Doc})
			fmt.Fprintf(s.out, "%s\n", line)
		default:
			var b bytes.Buffer
			_ = json.Indent(&b, p.Doc, "", "  ")
			fmt.Fprintf(s.out, "# %s (%s; %s)\n%s\n\n", p.Name, p.Kind, p.Source, b.Bytes())
		}
	}
	fmt.Fprintf(s.err, "%d policies from %d files, each valid by the node's parser; put one with: nats kv put rl_policies NAME \"$(cat NAME.json)\"\n",
		len(res.Policies), len(files))
	return nil
}

// ratelimitFiles expands directories to their *.yaml and *.yml files (as
// envoyproxy/ratelimit loads a directory), in name order.
func ratelimitFiles(paths []string) ([]string, error) {
	var files []string
	for _, p := range paths {
		st, err := os.Stat(p)
		if p == "-" || (err == nil && !st.IsDir()) {
			files = append(files, p)
			continue
		}
		if err != nil {
			return nil, err
		}
		ents, err := os.ReadDir(p)
		if err != nil {
			return nil, err
		}
		var in []string
		for _, e := range ents {
			if n := e.Name(); !e.IsDir() && (strings.HasSuffix(n, ".yaml") || strings.HasSuffix(n, ".yml")) {
				in = append(in, filepath.Join(p, n))
			}
		}
		if len(in) == 0 {
			return nil, fmt.Errorf("%s: no *.yaml or *.yml file", p)
		}
		slices.Sort(in)
		files = append(files, in...)
	}
	return files, nil
}

// envoyDimensionNames returns the dimension names the Envoy bridge gives
// the entries of a descriptor with keys, in order, by asking the bridge's
// own mapping (envoy.Map) with a distinct value per entry. Where the
// bridge refuses the descriptor (more than 16 dimensions, an invalid
// domain), each key gets its name alone; the policy parser then says what
// is wrong.
func envoyDimensionNames(domain string, keys []string) []string {
	names := make([]string, len(keys))
	entries := make([]*ratelimitv3.RateLimitDescriptor_Entry, len(keys))
	for i, k := range keys {
		names[i] = envoy.DimensionName(k)
		entries[i] = &ratelimitv3.RateLimitDescriptor_Entry{Key: k, Value: "\u2063" + strconv.Itoa(i)}
	}
	m, err := envoy.Map(domain, &ratelimitv3.RateLimitDescriptor{Entries: entries}, 1)
	if err != nil {
		return names
	}
	for _, d := range m.Descriptor {
		if d.Name == envoy.DomainDimension || !strings.HasPrefix(d.Value, "\u2063") {
			continue
		}
		if i, err := strconv.Atoi(strings.TrimPrefix(d.Value, "\u2063")); err == nil && i < len(names) {
			names[i] = d.Name
		}
	}
	return names
}
