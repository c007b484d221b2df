package mesh

import (
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
)

// EmbeddedConfig configures a nats-server with JetStream running inside the
// limitmesh process.
type EmbeddedConfig struct {
	// Listen is host:port for client connections ("127.0.0.1:4222"); port
	// -1 picks a free port. "" starts no TCP listener: only in-process
	// connections ([Embedded.Connect]).
	Listen string
	// DataDir is where JetStream stores its files. Required.
	DataDir string
	// ServerName names the server (default: derived by nats-server).
	ServerName string
	// ClusterName, ClusterListen and Routes make the server a member of a
	// NATS cluster (ClusterListen "host:port"; Routes "nats://h:p" URLs).
	ClusterName   string
	ClusterListen string
	Routes        []string
	// Region, GatewayListen and Gateways make the server a member of a NATS
	// supercluster with one cluster per region (CONTRACT.md §8). Region
	// ([a-z0-9][a-z0-9_-]{0,31}) names the server's cluster and its gateway,
	// which nats-server requires to be the same: with ClusterName "" the
	// cluster takes the region's name, and ClusterName and Region set to
	// different names are an error. GatewayListen ("host:port", port -1
	// picks a free one) accepts gateway connections from the other regions;
	// it needs ClusterListen and Region. Gateways maps region names to
	// their gateway URLs ("nats://h:p") to connect to; it needs
	// GatewayListen. An entry for the server's own region is ignored, so
	// every server of a supercluster can be given the same map. List every
	// server of every region: nats-server sizes the JetStream meta group it
	// expects at first start from the routes plus the other regions' URLs.
	Region        string
	GatewayListen string
	Gateways      map[string][]string
	// Logger receives the server's log lines at Debug level; nil: none.
	Logger *slog.Logger
	// ReadyTimeout bounds the wait for the server to accept connections
	// (default 30 s: a cluster member on a loaded machine can take a while).
	ReadyTimeout time.Duration
	// Configure, when set, adjusts the server's options last, before the
	// server is created: a secured deployment sets operator mode and its
	// account resolver here (auth.Deployment.Configure). An error stops
	// the start.
	Configure func(*server.Options) error
}

// Embedded is a running embedded nats-server. It is safe for concurrent use.
type Embedded struct {
	srv *server.Server
}

// StartEmbedded starts a nats-server with JetStream and returns once it
// accepts connections.
func StartEmbedded(cfg EmbeddedConfig) (*Embedded, error) {
	if cfg.DataDir == "" {
		return nil, fmt.Errorf("mesh: embedded server: %w: DataDir is required", ErrConfig)
	}
	opts := &server.Options{
		ServerName: cfg.ServerName,
		JetStream:  true,
		StoreDir:   cfg.DataDir,
		NoSigs:     true,
		NoLog:      cfg.Logger == nil,
		MaxPayload: 1 << 20,
	}
	if cfg.Listen == "" {
		opts.DontListen = true
	} else {
		host, port, err := splitHostPort(cfg.Listen)
		if err != nil {
			return nil, fmt.Errorf("mesh: embedded server listen %q: %w: %v", cfg.Listen, ErrConfig, err)
		}
		opts.Host, opts.Port = host, port
	}
	if cfg.ClusterListen != "" {
		host, port, err := splitHostPort(cfg.ClusterListen)
		if err != nil {
			return nil, fmt.Errorf("mesh: embedded cluster listen %q: %w: %v", cfg.ClusterListen, ErrConfig, err)
		}
		name := cfg.ClusterName
		if name == "" {
			name = cfg.Region
		}
		if name == "" {
			name = DefaultClusterName
		}
		opts.Cluster = server.ClusterOpts{Name: name, Host: host, Port: port}
		for _, r := range cfg.Routes {
			opts.Routes = append(opts.Routes, server.RoutesFromStr(r)...)
		}
	}
	gw, err := gatewayOptions(cfg)
	if err != nil {
		return nil, err
	}
	opts.Gateway = gw
	if cfg.Configure != nil {
		if err := cfg.Configure(opts); err != nil {
			return nil, fmt.Errorf("mesh: embedded server: %w", err)
		}
	}
	srv, err := server.NewServer(opts)
	if err != nil {
		return nil, fmt.Errorf("mesh: embedded server: %w", err)
	}
	if cfg.Logger != nil {
		srv.SetLoggerV2(&slogAdapter{l: cfg.Logger}, false, false, false)
	}
	go srv.Start()
	wait := cfg.ReadyTimeout
	if wait <= 0 {
		wait = 30 * time.Second
	}
	if !srv.ReadyForConnections(wait) {
		srv.Shutdown()
		return nil, fmt.Errorf("mesh: embedded server not ready after %s", wait)
	}
	return &Embedded{srv: srv}, nil
}

// DefaultClusterName is the name of an embedded server's cluster when
// neither EmbeddedConfig.ClusterName nor EmbeddedConfig.Region is set.
const DefaultClusterName = "limitmesh"

// regionRE is the form of a region name: a NATS cluster and gateway name
// that is also a single subject token.
var regionRE = regexp.MustCompile(`^[a-z0-9][a-z0-9_-]{0,31}$`)

// CheckRegion returns nil if name is a valid region name and otherwise an
// error wrapping [ErrConfig] that says why.
func CheckRegion(name string) error {
	if !regionRE.MatchString(name) {
		return fmt.Errorf("%w: region %q must match %s", ErrConfig, name, regionRE)
	}
	return nil
}

// gatewayOptions checks the supercluster settings of cfg and returns the
// server's gateway options (the zero value without GatewayListen).
func gatewayOptions(cfg EmbeddedConfig) (server.GatewayOpts, error) {
	var gw server.GatewayOpts
	if cfg.Region != "" {
		if err := CheckRegion(cfg.Region); err != nil {
			return gw, fmt.Errorf("mesh: embedded server: %w", err)
		}
		if cfg.ClusterName != "" && cfg.ClusterName != cfg.Region {
			return gw, fmt.Errorf("mesh: embedded server: %w: cluster name %q and region %q differ (a region's servers form the cluster named after it)",
				ErrConfig, cfg.ClusterName, cfg.Region)
		}
	}
	if cfg.GatewayListen == "" {
		if len(cfg.Gateways) > 0 {
			return gw, fmt.Errorf("mesh: embedded server: %w: gateways to other regions need a gateway listen address", ErrConfig)
		}
		return gw, nil
	}
	switch {
	case cfg.ClusterListen == "":
		return gw, fmt.Errorf("mesh: embedded server: %w: a gateway needs a cluster (ClusterListen)", ErrConfig)
	case cfg.Region == "":
		return gw, fmt.Errorf("mesh: embedded server: %w: a gateway needs a region (its name)", ErrConfig)
	}
	host, port, err := splitHostPort(cfg.GatewayListen)
	if err == nil && port == 0 {
		err = errors.New("port 0 (-1 picks a free port)")
	}
	if err != nil {
		return gw, fmt.Errorf("mesh: embedded gateway listen %q: %w: %v", cfg.GatewayListen, ErrConfig, err)
	}
	gw = server.GatewayOpts{Name: cfg.Region, Host: host, Port: port}
	for _, name := range slices.Sorted(maps.Keys(cfg.Gateways)) { // a deterministic order of remotes
		if err := CheckRegion(name); err != nil {
			return gw, fmt.Errorf("mesh: embedded server gateways: %w", err)
		}
		urls := cfg.Gateways[name]
		if len(urls) == 0 {
			return gw, fmt.Errorf("mesh: embedded server: %w: gateway %q has no URL", ErrConfig, name)
		}
		rg := &server.RemoteGatewayOpts{Name: name}
		for _, raw := range urls {
			u, err := ParseGatewayURL(raw)
			if err != nil {
				return gw, fmt.Errorf("mesh: embedded server gateway %q: %w", name, err)
			}
			rg.URLs = append(rg.URLs, u)
		}
		gw.Gateways = append(gw.Gateways, rg)
	}
	return gw, nil
}

// ParseGatewayURL parses a gateway URL "nats://host:port" (port 1..65535)
// and returns an error wrapping [ErrConfig] for anything else.
func ParseGatewayURL(raw string) (*url.URL, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return nil, fmt.Errorf("%w: gateway URL %q: %v", ErrConfig, raw, err)
	}
	if u.Scheme != "nats" || u.Hostname() == "" || u.Path != "" || u.RawQuery != "" {
		return nil, fmt.Errorf("%w: gateway URL %q: want nats://host:port", ErrConfig, raw)
	}
	if p, err := strconv.Atoi(u.Port()); err != nil || p < 1 || p > 65535 {
		return nil, fmt.Errorf("%w: gateway URL %q: want a port 1..65535", ErrConfig, raw)
	}
	return u, nil
}

func splitHostPort(hp string) (string, int, error) {
	host, ps, err := net.SplitHostPort(hp)
	if err != nil {
		return "", 0, err
	}
	port, err := strconv.Atoi(ps)
	if err != nil {
		return "", 0, err
	}
	if port < -1 || port > 65535 {
		return "", 0, errors.New("port out of range")
	}
	return host, port, nil
}

// ClientURL is the nats:// URL of the client listener ("" without one).
func (e *Embedded) ClientURL() string {
	if e.srv.Addr() == nil {
		return ""
	}
	return e.srv.ClientURL()
}

// GatewayURL is the nats:// URL of the gateway listener ("" without one).
func (e *Embedded) GatewayURL() string {
	a := e.srv.GatewayAddr()
	if a == nil {
		return ""
	}
	return "nats://" + a.String()
}

// Connect opens an in-process connection to the server. Its writes have
// no deadline (nats.FlusherTimeout 0; opts may set one): on an in-process
// pipe, nats.go's default deadline arms and stops a timer around every
// flush, which cost about a fifth of the throughput of request-reply in
// limitmesh bench (the node's decisions and the raw echo alike). A write
// to the in-process server blocks only while the server does not read,
// and a server that stops answering is still found by the connection's
// pings, which close it.
func (e *Embedded) Connect(opts ...nats.Option) (*nats.Conn, error) {
	return nats.Connect("", append([]nats.Option{nats.InProcessServer(e.srv), nats.FlusherTimeout(0)}, opts...)...)
}

// Server returns the underlying nats-server (for tests and tools).
func (e *Embedded) Server() *server.Server { return e.srv }

// Shutdown stops the server and waits until it has stopped.
func (e *Embedded) Shutdown() {
	e.srv.Shutdown()
	e.srv.WaitForShutdown()
}

// slogAdapter forwards nats-server log lines to a slog.Logger.
type slogAdapter struct{ l *slog.Logger }

func (a *slogAdapter) Noticef(format string, v ...any) { a.l.Debug(fmt.Sprintf(format, v...)) }
func (a *slogAdapter) Warnf(format string, v ...any)   { a.l.Warn(fmt.Sprintf(format, v...)) }
func (a *slogAdapter) Fatalf(format string, v ...any)  { a.l.Error(fmt.Sprintf(format, v...)) }
func (a *slogAdapter) Errorf(format string, v ...any)  { a.l.Error(fmt.Sprintf(format, v...)) }
func (a *slogAdapter) Debugf(format string, v ...any)  { a.l.Debug(fmt.Sprintf(format, v...)) }
func (a *slogAdapter) Tracef(format string, v ...any)  {}
