package mesh

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
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
			name = "limitmesh"
		}
		opts.Cluster = server.ClusterOpts{Name: name, Host: host, Port: port}
		for _, r := range cfg.Routes {
			opts.Routes = append(opts.Routes, server.RoutesFromStr(r)...)
		}
	}
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

// Connect opens an in-process connection to the server.
func (e *Embedded) Connect(opts ...nats.Option) (*nats.Conn, error) {
	return nats.Connect("", append([]nats.Option{nats.InProcessServer(e.srv)}, opts...)...)
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
