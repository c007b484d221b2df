package cli

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	lmusage "github.com/limitmesh/limitmesh/usage"
)

const exportUsage = "usage: limitmesh usage export [--policy P] [--since 24h] [--json]"

// usageExport prints every decision the usage stream still holds, oldest
// first, one line per decision (CONTRACT.md §6a): the form of usage tail,
// or with --json the v1.1 record object with the batch's "node" and
// "policy". Grouped and v1.1 messages print alike. It reads what the
// stream holds when it starts and stops there.
func usageExport(ctx context.Context, args []string, s stdio) error {
	var (
		cf     clientFlags
		policy string
		since  time.Duration
		asJSON bool
	)
	fs := newFlags("usage export", s)
	cf.register(fs)
	fs.StringVar(&policy, "policy", "", `only this policy's decisions ("_": decisions no policy matched)`)
	fs.DurationVar(&since, "since", 0, "only messages stored in this last span, e.g. 24h (0: everything the stream holds)")
	fs.BoolVar(&asJSON, "json", false, `one JSON object per decision: the v1.1 record with "node" and "policy"`)
	fs.Usage = func() {
		fmt.Fprintln(s.err, exportUsage)
		fs.PrintDefaults()
	}
	if err := parseFlags(fs, args, s); err != nil {
		return err
	}
	if fs.NArg() > 0 || since < 0 {
		fs.Usage()
		return errUsage
	}
	if err := checkReportFilters(policy, "", ""); err != nil {
		fmt.Fprintf(s.err, "limitmesh usage export: %v\n", err)
		return errUsage
	}
	nc, js, err := cf.connectJS()
	if err != nil {
		return err
	}
	defer nc.Close()
	stream := lmusage.StreamName(cf.prefix)
	subject := usageSubject(cf.prefix, policy)
	cfg := jetstream.OrderedConsumerConfig{FilterSubjects: []string{subject}, DeliverPolicy: jetstream.DeliverAllPolicy}
	if since > 0 {
		start := time.Now().Add(-since)
		cfg.DeliverPolicy, cfg.OptStartTime = jetstream.DeliverByStartTimePolicy, &start
	}
	octx, cancel := context.WithTimeout(ctx, max(cf.timeout, 10*time.Second))
	// The stream's last message now: the export stops there.
	var last, pending uint64
	st, err := js.Stream(octx, stream)
	if err == nil {
		var info *jetstream.StreamInfo
		if info, err = st.Info(octx); err == nil {
			last = info.State.LastSeq
		}
	}
	var cons jetstream.Consumer
	if err == nil {
		cons, err = js.OrderedConsumer(octx, stream, cfg)
	}
	if err == nil {
		var info *jetstream.ConsumerInfo
		if info, err = cons.Info(octx); err == nil {
			pending = info.NumPending
		}
	}
	cancel()
	if err != nil {
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			return fmt.Errorf("stream %s does not exist: start a node first (limitmesh serve)", stream)
		}
		return fmt.Errorf("export %s: %v", stream, err)
	}
	if pending == 0 {
		return nil
	}
	msgs, err := cons.Messages()
	if err != nil {
		return fmt.Errorf("export %s: %v", stream, err)
	}
	defer msgs.Stop()
	go func() {
		<-ctx.Done()
		msgs.Stop()
	}()
	var line []byte
	for {
		m, err := msgs.Next()
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return fmt.Errorf("export: %v", err)
		}
		meta, err := m.Metadata()
		if err != nil {
			return fmt.Errorf("export: %v", err)
		}
		b, err := lmusage.DecodeBatch(m.Data())
		if err != nil {
			fmt.Fprintf(s.err, "invalid message %d on %s skipped: %v\n", meta.Sequence.Stream, m.Subject(), err)
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
		}
		if meta.NumPending == 0 || meta.Sequence.Stream >= last {
			return nil
		}
	}
}
