package cli

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"time"
)

// ServeSettings are what a deployment's manifests must agree with: the
// addresses and timings `limitmesh serve` takes from its flags.
type ServeSettings struct {
	HTTP         string        // --http: /metrics, /healthz, /readyz
	EnvoyListen  string        // --envoy-listen: Envoy's rate limit service ("": off)
	NATSURL      string        // --nats-url ("": an embedded server)
	Creds        string        // --creds
	Replicas     int           // --replicas of the buckets and streams a node creates
	DrainTimeout time.Duration // --drain-timeout: the longest a graceful stop waits
}

// ParseServe parses a `limitmesh serve` command line (args after "serve")
// and environment (LIMITMESH_* variables, as a container's env sets them)
// with serve's own flag set and validation, starting nothing. A flag that
// serve does not know, a bad value or a variable LIMITMESH_X that names no
// flag of serve is an error. Variables are checked as the flags they stand
// for, on the command line before args (a flag given on the command line
// wins, as it does for serve).
func ParseServe(args, environ []string) (ServeSettings, error) {
	var fromEnv []string
	for _, kv := range environ {
		k, v, _ := strings.Cut(kv, "=")
		if name, ok := strings.CutPrefix(k, "LIMITMESH_"); ok {
			fromEnv = append(fromEnv, "--"+strings.ReplaceAll(strings.ToLower(name), "_", "-")+"="+v)
		}
	}
	var errs bytes.Buffer
	c, parse := serveFlags(stdio{err: &errs, env: env{}})
	all := append(fromEnv, args...)
	if err := parse(all); err != nil {
		if errors.Is(err, errUsage) {
			return ServeSettings{}, fmt.Errorf("limitmesh serve %s: %s", strings.Join(all, " "), strings.TrimSpace(firstLine(errs.String())))
		}
		return ServeSettings{}, fmt.Errorf("limitmesh serve %s: %w", strings.Join(all, " "), err)
	}
	st := ServeSettings{
		HTTP:         c.httpAddr,
		EnvoyListen:  c.envoyListen,
		NATSURL:      c.natsURL,
		Creds:        c.creds,
		Replicas:     c.replicas,
		DrainTimeout: c.drainTimeout,
	}
	return st, nil
}

func firstLine(s string) string {
	l, _, _ := strings.Cut(s, "\n")
	return l
}
