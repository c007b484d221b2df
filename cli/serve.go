package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"math"
	"net"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/limitmesh/limitmesh/auth"
	"github.com/limitmesh/limitmesh/mesh"
)

// serveConfig is everything `limitmesh serve` takes from flags.
type serveConfig struct {
	natsURL         string
	creds           string
	authDir         string
	prefixSet       bool
	natsListen      string
	dataDir         string
	httpAddr        string
	prefix          string
	decisionTimeout time.Duration
	replicas        int
	stateTTL        time.Duration
	logLevel        string
	clusterListen   string
	clusterName     string
	serverName      string
	routes          listFlag
	drainTimeout    time.Duration
	partitions      int
	lease           time.Duration
	nodeID          string
	checkpoint      time.Duration
	journal         bool
	asyncInterval   time.Duration
	region          string
	gatewayListen   string
	gateways        listFlag
	usage           bool
	usageInterval   time.Duration
	usageRetention  time.Duration
	usageMaxBytes   byteSize
	roles           string
	envoyListen     string

	// Set by parsing: whether --region was given (flag or environment),
	// the --gateways entries by region name, whether --roles was given
	// and the roles it names.
	regionSet   bool
	gatewayURLs map[string][]string
	rolesSet    bool
	roleSet     mesh.Roles
}

var (
	prefixRE = regexp.MustCompile(`^[a-z][a-z0-9_-]{0,31}$`)
	nodeIDRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)
)

func serveFlags(s stdio) (*serveConfig, func([]string) error) {
	c := &serveConfig{}
	fs := newFlags("serve", s)
	fs.StringVar(&c.natsURL, "nats-url", "", "join an existing NATS deployment at this URL instead of starting an embedded server")
	fs.StringVar(&c.authDir, "auth", "", "secured deployment directory of `limitmesh auth init`: the embedded server runs in operator mode with its accounts, and the node connects with DIR/node.creds")
	fs.StringVar(&c.creds, "creds", "", "NATS user credentials of the node's connection (default with --auth: DIR/node.creds)")
	fs.StringVar(&c.natsListen, "nats-listen", "127.0.0.1:4222", "client address of the embedded NATS server")
	fs.StringVar(&c.dataDir, "data", "./limitmesh-data", "storage directory of the embedded NATS server (JetStream)")
	fs.StringVar(&c.httpAddr, "http", "127.0.0.1:9090", "address of /metrics, /healthz and /readyz")
	fs.StringVar(&c.prefix, "prefix", "rl", "subject prefix; buckets are <prefix>_policies and <prefix>_state")
	fs.DurationVar(&c.decisionTimeout, "decision-timeout", 500*time.Millisecond, "longest a decision may take before the node answers 503")
	fs.IntVar(&c.replicas, "replicas", 1, "replicas of the buckets this node creates")
	fs.DurationVar(&c.stateTTL, "state-ttl", time.Hour, "how long limiter state is kept after its last write once it is at rest (buckets full, windows and periods over); state that can still change a decision is kept until it is at rest")
	fs.StringVar(&c.logLevel, "log-level", "info", "debug, info, warn or error")
	fs.StringVar(&c.clusterListen, "cluster-listen", "", "host:port for routes to other NATS servers (makes the embedded server a cluster member)")
	fs.StringVar(&c.clusterName, "cluster-name", "", "NATS cluster name (default: the --region when given, else "+mesh.DefaultClusterName+")")
	fs.StringVar(&c.serverName, "server-name", "", "NATS server name (default: derived from the host and client port)")
	fs.Var(&c.routes, "routes", "comma-separated routes to other cluster members, e.g. nats://127.0.0.1:6223")
	fs.DurationVar(&c.drainTimeout, "drain-timeout", 10*time.Second, "longest a shutdown waits for in-flight decisions")
	fs.IntVar(&c.partitions, "partitions", mesh.DefaultPartitions, "partitions of the key space (every node of a mesh must use the same count)")
	fs.DurationVar(&c.lease, "lease", mesh.DefaultLeaseTime, "partition lease: a node that stops renewing loses its partitions after this long")
	fs.StringVar(&c.nodeID, "node-id", "", "node id in the <prefix>_shards bucket, unique per running node (default: random)")
	fs.DurationVar(&c.checkpoint, "checkpoint-interval", mesh.DefaultCheckpointInterval, "how often journalled state is written to <prefix>_state (at most a quarter of --state-ttl)")
	fs.DurationVar(&c.asyncInterval, "async-interval", mesh.DefaultAsyncInterval, "write-behind interval of async-mode policies (their overshoot bound grows with it: limitmesh policy explain)")
	fs.BoolVar(&c.journal, "journal", true, "write state through the state journal (false: one compare-and-swap per key and batch)")
	fs.StringVar(&c.region, "region", "default", "region of this node; with --gateway-listen the name of the embedded server's cluster and gateway in a NATS supercluster")
	fs.StringVar(&c.gatewayListen, "gateway-listen", "", "host:port for gateway connections from other regions (joins a NATS supercluster; needs --cluster-listen and --region)")
	fs.Var(&c.gateways, "gateways", "comma-separated gateways of other regions, name=nats://h:p (one entry per server of a region)")
	c.usageMaxBytes = mesh.DefaultUsageMaxBytes
	fs.BoolVar(&c.usage, "usage", true, "publish a usage record per decision to <PREFIX>_USAGE and keep the ledger <prefix>_ledger (false: no usage stream, ledger or shadow evaluation)")
	fs.DurationVar(&c.usageInterval, "usage-interval", mesh.DefaultUsageInterval, "most time a usage record waits before its batch is published")
	fs.DurationVar(&c.usageRetention, "usage-retention", mesh.DefaultUsageRetention, "max age of the records in the usage stream this node creates")
	fs.Var(&c.usageMaxBytes, "usage-max-bytes", "max size of the usage stream this node creates, in bytes or with a unit: 1GiB, 512MiB, 64KiB (oldest records go first)")
	fs.StringVar(&c.roles, "roles", mesh.AllRoles.String(), "what this node does, comma-separated: decide (serve decisions, own partitions), ledger (may run the usage ledger), shadow (may run the shadow evaluator)")
	fs.StringVar(&c.envoyListen, "envoy-listen", "", "host:port of Envoy's rate limit service (gRPC envoy.service.ratelimit.v3.RateLimitService, with health checking and reflection); off when empty")
	return c, func(args []string) error {
		if err := parseFlags(fs, args, s); err != nil {
			return err
		}
		fs.Visit(func(f *flag.Flag) {
			c.prefixSet = c.prefixSet || f.Name == "prefix"
			c.regionSet = c.regionSet || f.Name == "region"
			c.rolesSet = c.rolesSet || f.Name == "roles"
		})
		if err := c.validate(); err != nil {
			return &exitError{code: 2, err: err} // a bad flag value, like a parse error
		}
		return nil
	}
}

func (c *serveConfig) validate() error {
	switch {
	case !prefixRE.MatchString(c.prefix):
		return fmt.Errorf("--prefix %q: must match %s", c.prefix, prefixRE)
	case c.decisionTimeout <= 0:
		return errors.New("--decision-timeout must be positive")
	case c.replicas < 1 || c.replicas > 5:
		return fmt.Errorf("--replicas %d: must be 1..5", c.replicas)
	case c.stateTTL < time.Second:
		return errors.New("--state-ttl must be at least 1s")
	case c.drainTimeout <= 0:
		return errors.New("--drain-timeout must be positive")
	case c.partitions < 1 || c.partitions > mesh.MaxPartitions:
		return fmt.Errorf("--partitions %d: must be 1..%d", c.partitions, mesh.MaxPartitions)
	case c.checkpoint <= 0:
		return errors.New("--checkpoint-interval must be positive")
	case c.asyncInterval <= 0 || c.asyncInterval > time.Minute:
		return fmt.Errorf("--async-interval %v: must be positive and at most 1m", c.asyncInterval)
	case c.lease < mesh.MinLeaseTime:
		return fmt.Errorf("--lease %v: must be at least %v", c.lease, mesh.MinLeaseTime)
	case c.nodeID != "" && !nodeIDRE.MatchString(c.nodeID):
		return fmt.Errorf("--node-id %q: must match %s", c.nodeID, nodeIDRE)
	case c.usageInterval <= 0 || c.usageInterval > time.Minute:
		return fmt.Errorf("--usage-interval %v: must be positive and at most 1m", c.usageInterval)
	case c.usageRetention < time.Minute:
		return fmt.Errorf("--usage-retention %v: must be at least 1m", c.usageRetention)
	case c.usageMaxBytes < minUsageMaxBytes:
		return fmt.Errorf("--usage-max-bytes %v: must be at least 1MiB (a usage message is up to 256KiB)", c.usageMaxBytes)
	case c.natsURL == "" && c.dataDir == "":
		return errors.New("--data must name a directory for the embedded server")
	case c.natsURL != "" && (c.clusterListen != "" || len(c.routes) > 0 || c.gatewayListen != "" || len(c.gateways) > 0):
		return errors.New("--cluster-listen, --routes, --gateway-listen and --gateways configure the embedded server; they cannot be used with --nats-url")
	case c.envoyListen != "" && !validListen(c.envoyListen):
		return fmt.Errorf("--envoy-listen %q: want host:port with a port 0..65535", c.envoyListen)
	}
	if _, err := parseLevel(c.logLevel); err != nil {
		return err
	}
	if err := c.validateRoles(); err != nil {
		return err
	}
	if c.envoyListen != "" && !c.roleSet.Has(mesh.RoleDecide) {
		return fmt.Errorf("--envoy-listen needs the decide role (--roles %q): the bridge's node serves it", c.roles)
	}
	return c.validateRegion()
}

// validateRoles parses --roles. Without the usage stream (--usage=false)
// the ledger and the shadow evaluator have nothing to read: naming either
// there is an error (the default roles name them and are accepted, as
// they always were, with the two roles idle).
func (c *serveConfig) validateRoles() error {
	r, err := mesh.ParseRoles(c.roles)
	if err != nil {
		return fmt.Errorf("--roles %q: want one or more of decide, ledger and shadow, comma-separated", c.roles)
	}
	if !c.usage && c.rolesSet && (r.Has(mesh.RoleLedger) || r.Has(mesh.RoleShadow)) {
		return fmt.Errorf("--roles %q: ledger and shadow read the usage stream, which --usage=false turns off", c.roles)
	}
	c.roleSet = r
	return nil
}

// validateRegion checks --region, --gateway-listen and --gateways, and
// settles the cluster name: --cluster-name when given, else the region
// when --region is given, else mesh.DefaultClusterName. Both given must
// name the same cluster: a region's servers form the cluster named after
// it.
func (c *serveConfig) validateRegion() error {
	if mesh.CheckRegion(c.region) != nil {
		return fmt.Errorf("--region %q: must be 1..32 of a-z, 0-9, '_' and '-', starting with a letter or digit", c.region)
	}
	switch {
	case c.clusterName == "" && c.regionSet:
		c.clusterName = c.region
	case c.clusterName == "":
		c.clusterName = mesh.DefaultClusterName
	case c.regionSet && c.clusterName != c.region:
		return fmt.Errorf("--cluster-name %q and --region %q differ: a region's servers form the NATS cluster named after it (give --region alone)", c.clusterName, c.region)
	}
	if c.gatewayListen == "" {
		if len(c.gateways) > 0 {
			return errors.New("--gateways needs --gateway-listen: a server joins other regions through its own gateway")
		}
		return nil
	}
	switch {
	case !validHostPort(c.gatewayListen):
		return fmt.Errorf("--gateway-listen %q: want host:port with a port 1..65535", c.gatewayListen)
	case c.clusterListen == "":
		return errors.New("--gateway-listen needs --cluster-listen: a region is a NATS cluster, and gateways join clusters")
	case !c.regionSet:
		return errors.New("--gateway-listen needs --region: the region names this server's cluster and gateway")
	}
	c.gatewayURLs = map[string][]string{}
	for _, e := range c.gateways {
		name, u, ok := strings.Cut(e, "=")
		if !ok || mesh.CheckRegion(name) != nil {
			return fmt.Errorf("--gateways entry %q: want region=nats://host:port with a region name of a-z, 0-9, '_' and '-'", e)
		}
		if _, err := mesh.ParseGatewayURL(u); err != nil {
			return fmt.Errorf("--gateways entry %q: want region=nats://host:port (port 1..65535)", e)
		}
		c.gatewayURLs[name] = append(c.gatewayURLs[name], u)
	}
	return nil
}

// loadAuth reads the --auth deployment directory and fits the flags to it:
// --prefix defaults to the deployment's and must equal it, and the node's
// credentials default to DIR/node.creds.
func (c *serveConfig) loadAuth() (*auth.Deployment, error) {
	d, err := auth.Load(c.authDir)
	if err != nil {
		return nil, fmt.Errorf("--auth: %v", err)
	}
	if !c.prefixSet {
		c.prefix = d.Prefix
	} else if c.prefix != d.Prefix {
		return nil, fmt.Errorf("--prefix %q: the deployment in %s serves prefix %q", c.prefix, c.authDir, d.Prefix)
	}
	if c.creds == "" {
		c.creds = d.NodeCreds()
	}
	return d, nil
}

// tenantBinder returns the tenant binding of a secured node (nil for an
// unsecured one): from the deployment directory of --auth, or, for a node
// that joins with only --creds, learnt from the servers (its own account
// and the key that signed it). A deployment without the account lookup is
// refused: a secured node must not decide without knowing its callers.
func (c *serveConfig) tenantBinder(ctx context.Context, nc *nats.Conn, secured *auth.Deployment) (*auth.Binder, error) {
	switch {
	case secured != nil:
		return secured.Binder(nc, c.decisionTimeout)
	case c.creds == "":
		return nil, nil
	}
	lctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	b, err := auth.DiscoverBinder(lctx, nc, c.creds, c.decisionTimeout)
	if err != nil {
		return nil, fmt.Errorf("--creds: cannot bind tenants to their accounts (a deployment of `limitmesh auth init` gives the node the account lookup it needs): %v", err)
	}
	return b, nil
}

// validListen reports whether hp is host:port with a port 0..65535 (0: any
// free port).
func validListen(hp string) bool {
	_, ps, err := net.SplitHostPort(hp)
	if err != nil {
		return false
	}
	p, err := strconv.Atoi(ps)
	return err == nil && p >= 0 && p <= 65535
}

// validHostPort reports whether hp is host:port with a port 1..65535.
func validHostPort(hp string) bool {
	_, ps, err := net.SplitHostPort(hp)
	if err != nil {
		return false
	}
	p, err := strconv.Atoi(ps)
	return err == nil && p >= 1 && p <= 65535
}

func parseLevel(s string) (slog.Level, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(s)); err != nil {
		return 0, fmt.Errorf("--log-level %q: want debug, info, warn or error", s)
	}
	return l, nil
}

func runServe(ctx context.Context, args []string, s stdio) error {
	c, parse := serveFlags(s)
	if err := parse(args); err != nil {
		return err
	}
	level, _ := parseLevel(c.logLevel)
	log := slog.New(slog.NewTextHandler(s.err, &slog.HandlerOptions{Level: level}))
	var secured *auth.Deployment
	if c.authDir != "" {
		d, err := c.loadAuth()
		if err != nil {
			return err
		}
		secured = d
	}

	// Bind the HTTP address first: a taken port is a clear error before
	// anything else starts.
	hl, err := net.Listen("tcp", c.httpAddr)
	if err != nil {
		return fmt.Errorf("--http %s: %v", c.httpAddr, err)
	}
	defer hl.Close()
	var el net.Listener
	if c.envoyListen != "" {
		if el, err = net.Listen("tcp", c.envoyListen); err != nil {
			return fmt.Errorf("--envoy-listen %s: %v", c.envoyListen, err)
		}
		defer el.Close()
	}
	var reg *prometheus.Registry // the node's (startNode), for the bridge's metrics

	var (
		nc      *nats.Conn
		emb     *mesh.Embedded
		connect func(name string) (*nats.Conn, error) // more connections like nc
	)
	if c.natsURL == "" {
		ec := mesh.EmbeddedConfig{
			Listen:        c.natsListen,
			DataDir:       c.dataDir,
			ServerName:    c.serverName,
			ClusterName:   c.clusterName,
			ClusterListen: c.clusterListen,
			Routes:        c.routes,
			Region:        regionIf(c.regionSet, c.region),
			GatewayListen: c.gatewayListen,
			Gateways:      c.gatewayURLs,
			Logger:        log,
		}
		if secured != nil {
			ec.Configure = secured.Configure
		}
		emb, err = mesh.StartEmbedded(ec)
		if err != nil {
			return fmt.Errorf("embedded NATS: %v", err)
		}
		defer emb.Shutdown()
		opts := []nats.Option{nats.Name("limitmesh-node")}
		if c.creds != "" {
			opts = append(opts, nats.UserCredentials(c.creds))
		}
		nc, err = emb.Connect(opts...)
		if err != nil {
			return fmt.Errorf("connect to the embedded NATS server: %v", err)
		}
		connect = func(name string) (*nats.Conn, error) {
			return emb.Connect(append([]nats.Option{nats.Name(name)}, opts[1:]...)...)
		}
		log.Info("embedded NATS server started", "listen", c.natsListen, "data", c.dataDir,
			"cluster", c.clusterName, "gateway", c.gatewayListen, "secured", secured != nil)
	} else {
		nc, err = connectNATS(c.natsURL, "limitmesh-node", c.creds, 5*time.Second, nats.MaxReconnects(-1))
		if err != nil {
			return err
		}
		connect = func(name string) (*nats.Conn, error) {
			return connectNATS(c.natsURL, name, c.creds, 5*time.Second, nats.MaxReconnects(-1))
		}
	}
	defer nc.Close()
	binder, err := c.tenantBinder(ctx, nc, secured)
	if err != nil {
		return err
	}
	if binder != nil {
		log.Info("secured: each request's tenant is its calling account's", "limiter_account", binder.LimiterAccount())
	}

	startCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	if emb != nil && c.clusterListen != "" {
		waitJetStream(startCtx, emb, log)
	}
	node, reg, err := startNode(startCtx, nc, mesh.NodeConfig{
		Prefix:          c.prefix,
		DecisionTimeout: c.decisionTimeout,
		Replicas:        c.replicas,
		StateTTL:        c.stateTTL,
		Logger:          log,
		Partitions:      c.partitions,
		LeaseTime:       c.lease,
		NodeID:          c.nodeID,
		Roles:           c.roleSet,

		CheckpointInterval: c.checkpoint,
		AsyncInterval:      c.asyncInterval,
		NoJournal:          !c.journal,
		Binder:             binder,

		NoUsage:        !c.usage,
		UsageInterval:  c.usageInterval,
		UsageRetention: c.usageRetention,
		UsageMaxBytes:  int64(c.usageMaxBytes),
	}, log)
	cancel()
	if err != nil {
		return fmt.Errorf("start node: %w", err)
	}
	var bridge *envoyBridge
	if el != nil {
		if bridge, err = startEnvoy(el, connect, node, c.prefix, c.decisionTimeout, reg, log); err != nil {
			stopCtx, cancel := context.WithTimeout(context.Background(), c.drainTimeout)
			_ = node.Stop(stopCtx)
			cancel()
			return err
		}
	}

	// The serving line comes before the first /readyz answer: whoever saw
	// the node ready can read it in the log.
	attrs := []any{"http", hl.Addr().String(), "region", c.region, "roles", c.roleSet.String(), "version", Version}
	if c.roleSet.Has(mesh.RoleDecide) {
		attrs = append([]any{"subject", c.prefix + ".v1.decide"}, attrs...)
	}
	log.Info("limitmesh serving", attrs...)
	hs := &http.Server{Handler: node.HTTPHandler(), ReadHeaderTimeout: 5 * time.Second}
	go func() {
		if err := hs.Serve(hl); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("http server stopped", "err", err)
		}
	}()

	<-ctx.Done()
	log.Info("draining")
	stopCtx, cancel := context.WithTimeout(context.Background(), c.drainTimeout)
	defer cancel()
	if bridge != nil {
		bridge.stop(stopCtx, log)
	}
	if err := node.Stop(stopCtx); err != nil {
		log.Warn("drain incomplete", "err", err)
	}
	_ = hs.Shutdown(stopCtx)
	_ = nc.Drain()
	log.Info("stopped")
	return nil
}

// startAttempt bounds one attempt to start a node. A JetStream API request
// sent while a cluster has no meta leader may get no reply at all, so an
// attempt must be short enough to leave room for the next.
const startAttempt = 5 * time.Second

// startNode creates and starts a node, retrying until ctx ends: in a NATS
// cluster that is still forming, the meta leader may not be elected yet and
// a bucket with several replicas cannot be created until enough servers
// have joined.
func startNode(ctx context.Context, nc *nats.Conn, cfg mesh.NodeConfig, log *slog.Logger) (*mesh.Node, *prometheus.Registry, error) {
	for attempt := 1; ; attempt++ {
		// A registry of its own for each attempt: a failed attempt's
		// collectors stay registered in its registry.
		reg := prometheus.NewRegistry()
		cfg.Registry = reg
		node, err := mesh.NewNode(nc, cfg)
		if err != nil {
			return nil, nil, err
		}
		actx, cancel := context.WithTimeout(ctx, startAttempt)
		err = node.Start(actx)
		cancel()
		if err == nil {
			return node, reg, nil
		}
		stopCtx, cancel := context.WithTimeout(context.Background(), time.Second)
		_ = node.Stop(stopCtx)
		cancel()
		if ctx.Err() != nil {
			return nil, nil, err
		}
		log.Warn("node start failed, retrying", "attempt", attempt, "err", err)
		select {
		case <-ctx.Done():
			return nil, nil, err
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// waitJetStream waits (bounded by ctx) until the embedded server is current
// with its cluster's JetStream meta leader, so the node's first requests are
// not sent into a cluster that cannot answer them yet.
func waitJetStream(ctx context.Context, emb *mesh.Embedded, log *slog.Logger) {
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	for !emb.Server().JetStreamIsCurrent() {
		select {
		case <-ctx.Done():
			log.Warn("no JetStream meta leader yet", "err", ctx.Err())
			return
		case <-t.C:
		}
	}
}

// regionIf returns region when it was given and "" otherwise (the embedded
// server then keeps its cluster name as settled by validateRegion).
func regionIf(given bool, region string) string {
	if given {
		return region
	}
	return ""
}

// minUsageMaxBytes is the least --usage-max-bytes: a few of the largest
// usage messages (usage.MaxBatchBytes, 256 KiB, plus a record).
const minUsageMaxBytes = 1 << 20

// byteSize is a size flag in bytes: a whole number, optionally followed by
// a unit, B, KiB, MiB, GiB or TiB (powers of 1024) or KB, MB, GB or TB
// (powers of 1000), with or without a space; "1GiB", "512MiB", "1048576".
// It prints in the largest binary unit that divides it.
type byteSize int64

var byteUnits = []struct {
	name string
	mult int64
}{
	{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10},
	{"TB", 1e12}, {"GB", 1e9}, {"MB", 1e6}, {"KB", 1e3}, {"B", 1},
}

func (b *byteSize) String() string {
	for _, u := range byteUnits[:4] {
		if *b != 0 && int64(*b)%u.mult == 0 {
			return strconv.FormatInt(int64(*b)/u.mult, 10) + u.name
		}
	}
	return strconv.FormatInt(int64(*b), 10)
}

func (b *byteSize) Set(v string) error {
	num := strings.TrimSpace(v)
	mult := int64(1)
	for _, u := range byteUnits {
		if n, ok := strings.CutSuffix(num, u.name); ok {
			num, mult = strings.TrimSpace(n), u.mult
			break
		}
	}
	n, err := strconv.ParseInt(num, 10, 64)
	if err != nil || n < 0 {
		return fmt.Errorf("want a number of bytes, optionally with a unit (1GiB, 512MiB, 64KiB, 1000000)")
	}
	if n > math.MaxInt64/mult {
		return fmt.Errorf("%s is too large", v)
	}
	*b = byteSize(n * mult)
	return nil
}
